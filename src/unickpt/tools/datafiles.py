"""Facts about a checkpoint's data files that the metadata states."""

from __future__ import annotations

from ..format.metadata import Metadata


def expected_file_sizes(meta: Metadata) -> list[int]:
    """Each data file's size: as the metadata records it, else the end of its last chunk (for
    an earlier checkpoint's file that an incremental one refers to: the end of the last chunk
    it refers to, which the file may exceed)."""
    if len(meta.file_refs) == len(meta.files):
        return [ref.nbytes for ref in meta.file_refs]
    ends = [0] * len(meta.files)
    for t in meta.tensors.values():
        for c in t.chunks:
            ends[c.file] = max(ends[c.file], c.byte_offset + c.stored_nbytes)
    for i, ref in enumerate(meta.file_refs):
        ends[i] = ref.nbytes
    return ends
