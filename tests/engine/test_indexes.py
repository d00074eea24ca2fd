from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

import unickpt
from unickpt import CheckpointCorruptError
from unickpt.bench.restore_plan import restore_figures
from unickpt.engine.checksum import digest
from unickpt.engine.commit import read_checkpoint, read_metadata
from unickpt.engine.indexes import SavedChunks
from unickpt.format.chunk_map import decode_chunk_map, encode_chunk_map
from unickpt.format.codec import decode_metadata, encode_commit, encode_metadata
from unickpt.format.metadata import CommitRecord, FileRef, Metadata
from unickpt.layouts.boxes import Box
from unickpt.planning.packed import box_of
from unickpt.planning.save_plan import LocalPlan, TensorDecl, build_global_plan
from unickpt.planning.simulate import SimulatedSave, encode_rank_index, simulate_save
from unickpt.storage.local import LocalStorage

RANKS, TENSORS, TP = 16, 6, 4


@pytest.fixture(scope="module")
def save() -> SimulatedSave:
    return simulate_save(RANKS, TENSORS, TP)


def _write(folder: Path, save: SimulatedSave, meta: Metadata | None = None, forge=None) -> Path:
    """Every index of the save, its metadata (``meta`` instead where given) and marker."""
    folder.mkdir()
    meta = meta or save.meta
    refs = []
    for rank in range(RANKS):
        raw = encode_rank_index(save.plan, rank)
        if forge is not None and rank == 0:
            doc = json.loads(raw)
            forge(doc)
            raw = json.dumps(doc).encode()
        name = f"index-0-{rank:05d}.json"
        (folder / name).write_bytes(raw)
        ref = meta.file_refs[rank]
        refs.append(FileRef(ref.data, ref.nbytes, name, len(raw), digest(memoryview(raw))))
    raw = encode_metadata(replace(meta, file_refs=tuple(refs)))
    (folder / "metadata-0.json").write_bytes(raw)
    record = CommitRecord("metadata-0.json", len(raw), digest(memoryview(raw)), "0")
    (folder / "COMMIT").write_bytes(encode_commit(record))
    return folder


def _boxes(meta: Metadata) -> dict[str, list[Box]]:
    """What rank 5 of a TP 2 restore on 16 ranks holds of each tensor (8 row blocks, 2 column
    blocks), and nothing of the last tensor."""
    out: dict[str, list[Box]] = {}
    for i, (key, t) in enumerate(meta.tensors.items()):
        rows, cols = t.shape
        step = -(-rows // 8)
        out[key] = [] if i == TENSORS - 1 else [Box((2 * step, cols // 2), (step, cols // 2))]
    return out


def _overlapping(meta: Metadata, wanted: dict[str, list[Box]]) -> dict[str, list]:
    return {
        k: [c for c in meta.tensors[k].chunks if any(c.box.intersect(b) for b in boxes)]
        for k, boxes in wanted.items()
    }


def test_chunk_map_round_trip_and_layouts_kept_once(save: SimulatedSave) -> None:
    chunk_map = save.meta.chunk_map
    assert chunk_map is not None
    assert len(chunk_map.layouts) == 3  # three shapes, split alike
    again = decode_chunk_map(json.loads(json.dumps(encode_chunk_map(chunk_map))))
    assert again.tensors == chunk_map.tensors
    for a, b in zip(again.layouts, chunk_map.layouts):
        assert a.ndim == b.ndim
        assert np.array_equal(a.coords, b.coords) and np.array_equal(a.files, b.files)
    plan = save.plan
    lay = chunk_map.layout(plan.names[0])
    assert lay is not None
    written = plan.layouts[plan.layout_of[0]]
    assert np.array_equal(lay.files, written.writers)
    assert np.array_equal(lay.coords, written.coords)
    key = plan.names[0]
    boxes = sorted((i.box, r) for r in range(RANKS) for i in plan.writes(r) if i.key == key)
    assert boxes == sorted((box_of(row, 2), int(f)) for row, f in zip(lay.coords, lay.files))


def test_map_ignored_where_it_does_not_describe_the_metadata(save: SimulatedSave) -> None:
    raw = json.loads(encode_metadata(save.meta))
    assert decode_metadata(json.dumps(raw).encode(), "m").chunk_map is not None
    raw["files"] = raw["files"][:3]
    assert decode_metadata(json.dumps(raw).encode(), "m").chunk_map is None
    del raw["chunk_map"]  # a checkpoint written before the map
    assert decode_metadata(json.dumps(raw).encode(), "m").chunk_map is None


def test_map_of_ndims_and_padding() -> None:
    """Tensors of 0, 1 and 2 dimensions planned together: each layout keeps its own."""
    s = TensorDecl("float32", (), "replicated", (Box((), ()),))
    first = LocalPlan(
        {"s": s, "v": TensorDecl("float32", (5,), "sharded", (Box((0,), (3,)),))}, (), ()
    )
    second = LocalPlan(
        {
            "s": s,
            "v": TensorDecl("float32", (5,), "sharded", (Box((3,), (2,)),)),
            "m": TensorDecl("float32", (2, 2), "sharded", (Box((0, 0), (2, 2)),)),
        },
        (),
        (),
    )
    found = build_global_plan([first, second]).chunk_map(np.array([1, 0]))
    sl, v, m = (found.layout(k) for k in ("s", "v", "m"))
    assert sl is not None and sl.coords.shape == (1, 0) and sl.files.tolist() == [1]
    assert v is not None and v.coords.tolist() == [[0, 3], [3, 2]] and v.files.tolist() == [1, 0]
    assert m is not None and m.coords.tolist() == [[0, 0, 2, 2]] and m.files.tolist() == [0]
    assert v.overlapping((2,), (2,)).tolist() == [True, True]
    assert v.overlapping((3,), (0,)).tolist() == [False, False]


def test_reads_only_the_indexes_it_needs_and_finds_the_same_chunks(
    save: SimulatedSave, tmp_path: Path
) -> None:
    storage = LocalStorage(_write(tmp_path / "ckpt", save))
    _, full = read_checkpoint(storage)
    _, meta = read_metadata(storage)
    wanted = _boxes(meta)
    chunks = SavedChunks(storage, meta)
    lazy = chunks.load(wanted)
    assert chunks.files_read == {6, 7}  # saved row block 1 (ranks 4-7), columns 2-3 of 4
    for key in wanted:
        assert lazy.tensors[key].chunks == tuple(_overlapping(full, wanted)[key])
    more = {next(iter(wanted)): [Box((0, 0), (1, 1))]}  # another rank's need: rank 0's file
    again = chunks.load(more)
    assert chunks.files_read == {0, 6, 7}
    key = next(iter(wanted))
    both = {key: [*wanted[key], *more[key]]}
    assert again.tensors[key].chunks == tuple(_overlapping(full, both)[key])
    assert again.files == full.files


def test_without_map_every_index_is_read(save: SimulatedSave, tmp_path: Path) -> None:
    storage = LocalStorage(_write(tmp_path / "ckpt", save, replace(save.meta, chunk_map=None)))
    _, full = read_checkpoint(storage)
    _, meta = read_metadata(storage)
    assert meta.chunk_map is None
    chunks = SavedChunks(storage, meta)
    wanted = _boxes(meta)
    lazy = chunks.load(wanted)
    assert chunks.files_read == set(range(RANKS))
    for key in wanted:
        assert lazy.tensors[key].chunks == tuple(_overlapping(full, wanted)[key])


def _drop_first(doc):
    key = doc["chunks"][0][0]
    doc["chunks"] = [c for c in doc["chunks"] if c[0] != key]


def _move_first(doc):
    doc["chunks"][0][1][0] = 10**6


@pytest.mark.parametrize("with_map", [True, False])
@pytest.mark.parametrize(
    ("forge", "phrase"),
    [
        (_drop_first, "do not tile it: elements [0:1024, 0:1024] are held by no shard"),
        (_move_first, "that the metadata does not describe"),
    ],
)
def test_forged_index_refused(save, tmp_path: Path, forge, phrase, with_map: bool) -> None:
    meta = save.meta if with_map else replace(save.meta, chunk_map=None)
    storage = LocalStorage(_write(tmp_path / "ckpt", save, meta, forge))
    _, meta = read_metadata(storage)
    first = next(iter(meta.tensors))
    with pytest.raises(CheckpointCorruptError) as info:
        SavedChunks(storage, meta).load({first: [Box((0, 0), (1, 1))]})
    assert phrase in str(info.value)


def test_restore_figures_at_small_scale(save: SimulatedSave) -> None:
    found = restore_figures(save, 2, rank=5)
    assert found["restore_index_files_read"] == found["restore_index_files_needed"] == 2
    assert found["restore_reads_per_rank"] == 2 * TENSORS


def test_a_save_writes_the_map_of_its_chunks(tmp_path: Path) -> None:
    state = {"w": torch.ones(300, 40), "b": torch.zeros(7), "s": torch.tensor(3)}
    unickpt.save(tmp_path / "ckpt", state)
    storage = LocalStorage(tmp_path / "ckpt")
    _, meta = read_metadata(storage)
    _, full = read_checkpoint(storage)
    assert meta.chunk_map is not None
    for key, t in full.tensors.items():
        layout = meta.chunk_map.layout(key)
        assert layout is not None
        boxes = sorted(c.offsets + c.lengths for c in t.chunks)
        assert sorted(map(tuple, layout.coords.tolist())) == boxes
        assert set(layout.files.tolist()) == {c.file for c in t.chunks}
    loaded = SavedChunks(storage, meta).load({"w": [Box((10, 0), (5, 40))], "s": [Box((), ())]})
    assert loaded.tensors["w"].chunks == full.tensors["w"].chunks
    assert loaded.tensors["s"].chunks == full.tensors["s"].chunks
    assert loaded.tensors["b"].chunks == ()
