"""The chunk indexes a load needs, read when it needs them and decoded into arrays.

A load asks for boxes of some tensors (:meth:`SavedChunks.load`). Where the metadata has a chunk
map (:mod:`unickpt.format.chunk_map`), only the indexes listing a chunk that overlaps a box asked
for are read; otherwise every index is. Indexes are decoded into arrays per tensor
(:mod:`unickpt.format.index_arrays`) and a :class:`ChunkMeta` is built only for the chunks that
overlap a box asked for. Every tensor asked for (with boxes or none) is checked: its chunks must
tile it exactly, on the map (boxes of indexes not read) together with the chunks of the indexes
read, so a damaged or forged index or map is refused before anything is read.

Peak extra memory: the decoded arrays of the indexes read (about 60 bytes per chunk plus its
checksums) and the objects of the chunks that overlap what the load asks for.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np

from ..errors import CheckpointCorruptError
from ..format.chunk_map import ChunkLayout
from ..format.dtypes import dtype_from_name, itemsize
from ..format.index_arrays import IndexChunks, TensorChunks, concat_indexes, decode_index_arrays
from ..format.metadata import ChunkMeta, Metadata, TensorMeta
from ..format.references import FileTable
from ..layouts.boxes import Box
from ..layouts.coverage import tiling_fault
from ..planning.load_plan import not_tiled, rows_fault
from ..storage.base import Storage
from .commit import read_index_bytes

_READERS = 8
_FEW_FILES = 3  # local indexes read one after another (on a network mount: 3 round trips)
_FEW = 8  # chunks of a tensor matched one by one rather than as arrays


class SavedChunks:
    """The chunks of a checkpoint whose metadata (without chunks) is ``meta``, read from
    ``storage`` as loads ask for them. Not safe for concurrent use."""

    def __init__(self, storage: Storage, meta: Metadata) -> None:
        self.storage = storage
        self.meta = meta
        self.table = FileTable(meta.files)
        self.files_read: set[int] = set()
        self._decoded: list[IndexChunks] = []
        self._all: IndexChunks | None = None
        self._rows: dict[str, np.ndarray] = {}
        self._boxes: dict[str, set[Box]] = {}
        self._built: dict[str, TensorMeta] = {}
        self._near: dict[tuple[int, tuple[Box, ...]], set[int]] = {}
        self._listed: dict[int, np.ndarray] = {}
        self._map_checked: set[tuple[int, tuple[int, ...]]] = set()

    def load(self, wanted: Mapping[str, Sequence[Box]]) -> Metadata:
        """The metadata whose tensors of ``wanted`` (and of earlier calls) hold the chunks that
        overlap the boxes asked for, each tensor checked to be tiled by its chunks; ``files``
        numbers the files of every index read so far."""
        new = sorted(self.files_for(wanted) - self.files_read)
        listed = self._read(new)
        changed = self._touched(new) | (listed & set(self._built))
        for key, boxes in wanted.items():
            known = self._boxes.setdefault(key, set())
            if key not in self._built or not known.issuperset(boxes):
                known.update(boxes)
                changed.add(key)
        for key in sorted(changed & set(self._boxes)):
            self._built[key] = self._build(key)
        tensors = {k: self._built.get(k, t) for k, t in self.meta.tensors.items()}
        return replace(self.meta, tensors=tensors, files=self.table.names())

    def files_for(self, wanted: Mapping[str, Sequence[Box]]) -> set[int]:
        """The numbers of the files whose indexes :meth:`load` reads for ``wanted`` (those
        listing a chunk that overlaps a box asked for; every file without a chunk map)."""
        for key in wanted:
            if key not in self.meta.tensors:
                raise KeyError(f"'{key}' is not a tensor of the checkpoint")
        need: set[int] = set(range(len(self.meta.file_refs))) if not self._map else set()
        for key, boxes in wanted.items():
            need |= self._files_for(key, boxes)
        return need

    def _touched(self, new: list[int]) -> set[str]:
        """Tensors already built that the indexes just read list chunks of, or should."""
        chunk_map = self.meta.chunk_map
        if not new or chunk_map is None:
            return set()
        hit = [bool(np.isin(lay.files, new).any()) for lay in chunk_map.layouts]
        return {k for k in self._built if hit[chunk_map.tensors[k]]}

    def _files_for(self, key: str, boxes: Sequence[Box]) -> set[int]:
        chunk_map = self.meta.chunk_map
        if chunk_map is None:
            return set(range(len(self.meta.file_refs)))
        name = (chunk_map.tensors[key], tuple(boxes))
        found = self._near.get(name)
        if found is None:
            layout = chunk_map.layouts[name[0]]
            mask = np.zeros(len(layout.files), dtype=bool)
            for box in boxes:
                mask |= layout.overlapping(box.offsets, box.lengths)
            found = self._near[name] = set(layout.files[mask].tolist())
        return found

    @property
    def _map(self) -> bool:
        return self.meta.chunk_map is not None

    def _layout(self, key: str) -> ChunkLayout | None:
        chunk_map = self.meta.chunk_map
        return None if chunk_map is None else chunk_map.layout(key)

    def _read(self, files: list[int]) -> set[str]:
        """Read and decode the indexes of ``files``; the tensors they list chunks of."""
        if not files:
            return set()
        refs = self.meta.file_refs

        def one(i: int) -> IndexChunks:
            raw = read_index_bytes(self.storage, refs[i])
            where = f"{self.storage.location}/{refs[i].index}"
            return decode_index_arrays(raw, where, i, self.table)

        if len(files) == 1 or (self.storage.cheap_reads and len(files) <= _FEW_FILES):
            decoded = [one(i) for i in files]  # threads would cost more than they save
        else:
            threads = min(_READERS, len(files))
            with ThreadPoolExecutor(threads, thread_name_prefix="unickpt-index") as pool:
                decoded = list(pool.map(one, files))
        listed: set[str] = set()
        for i, found in zip(files, decoded):
            for key in found.keys:
                if key not in self.meta.tensors:
                    raise CheckpointCorruptError(
                        f"{self.storage.location}/{refs[i].index} lists chunks of '{key}', "
                        "which the metadata does not describe; the checkpoint is damaged."
                    )
            _check_sizes(found, self.meta.tensors, self.meta.segment_bytes)
            listed.update(found.keys)
            self.files_read.add(i)
        self._listed.clear()
        self._decoded.extend(decoded)
        self._all = concat_indexes(self._decoded)
        self._rows = self._all.by_key()
        return listed

    def _build(self, key: str) -> TensorMeta:
        """``key``'s tensor with the chunks overlapping the boxes asked for, after checking that
        the chunks of the indexes read, with the map's other boxes, tile it."""
        meta = self.meta.tensors[key]
        rows = self._rows.get(key)
        if rows is not None and self._all is not None and 0 < len(rows) <= _FEW:
            return self._build_few(key, meta, self._all.chunk_list(key, rows))
        found = None
        if rows is not None and self._all is not None:
            found = self._all.tensor(key, rows)
        self._check_tiling(key, meta, found.coords if found else None, self.files_read)
        if found is None:
            return meta
        near = _overlapping(found, self._boxes[key])
        coords = found.coords[near]
        near = near[np.lexsort(coords[:, : found.ndim].T[::-1])] if found.ndim else near
        return replace(meta, chunks=tuple(found.chunk(int(i)) for i in near))

    def _build_few(self, key: str, meta: TensorMeta, chunks: list[ChunkMeta]) -> TensorMeta:
        """:meth:`_build` for a tensor of a few chunks: matched one by one, without arrays."""
        ndim = len(chunks[0].offsets)
        coords = np.array([c.offsets + c.lengths for c in chunks], dtype=np.int64)
        self._check_tiling(key, meta, coords.reshape(len(chunks), 2 * ndim), self.files_read)
        boxes = self._boxes[key]
        near = [c for c in chunks if any(c.box.intersect(b) is not None for b in boxes)]
        near.sort(key=lambda c: c.offsets)
        return replace(meta, chunks=tuple(near))

    def _check_tiling(
        self, key: str, meta: TensorMeta, found: np.ndarray | None, read: set[int]
    ) -> None:
        """Raise unless ``found`` (the coordinate rows of the chunks read, or None) with the
        map's boxes of the indexes not read tile the tensor."""
        layout = self._layout(key)
        shape = meta.shape
        if layout is None:  # every index was read
            rows = found if found is not None else np.zeros((0, 2 * len(shape)), np.int64)
        else:
            assert self.meta.chunk_map is not None
            checked = (self.meta.chunk_map.tensors[key], shape)
            if checked not in self._map_checked:
                _check_rows(key, shape, layout.coords)
                self._map_checked.add(checked)
            number = self.meta.chunk_map.tensors[key]
            listed = self._listed.get(number)
            if listed is None:
                listed = self._listed[number] = np.isin(layout.files, list(read))
            have = found if found is not None else layout.coords[:0]
            if _same_rows(layout.coords[listed], have):
                return
            rows = np.concatenate([have, layout.coords[~listed]])
        _check_rows(key, shape, rows)


def _check_rows(key: str, shape: tuple[int, ...], rows: np.ndarray) -> None:
    if len(rows) and rows.shape[1] == 2 * len(shape):
        fault = rows_fault(shape, rows)
    else:
        fault = tiling_fault(shape, [])
    if fault is not None:
        raise not_tiled(key, shape, fault)


def _same_rows(a: np.ndarray, b: np.ndarray) -> bool:
    if a.shape != b.shape:
        return False
    if not a.size:
        return True
    if len(a) <= _FEW:
        return sorted(a.tolist()) == sorted(b.tolist())
    return bool(np.array_equal(a[np.lexsort(a.T[::-1])], b[np.lexsort(b.T[::-1])]))


def _overlapping(found: TensorChunks, boxes: set[Box]) -> np.ndarray:
    """Positions of the chunks that share an element with one of ``boxes``."""
    if not found.ndim:
        return np.arange(len(found)) if boxes else np.zeros(0, dtype=np.int64)
    layout = ChunkLayout(found.ndim, found.coords, found.files)
    mask = np.zeros(len(found), dtype=bool)
    for box in boxes:
        mask |= layout.overlapping(box.offsets, box.lengths)
    return np.flatnonzero(mask)


def _check_sizes(found: IndexChunks, tensors: Mapping[str, TensorMeta], segment: int) -> None:
    """Each chunk within its tensor, with the bytes its box needs and one checksum per segment
    (or none), as :func:`unickpt.format.codec.assemble` checks them (on all rows at once)."""
    dims = found.coords.shape[1] // 2
    metas = [tensors[k] for k in found.keys]
    ndim = np.array([len(t.shape) for t in metas], dtype=np.int64)
    shape = np.ones((len(metas), dims), dtype=np.int64)
    for i, t in enumerate(metas):
        shape[i, : min(dims, len(t.shape))] = t.shape[:dims]
    sizes = np.array([itemsize(dtype_from_name(t.dtype)) for t in metas], dtype=np.int64)
    ids = found.key_ids
    offsets, lengths = found.coords[:, :dims], found.coords[:, dims:]
    inside = (found.ndims == ndim[ids]) & (
        (offsets >= 0) & (lengths >= 0) & (offsets + lengths <= shape[ids])
    ).all(axis=1)
    if not inside.all():
        i = int(np.flatnonzero(~inside)[0])
        raise CheckpointCorruptError(
            f"an index lists a chunk of '{found.keys[ids[i]]}' at "
            f"{offsets[i, : found.ndims[i]].tolist()} that the metadata does not describe; the "
            "checkpoint is damaged."
        )
    expected = np.prod(lengths, axis=1, dtype=np.int64) * sizes[ids]
    segments = np.maximum(1, -(-expected // segment))
    sums = np.diff(found.sum_starts)
    bad = np.flatnonzero((found.nbytes != expected) | ((sums != 0) & (sums != segments)))
    if len(bad):
        i = int(bad[0])
        raise CheckpointCorruptError(
            f"an index gives the chunk of '{found.keys[ids[i]]}' at "
            f"{offsets[i, : found.ndims[i]].tolist()} {int(found.nbytes[i])} bytes and "
            f"{int(sums[i])} checksums; its box and dtype need {int(expected[i])} bytes and "
            f"{int(segments[i])} checksums. The checkpoint is damaged."
        )
