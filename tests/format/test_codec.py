from __future__ import annotations

import json
from dataclasses import replace

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
