"""Quantizing chosen tables during a save.

Before planning, each chosen table's leaf is replaced by its stored form: the uint8 rows of
:mod:`.rowwise`, in boxes of the same rows (so the planner, writer and indexes see an ordinary
uint8 tensor). After planning, the errors of the boxes this rank writes are summed; the
coordinator adds every rank's sums into the metadata's encodings.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

from ..errors import CheckpointError
from ..format.dtypes import dtype_name
from ..format.metadata import Encoding, EncodingError, TensorMeta
from ..layouts.boxes import Box
from ..planning.flatten import Flattened, TensorLeaf
from ..planning.save_plan import WriteItem
from .rowwise import BITS, NAME, ErrorSums, quantize_rows, stored_width


@dataclass(frozen=True)
class EncodedTable:
    """A quantized table of this rank: its encoding and the errors of each stored box."""

    encoding: Encoding
    errors: dict[Box, ErrorSums]


def check_quantize(quantize: Mapping[str, int] | None) -> dict[str, int]:
    """The tables to quantize and their bits, checked."""
    chosen = dict(quantize or {})
    for key, bits in chosen.items():
        if bits not in BITS:
            raise CheckpointError(
                f"quantize asks {bits} bits for '{key}'; expected 8 or 4 (per-row codes of "
                "that many bits)."
            )
    return chosen


def encode_leaves(flat: Flattened, quantize: Mapping[str, int]) -> dict[str, EncodedTable]:
    """Replace each chosen table's leaf in ``flat`` by its quantized rows."""
    return {key: _encode_leaf(flat, key, bits) for key, bits in quantize.items()}


def _encode_leaf(flat: Flattened, key: str, bits: int) -> EncodedTable:
    leaf = flat.tensors.get(key)
    if leaf is None or len(leaf.shape) != 2 or not leaf.dtype.is_floating_point:
        tables = sorted(
            k for k, t in flat.tensors.items() if len(t.shape) == 2 and t.dtype.is_floating_point
        )
        shown = ", ".join(tables[:8]) + (" ..." if len(tables) > 8 else "")
        raise CheckpointError(
            f"quantize names '{key}', which is not a 2-D floating tensor of the state; "
            f"the state's are: {shown or 'none'}. Name a table by its key."
        )
    if leaf.dtype.itemsize <= 1:
        raise CheckpointError(
            f"quantize names '{key}', a table of {leaf.dtype} (one byte per value), which is "
            "already as small as 8-bit codes and whose values per-row codes cannot be computed "
            "on; leave it out of quantize."
        )
    rows, columns = leaf.shape
    width = stored_width(columns, bits)
    pieces: list[tuple[Box, torch.Tensor]] = []
    errors: dict[Box, ErrorSums] = {}
    for box, view in leaf.pieces:
        if box.offsets[1] != 0 or box.lengths[1] != columns:
            raise CheckpointError(
                f"'{key}' is held in pieces that split its rows (columns {box.offsets[1]} to "
                f"{box.offsets[1] + box.lengths[1]} of {columns}); quantization works on whole "
                "rows. Shard the table by rows, or leave it out of quantize."
            )
        if not bool(torch.isfinite(view).all()):
            raise CheckpointError(
                f"'{key}' holds non-finite values in rows {box.offsets[0]} to "
                f"{box.offsets[0] + box.lengths[0]}; per-row quantization needs finite values. "
                "Leave it out of quantize."
            )
        _check_range(key, box.offsets[0], view)
        stored_box = Box((box.offsets[0], 0), (box.lengths[0], width))
        sums = errors[stored_box] = ErrorSums()
        pieces.append((stored_box, quantize_rows(view.detach(), bits, sums).cpu()))
    flat.tensors[key] = TensorLeaf(key, torch.uint8, (rows, width), leaf.layout, pieces)
    encoding = Encoding(NAME, bits, dtype_name(leaf.dtype), (rows, columns))
    return EncodedTable(encoding, errors)


FLOAT32_RANGE = torch.finfo(torch.float32).max * (1 - 2**-16)
"""The widest range of a row whose float32 scale and decoded values stay finite (with a margin
for the rounding of the scale)."""


def _check_range(key: str, first_row: int, view: torch.Tensor) -> None:
    """Each row's values and their range within float32, where a row's scale and minimum are
    kept (a finite row of float32 values from -3e38 to 3e38 has an infinite range there)."""
    if view.numel() == 0:
        return
    low, high = (x.to(torch.float64) for x in torch.aminmax(view.detach(), dim=1))
    wide = (high - low > FLOAT32_RANGE) | (low < -FLOAT32_RANGE) | (high > FLOAT32_RANGE)
    bad = torch.nonzero(wide).flatten()
    if len(bad):
        i = int(bad[0])
        raise CheckpointError(
            f"'{key}' row {first_row + i} holds values from {float(low[i]):.6g} to "
            f"{float(high[i]):.6g}, a range wider than float32 holds ({FLOAT32_RANGE:.6g}); "
            "per-row quantization keeps each row's minimum and scale in float32. Scale the "
            f"table down before saving, or leave '{key}' out of quantize."
        )


def written_errors(
    items: tuple[WriteItem, ...], encoded: Mapping[str, EncodedTable]
) -> dict[str, ErrorSums]:
    """The error sums of the quantized boxes this rank writes. A box written in shares counts
    once, with the share at its origin."""
    out: dict[str, ErrorSums] = {}
    for item in items:
        table = encoded.get(item.key)
        if table is None:
            continue
        held = item.held or item.box
        if item.box.offsets == held.offsets:
            out.setdefault(item.key, ErrorSums()).add(table.errors[held])
    return out


def merge_errors(per_rank: list[dict[str, ErrorSums]]) -> dict[str, EncodingError]:
    """Every rank's error sums, per table."""
    total: dict[str, ErrorSums] = {}
    for sums in per_rank:
        for key, s in sums.items():
            total.setdefault(key, ErrorSums()).add(s)
    return {k: s.result() for k, s in total.items()}


def with_encodings(
    tensors: dict[str, TensorMeta],
    encoded: Mapping[str, EncodedTable],
    errors: Mapping[str, EncodingError],
) -> dict[str, TensorMeta]:
    """The tensors' metadata with each quantized table's encoding and error."""
    out = dict(tensors)
    for key, table in encoded.items():
        encoding = replace(table.encoding, error=errors.get(key))
        out[key] = replace(tensors[key], encoding=encoding)
    return out
