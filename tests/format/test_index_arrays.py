from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import unickpt
from unickpt import CheckpointCorruptError
from unickpt.format.codec import decode_index, encode_index
from unickpt.format.index_arrays import concat_indexes, decode_index_arrays
from unickpt.format.metadata import ChunkMeta
from unickpt.format.references import FileLocation, FileTable

SUMS = ("00112233445566aa", "ffeeddccbbaa9988")


def _c(offsets: tuple[int, ...], lengths: tuple[int, ...], at: int, file: int = 0) -> ChunkMeta:
    n = 4
    for x in lengths:
        n *= x
    return ChunkMeta(offsets, lengths, file, at, n, SUMS[: 1 + (at // 64) % 2])


LAYOUTS = {
    "row shards": [("w", _c((0, 0), (4, 8), 0)), ("w", _c((4, 0), (4, 8), 128))],
    "column shards of two tensors": [
        ("a", _c((0, 2), (6, 2), 0)),
        ("b", _c((0, 0), (3, 5), 64)),
        ("a", _c((0, 0), (6, 2), 192)),
    ],
    "0-d, 1-d and 3-d tensors in one index": [
        ("step", _c((), (), 0)),
        ("bias", _c((3,), (5,), 64)),
        ("cube", _c((0, 1, 0), (2, 1, 4), 128)),
        ("bias", _c((0,), (3,), 192)),
    ],
    "flat range as boxes": [
        ("f", _c((0, 5), (1, 3), 0)),
        ("f", _c((1, 0), (2, 8), 64)),
        ("f", _c((3, 0), (1, 2), 192)),
    ],
    "empty box": [
        ("e", ChunkMeta((0, 0), (0, 4), 0, 0, 0, SUMS[:1])),
        ("e", ChunkMeta((0, 0), (2, 4), 0, 0, 32, SUMS[:1])),
    ],
    "no chunks": [],
}


def _old(raw: bytes, file: int, files: FileTable | None = None) -> dict[str, list[ChunkMeta]]:
    out: dict[str, list[ChunkMeta]] = {}
    for key, chunk in decode_index(raw, "index", file, files):
        out.setdefault(key, []).append(chunk)
    return out


def _new(raw: bytes, file: int, files: FileTable | None = None) -> dict[str, list[ChunkMeta]]:
    found = decode_index_arrays(raw, "index", file, files)
    return {key: found.tensor(key).chunks() for key in found.keys}


@pytest.mark.parametrize("entries", LAYOUTS.values(), ids=list(LAYOUTS))
@pytest.mark.parametrize("version", [1, 2])
def test_arrays_hold_exactly_what_objects_hold(entries: list[tuple[str, ChunkMeta]], version: int):
    doc = json.loads(encode_index("data-x-00003.bin", entries))
    doc["version"] = version
    raw = json.dumps(doc).encode()
    assert _new(raw, 3) == _old(raw, 3)
    assert list(_new(raw, 3)) == list(dict.fromkeys(k for k, _ in entries))


def test_references_numbered_as_the_object_decoder_numbers_them() -> None:
    refs = [FileLocation("step-1", "data-a-00000.bin"), FileLocation("step-2", "data-b-00001.bin")]
    entries = [
        ("x", _c((0, 0), (2, 2), 0)),
        ("y", _c((0, 0), (2, 2), 64, file=2)),
        ("x", _c((2, 0), (2, 2), 128, file=1)),
        ("y", _c((2, 0), (2, 2), 192, file=1)),
    ]
    raw = encode_index("data-c-00000.bin", entries, refs)
    old_table, new_table = FileTable(["data-c-00000.bin"]), FileTable(["data-c-00000.bin"])
    assert _new(raw, 0, new_table) == _old(raw, 0, old_table)
    assert new_table.names() == old_table.names()
    assert new_table.names()[1:] == ("../step-2/data-b-00001.bin", "../step-1/data-a-00000.bin")


def test_several_indexes_concatenated_per_tensor() -> None:
    first = encode_index("d0", [("a", _c((0,), (4,), 0)), ("b", _c((0, 0), (1, 1), 64))])
    second = encode_index("d1", [("b", _c((1, 0), (1, 1), 0)), ("a", _c((4,), (4,), 64))])
    both = concat_indexes(
        [decode_index_arrays(first, "i0", 0), decode_index_arrays(second, "i1", 1)]
    )
    rows = both.by_key()
    assert both.tensor("a", rows["a"]).chunks() == [_old(first, 0)["a"][0], _old(second, 1)["a"][0]]
    assert both.tensor("b", rows["b"]).chunks() == [_old(first, 0)["b"][0], _old(second, 1)["b"][0]]


def test_a_saved_checkpoint_decodes_alike(tmp_path: Path) -> None:
    state = {
        "w": torch.arange(3 * 5, dtype=torch.float32).reshape(3, 5),
        "b": torch.ones(7, dtype=torch.bfloat16),
        "s": torch.tensor(2.5),
        "big": torch.zeros(600, 1024),  # three checksum segments
    }
    unickpt.save(tmp_path / "ckpt", state)
    (index,) = (tmp_path / "ckpt").glob("index-*.json")
    raw = index.read_bytes()
    assert _new(raw, 0) == _old(raw, 0)
    assert len(_new(raw, 0)["big"][0].checksums) == 3


FORGED = {
    "offsets and lengths of different sizes": lambda c: c[0].__setitem__(1, [0]),
    "a negative byte offset": lambda c: c[0].__setitem__(3, -64),
    "a reference outside refs": lambda c: c[0].append(4),
    "an eighth element": lambda c: c[0].extend([0, 0]),
    "five elements": lambda c: c[0].pop(),
}


@pytest.mark.parametrize("forge", FORGED.values(), ids=list(FORGED))
def test_malformed_index_refused_by_both_decoders(forge) -> None:
    doc = json.loads(encode_index("d", LAYOUTS["row shards"]))
    forge(doc["chunks"])
    raw = json.dumps(doc).encode()
    with pytest.raises(CheckpointCorruptError, match="the index is not well formed"):
        decode_index(raw, "idx", 0, FileTable(["d"]))
    with pytest.raises(CheckpointCorruptError, match="the index is not well formed"):
        decode_index_arrays(raw, "idx", 0, FileTable(["d"]))


def test_row_runs_decode_alike() -> None:
    pieces = [
        ChunkMeta((0, 0), (2, 4), 0, 0, 32, SUMS[:1]),
        ChunkMeta((2, 0), (3, 4), 1, 4096, 48, SUMS[1:]),
        ChunkMeta((5, 0), (1, 4), 0, 64, 16, SUMS[:1]),
    ]
    refs = [FileLocation("step-1", "data-a-00000.bin")]
    raw = encode_index("d", [("other", _c((0,), (4,), 128))], refs, [("table", pieces)])
    assert "runs" in json.loads(raw)
    old_table, new_table = FileTable(["d"]), FileTable(["d"])
    assert _new(raw, 0, new_table) == _old(raw, 0, old_table)
    assert new_table.names() == old_table.names()
    assert _new(raw, 0, FileTable(["d"]))["table"][1].file == 1


FORGED_BOUNDS = {
    "a chunk without checksums": (
        lambda d: d["chunks"][1].__setitem__(5, []),
        "idx: the chunk of 'w' has no checksums; expected one per segment",
    ),
    "a row run without checksums": (
        lambda d: d["runs"][0][7].__setitem__(0, ""),
        "the checksums of a row run of 't' are 0 characters, expected 16 per segment",
    ),
    "a chunk of 100 dimensions beside 2-d ones": (
        lambda d: (
            d["chunks"][0].__setitem__(1, [0] * 100) or d["chunks"][0].__setitem__(2, [1] * 100)
        ),
        "has 100 offsets",
    ),
}


@pytest.mark.parametrize(("forge", "says"), FORGED_BOUNDS.values(), ids=list(FORGED_BOUNDS))
def test_index_bounds_refused_by_both_decoders(forge: Any, says: str) -> None:
    """What an index says is checked before it is used: every chunk carries its checksums
    (one per segment: a chunk without them would load unverified), and dimensions are
    bounded before rows of different dimensions are padded into one array."""
    run = [
        ChunkMeta((0, 0), (2, 4), 0, 0, 32, SUMS[:1]),
        ChunkMeta((2, 0), (1, 4), 0, 64, 16, SUMS[:1]),
    ]
    doc = json.loads(encode_index("d", LAYOUTS["row shards"], runs=[("t", run)]))
    forge(doc)
    raw = json.dumps(doc).encode()
    for decode in (decode_index, decode_index_arrays):
        with pytest.raises(CheckpointCorruptError, match=r"^idx: ") as info:
            decode(raw, "idx", 0, FileTable(["d"]))
        assert says in str(info.value)


def test_json_nested_too_deep_names_the_file() -> None:
    raw = (
        b'{"format":"unickpt-index","version":2,"chunks":' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    )
    for decode in (decode_index, decode_index_arrays):
        with pytest.raises(CheckpointCorruptError) as info:
            decode(raw, "ckpt/index-x-00000.json", 0)
        message = str(info.value)
        assert message.startswith("ckpt/index-x-00000.json: expected JSON written by unickpt")
        assert "RecursionError" in message and "the file is damaged" in message
