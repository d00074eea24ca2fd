from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from unickpt import CheckpointCorruptError, CheckpointVersionError, UnsafeObjectError
from unickpt.format.codec import (
    assemble,
    decode_commit,
    decode_index,
    decode_metadata,
    encode_commit,
    encode_index,
    encode_metadata,
)
from unickpt.format.metadata import (
    PER_RANK_ABSENT,
    ChunkMeta,
    CommitRecord,
    FileRef,
    Metadata,
    TensorMeta,
)
from unickpt.format.references import FileLocation, FileTable, parse_reference
from unickpt.format.values import decode_value, encode_value


def _meta() -> Metadata:
    return Metadata(
        world_size=2,
        files=("data-ab-00000.bin",),
        tensors={"w": TensorMeta("float32", (4, 2), "replicated", ())},
        objects={"step": 3},
        per_rank={"r": (1, 2)},
        segment_bytes=1 << 20,
        file_refs=(FileRef("data-ab-00000.bin", 32, "index-ab-00000.json", 10, "00"),),
    )


def test_metadata_and_index_roundtrip() -> None:
    meta = _meta()
    back = decode_metadata(encode_metadata(meta), "m")
    assert back.tensors["w"].shape == (4, 2) and back.file_refs == meta.file_refs
    chunk = ChunkMeta((0, 0), (4, 2), 0, 0, 32, ("aa",))
    entries = decode_index(encode_index("data-ab-00000.bin", [("w", chunk)]), "i", 0)
    full = assemble(back, [entries])
    assert full.tensors["w"].chunks == (chunk,)
    with pytest.raises(CheckpointCorruptError, match="does not describe"):
        assemble(back, [[("other", chunk)]])


def test_damaged_and_newer_metadata() -> None:
    raw = encode_metadata(_meta())
    with pytest.raises(CheckpointCorruptError, match="do not parse"):
        decode_metadata(raw[:-3], "m")
    doc = json.loads(raw)
    doc["version"] = 99
    with pytest.raises(CheckpointVersionError, match="Upgrade unickpt"):
        decode_metadata(json.dumps(doc).encode(), "m")
    del doc["files"]
    doc["version"] = 1
    with pytest.raises(CheckpointCorruptError, match="not well formed"):
        decode_metadata(json.dumps(doc).encode(), "m")
    record = CommitRecord("metadata-ab.json", 10, "00", "ab")
    assert decode_commit(encode_commit(record), "c") == record


def test_values_roundtrip_and_refuse_pickle() -> None:
    value = {"a": [1, 2.5, None, "x", b"\x01", (True, float("inf"))], "b": {}}
    enc = encode_value(value, "k", allow_pickle=False)
    assert json.loads(json.dumps(enc)) == enc
    assert decode_value(enc, "k", allow_pickle=False) == value
    with pytest.raises(UnsafeObjectError, match="allow_pickle=True"):
        encode_value({1, 2}, "k", allow_pickle=False)
    enc = encode_value({1, 2}, "k", allow_pickle=True)
    with pytest.raises(UnsafeObjectError, match="could run code"):
        decode_value(enc, "k", allow_pickle=False)
    with pytest.raises(CheckpointCorruptError, match="unknown tag"):
        decode_value({"$nope": 1}, "k", allow_pickle=False)


def test_version_2_aliases_and_absent_per_rank_values() -> None:
    meta = replace(_meta(), per_rank={"r": (PER_RANK_ABSENT, 2)}, aliases={"head": "w"})
    doc = json.loads(encode_metadata(meta))
    assert doc["version"] == 2
    assert doc["aliases"] == {"head": "w"}
    assert doc["per_rank"] == {"r": [{"$absent": True}, 2]}
    back = decode_metadata(json.dumps(doc).encode(), "m")
    assert back.tensor("head") == back.tensors["w"] and back.keys() == {"w", "head", "step", "r"}
    assert back.per_rank_value("r", 0) == (False, None)
    assert back.per_rank_value("r", 1) == (True, 2)
    assert back.per_rank_value("r", 2) == (False, None)
    assert back.first_per_rank("r") == (1, 2)
    doc["aliases"] = {"head": "nowhere"}
    with pytest.raises(CheckpointCorruptError, match="'head' is tied to 'nowhere'"):
        decode_metadata(json.dumps(doc).encode(), "m")


def test_version_1_metadata_still_reads() -> None:
    doc = json.loads(encode_metadata(_meta()))
    doc["version"] = 1
    del doc["aliases"]
    back = decode_metadata(json.dumps(doc).encode(), "m")
    assert back.version == 1 and back.aliases == {}
    assert back.per_rank_value("r", 1) == (True, 2)


def test_index_references_roundtrip() -> None:
    own = ChunkMeta((0, 0), (2, 2), 0, 0, 16, ("aa",))
    ref = ChunkMeta((2, 0), (2, 2), 1, 4096, 16, ("bb",))
    where = FileLocation("step-000000100", "data-cd-00000.bin")
    raw = encode_index("data-ab-00000.bin", [("w", own), ("w", ref)], [where])
    table = FileTable(["data-ab-00000.bin", "data-ab-00001.bin"])
    entries = decode_index(raw, "i", 1, table)
    assert [c.file for _, c in entries] == [1, 2]
    assert entries[1][1].byte_offset == 4096 and entries[1][1].checksums == ("bb",)
    assert table.names()[2] == "../step-000000100/data-cd-00000.bin"
    assert parse_reference(table.names()[2]) == where and parse_reference("data-x.bin") is None
    with pytest.raises(CheckpointCorruptError, match="read it with its refs"):
        decode_index(raw, "i", 0)
    doc = json.loads(raw)
    doc["chunks"][1][6] = 5
    with pytest.raises(CheckpointCorruptError, match="not one of the index's 1 refs"):
        decode_index(json.dumps(doc).encode(), "i", 0, table)
    with pytest.raises(CheckpointCorruptError, match="neither a plain file name"):
        parse_reference("../step-1")
    meta = replace(_meta(), references=("step-000000100",))
    assert decode_metadata(encode_metadata(meta), "m").references == ("step-000000100",)
    assert "references" not in json.loads(encode_metadata(_meta()))


def test_row_runs_of_a_table_are_one_index_entry() -> None:
    a, b = "0123456789abcdef", "fedcba9876543210"
    pieces = [
        ChunkMeta((10, 0), (3, 72), 0, 0, 216, (a,)),
        ChunkMeta((13, 0), (500, 72), 1, 4096, 36000, (b, a)),  # two segments, referred to
        ChunkMeta((513, 0), (1, 72), 0, 256, 72, (b,)),
    ]
    where = FileLocation("step-000000100", "data-cd-00000.bin")
    lone = ChunkMeta((0, 0), (4, 4), 0, 512, 64, (a,))
    raw = encode_index("data-ab-00000.bin", [("b", lone)], [where], [("t", pieces)])
    doc = json.loads(raw)
    assert doc["runs"] == [
        ["t", [10, 0], [504, 72], 72, [3, 500, 1], [0, 1, 0], [0, 4096, 256], [a, b + a, b]]
    ]
    assert [row[0] for row in doc["chunks"]] == ["b"]
    table = FileTable(["data-ab-00000.bin"])
    back = decode_index(raw, "i", 0, table)
    assert back[0] == ("b", lone)
    assert [c for _, c in back[1:]] == pieces  # the referred piece is file 1 of the table
    assert table.names()[1] == "../step-000000100/data-cd-00000.bin"
    # pieces that are not consecutive whole rows of one box stay chunk entries
    gap = [pieces[0], pieces[2]]
    doc = json.loads(encode_index("d", [], [], [("t", gap)]))
    assert "runs" not in doc and [row[1] for row in doc["chunks"]] == [[10, 0], [513, 0]]
    for damage, message in [
        (lambda r: r[4].append(1), "lists of different lengths"),
        (lambda r: r[4].__setitem__(0, 4), "do not add up to its 504 rows"),
        (lambda r: r[7].__setitem__(0, "abc"), "are 3 characters"),
    ]:
        bad = json.loads(raw)
        damage(bad["runs"][0])
        with pytest.raises(CheckpointCorruptError, match=message):
            decode_index(json.dumps(bad).encode(), "i", 0, table)


def test_a_large_tensor_inside_a_value_is_stored_with_a_warning(tmp_path: Path) -> None:
    import torch

    import unickpt

    small = encode_value((torch.ones(4), 3), "k", allow_pickle=False)
    assert decode_value(small, "k", allow_pickle=False)[1] == 3
    big = torch.arange(300_000, dtype=torch.float32)  # 1.2 MB
    with pytest.warns(UserWarning, match=r"'pair\[0\]' is a tensor of 1,200,000 bytes inside"):
        unickpt.save(tmp_path / "c", {"pair": (big, 3), "w": torch.ones(2)})
    back = {"pair": None, "w": torch.zeros(2)}
    unickpt.load(tmp_path / "c", back)
    assert torch.equal(back["pair"][0], big) and back["pair"][1] == 3
