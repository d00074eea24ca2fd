"""What a checkpoint holds: its tensors, values and provenance, from the metadata alone."""

from __future__ import annotations

import os
import reprlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from fnmatch import fnmatchcase
from typing import Any

from ..engine.commit import read_checkpoint
from ..errors import CheckpointMismatchError, CheckpointNotFoundError, UnsafeObjectError
from ..format.dtypes import itemsize_of
from ..format.metadata import Metadata
from ..format.values import StoredTensor, decode_value
from ..layouts.boxes import Box
from ..storage.base import Storage
from ..storage.registry import open_storage
from .datafiles import expected_file_sizes

# The producer entry of metadata translated from another format (foreign.common.FORMAT_KEY,
# whose module imports torch).
FOREIGN_FORMAT_KEY = "foreign_format"

_REPR = reprlib.Repr()
_REPR.maxstring = 40
_REPR.maxother = 40
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = 6
SUMMARY_CHARS = 60


@dataclass(frozen=True)
class TensorInfo:
    """A tensor as a reader gets it (dtype, shape) and the bytes it is stored in; a quantized
    table says its encoding and the error quantization made."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    layout: str
    shards: int
    nbytes: int
    encoding: str | None = None
    max_abs_error: float | None = None
    rms_relative_error: float | None = None


@dataclass(frozen=True)
class ObjectInfo:
    """A stored Python value; ``per_rank`` ones show the lowest saving rank's value."""

    key: str
    type: str
    summary: str
    per_rank: bool = False
    pickled: bool = False


@dataclass(frozen=True)
class FileInfo:
    name: str
    nbytes: int


@dataclass(frozen=True)
class CheckpointSummary:
    """The description ``unickpt inspect`` prints."""

    path: str
    format_version: int
    save_id: str
    world_size: int
    created_unix_s: float
    producer: dict[str, str]
    checksum_algorithm: str
    segment_bytes: int
    files: tuple[FileInfo, ...]
    tensors: tuple[TensorInfo, ...]
    objects: tuple[ObjectInfo, ...]
    references: tuple[str, ...] = ()  # step folders an incremental checkpoint reads from

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def data_bytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    @property
    def created_iso(self) -> str:
        if not self.created_unix_s:
            return "unknown"
        moment = datetime.fromtimestamp(self.created_unix_s, tz=timezone.utc)
        return moment.isoformat(timespec="seconds")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data (``unickpt inspect --json``)."""
        doc = asdict(self)
        doc["created"] = self.created_iso
        doc["totals"] = {
            "tensors": len(self.tensors),
            "tensor_bytes": self.tensor_bytes,
            "objects": len(self.objects),
            "files": len(self.files),
            "data_bytes": self.data_bytes,
        }
        return doc


def inspect_checkpoint(
    path: str | os.PathLike[str] | Storage, *, foreign: bool = False
) -> CheckpointSummary:
    """Describe the committed checkpoint at ``path`` (reads the metadata, not the data). With
    ``foreign``, a folder holding a safetensors model or a DCP folder instead is described as
    :func:`unickpt.load` reads it (its producer names the format).

    >>> s = inspect_checkpoint("ckpt/step-100")  # doctest: +SKIP
    >>> s.world_size, len(s.tensors), s.tensor_bytes  # doctest: +SKIP
    """
    storage = open_storage(path)
    try:
        record, meta = read_checkpoint(storage)
        save_id = record.save_id
    except CheckpointNotFoundError:
        translated = _foreign(storage) if foreign else None
        if translated is None:
            raise
        meta, save_id = translated, ""
    return CheckpointSummary(
        path=storage.location,
        format_version=meta.version,
        save_id=save_id,
        world_size=meta.world_size,
        created_unix_s=meta.created_unix_s,
        producer=dict(meta.producer),
        checksum_algorithm=meta.checksum_algorithm,
        segment_bytes=meta.segment_bytes,
        files=_files(meta),
        tensors=tuple(_tensor(k, meta) for k in sorted(meta.tensors)),
        objects=_objects(meta),
        references=meta.references,
    )


def _foreign(storage: Storage) -> Metadata | None:
    """A safetensors model's or DCP folder's metadata, as a load translates it (its reader
    imports torch); None when the folder holds neither."""
    from ..foreign.detect import read_any

    try:
        return read_any(storage, None)
    except CheckpointNotFoundError:
        return None


def foreign_format(summary: CheckpointSummary) -> str | None:
    """The format a summary was translated from (``safetensors``, ``dcp``), or None."""
    return summary.producer.get(FOREIGN_FORMAT_KEY)


def _files(meta: Metadata) -> tuple[FileInfo, ...]:
    return tuple(FileInfo(n, size) for n, size in zip(meta.files, expected_file_sizes(meta)))


def _tensor(key: str, meta: Metadata) -> TensorInfo:
    t = meta.tensors[key]
    nbytes = Box.whole(t.shape).numel * itemsize_of(t.dtype)
    info = TensorInfo(key, t.value_dtype, tuple(t.value_shape), t.layout, len(t.chunks), nbytes)
    e = t.encoding
    if e is None:
        return info
    error = e.error
    return replace(
        info,
        encoding=f"{e.name} {e.bits}-bit",
        max_abs_error=None if error is None else error.max_abs,
        rms_relative_error=None if error is None else error.rms_relative,
    )


def _objects(meta: Metadata) -> tuple[ObjectInfo, ...]:
    out = [_object(k, meta.objects[k], meta, False) for k in meta.objects]
    for k in meta.per_rank:
        first = meta.first_per_rank(k)
        out.append(_object(k, first[1] if first else None, meta, True))
    return tuple(sorted(out, key=lambda o: o.key))


def _object(key: str, encoded: Any, meta: Metadata, per_rank: bool) -> ObjectInfo:
    try:
        value = decode_value(encoded, key, allow_pickle=False, stored=True)
    except UnsafeObjectError:
        return ObjectInfo(key, "pickle", "<saved with pickle>", per_rank, True)
    kind = "Tensor" if isinstance(value, StoredTensor) else type(value).__name__
    return ObjectInfo(key, kind, short_repr(value), per_rank, key in meta.pickled_keys)


def short_repr(value: Any, width: int = SUMMARY_CHARS) -> str:
    """A one-line description of a value, at most ``width`` characters."""
    if isinstance(value, StoredTensor):
        text = f"tensor {value.dtype} {list(value.shape)}"
    else:
        text = _REPR.repr(value)
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def select_entries(
    summary: CheckpointSummary, patterns: Sequence[str] = (), tops: Sequence[str] = ()
) -> CheckpointSummary:
    """``summary`` with only the tensors and values whose key matches one of ``patterns``
    (fnmatch, ``*`` crosses dots) and whose first component is one of ``tops``; an empty
    sequence keeps everything. A name in ``tops`` the checkpoint lacks raises.

    >>> select_entries(s, ["*.lr"], ["optimizer"])  # doctest: +SKIP
    """
    keys = [t.key for t in summary.tensors] + [o.key for o in summary.objects]
    known = sorted({_top(k) for k in keys})
    missing = [t for t in tops if t not in known]
    if missing:
        raise CheckpointMismatchError(
            f"--only {', '.join(missing)}: no such top-level key in {summary.path}; expected "
            f"one of: {', '.join(known) or '(none)'}."
        )

    def keep(key: str) -> bool:
        in_top = not tops or _top(key) in tops
        return in_top and (not patterns or any(fnmatchcase(key, p) for p in patterns))

    return replace(
        summary,
        tensors=tuple(t for t in summary.tensors if keep(t.key)),
        objects=tuple(o for o in summary.objects if keep(o.key)),
    )


def unmatched_patterns(summary: CheckpointSummary, patterns: Sequence[str]) -> list[str]:
    """The patterns of ``patterns`` that match no key of ``summary``."""
    keys = [t.key for t in summary.tensors] + [o.key for o in summary.objects]
    return [p for p in patterns if not any(fnmatchcase(k, p) for k in keys)]


def _top(key: str) -> str:
    return key.split(".", 1)[0]


@dataclass(frozen=True)
class ObjectGroup:
    """Values equal in type and value whose keys differ only in their middle components
    (``optimizer.param_groups.*.lr`` for the learning rate of every parameter), shown once."""

    key: str
    type: str
    summary: str
    count: int
    per_rank: bool = False


def group_objects(objects: Sequence[ObjectInfo]) -> list[ObjectGroup]:
    """``objects`` with equal values under keys that share their first and last components
    grouped; the group's key holds ``*`` where its keys differ. Order: by first key."""
    groups: dict[tuple[str, str, str, str, bool], list[ObjectInfo]] = {}
    for o in objects:
        parts = o.key.split(".")
        ident = (parts[0], parts[-1] if len(parts) > 1 else "", o.type, o.summary, o.per_rank)
        groups.setdefault(ident if len(parts) > 2 else (o.key, "", "", "", False), []).append(o)
    out = [_group(members) for members in groups.values()]
    return sorted(out, key=lambda g: g.key)


def _group(members: list[ObjectInfo]) -> ObjectGroup:
    first = members[0]
    if len(members) == 1:
        return ObjectGroup(first.key, first.type, first.summary, 1, first.per_rank)
    split = [m.key.split(".") for m in members]
    head = []
    for column in zip(*(p[:-1] for p in split)):
        if len(set(column)) > 1:
            break
        head.append(column[0])
    key = ".".join([*head, "*", split[0][-1]])
    return ObjectGroup(key, first.type, first.summary, len(members), first.per_rank)
