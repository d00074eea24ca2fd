"""A load's view of a safetensors model whose block-quantized float8 weights it dequantizes.

``unickpt.load(path, state, dequantize=True)`` reads the storage through
:class:`DequantizingStorage`. Once the model's header is translated, :meth:`translate` replaces
each float8 weight stored with scales (:mod:`.fp8_blocks`) by a tensor of the state's dtype
whose one chunk lies in a file that exists only here, ``<weight file> (dequantized)``, and
drops the scales' keys (the state holds no scales). The usual planner and reader then read, on
each rank, the byte ranges of the rows and boxes it holds from that file, and the wrapper
makes each range from the codes of the rows it covers and the scales of their block rows.

Every rank translates alike: the chunks of the dequantized files lie at offsets that do not
depend on the dtype (8 bytes a value, and a gap), so ranks whose states differ still agree on
where each chunk lies. A weight loads in the dtype the state holds at its key; a rank that
does not hold it takes the dtype of the other weights it dequantizes (ranks sharing the reads
of one weight hold it in one dtype).

Without ``dequantize``, a strict load of such a weight into a bfloat16 or float32 tensor is
refused with an error that names the option, before anything is read.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import warnings
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CheckpointError, CheckpointMismatchError
from ..format.dtypes import dtype_name
from ..format.metadata import ChunkMeta, Metadata, TensorMeta
from ..planning.flatten import flatten_state
from ..planning.load_keys import KeyMap, StateKeys, rename_to_saved
from ..storage.base import Storage, StorageView
from .common import foreign_format
from .fp8_blocks import (
    DEQUANTIZED_DTYPES,
    SCALE_SUFFIX,
    BlockScaled,
    block_scaled,
    check_option,
    find_pairs,
    model_block,
)
from .safetensors_read import SAFETENSORS

log = logging.getLogger(__name__)

TWIN_SUFFIX = " (dequantized)"
"""A dequantized weight lies in the file named after its codes' file and this suffix."""
_GAP_BYTES = 4096
"""Between two chunks of a dequantized file (more than the reader batches across)."""


@dataclass(frozen=True)
class _Placed:
    start: int
    weight: BlockScaled


class DequantizingStorage(StorageView):
    """The storage of a load (``inner``) that also serves the dequantized weights' files.

    ``dequantize`` is the load's option: False (refuse a float8 weight with scales loaded into
    a float tensor, naming the option), True (block size from the model's ``config.json``,
    else 128 x 128) or a block size ``(rows, cols)``. ``state``, ``keys`` and ``strict`` are
    the load's: they give the dtype each weight loads as.
    """

    def __init__(
        self,
        inner: Storage,
        dequantize: bool | tuple[int, int],
        state: dict[str, Any],
        keys: KeyMap | StateKeys | None,
        strict: bool,
    ) -> None:
        super().__init__(inner)
        self._block = check_option(dequantize)
        self._asked = dequantize is not False
        self._state, self._keys, self._strict = state, keys, strict
        self._twins: dict[str, list[_Placed]] = {}

    def translate(self, meta: Metadata) -> Metadata:
        """``meta`` with its float8 weights in blocks dequantized, when the load asks for it;
        else ``meta``, once checked that the state holds none of them as float."""
        if foreign_format(meta) != SAFETENSORS:
            if self._asked:
                raise CheckpointMismatchError(
                    f"dequantize was given, but {self.inner.location} holds "
                    f"{_kind(meta)}; dequantize reads the float8 weights of Hugging Face "
                    "safetensors models. Load it without dequantize."
                )
            return meta
        self._twins = {}
        pairs = find_pairs(meta)
        if not pairs:
            return meta
        dtypes = self._state_dtypes(meta, pairs)
        if not self._asked:
            self._check_undequantized(meta, dtypes)
            return meta
        return self._dequantized(meta, pairs, dtypes)

    def _dequantized(
        self, meta: Metadata, pairs: list[str], dtypes: dict[str, torch.dtype]
    ) -> Metadata:
        block = self._block or model_block(self.inner)
        default = _common_dtype(dtypes.values())
        tensors, files = dict(meta.tensors), list(meta.files)
        for key in pairs:
            dtype = dtypes.get(key, default)
            if dtype not in DEQUANTIZED_DTYPES:  # the load's dtype check refuses it
                dtype = default
            weight = block_scaled(meta, key, block, dtype)
            chunk = self._place(weight, files)
            layout = meta.tensors[key].layout
            tensors[key] = TensorMeta(dtype_name(weight.dtype), weight.shape, layout, (chunk,))
            del tensors[key + SCALE_SUFFIX]
        log.info("dequantizing %d float8 weights stored in blocks of %dx%d", len(pairs), *block)
        return dataclasses.replace(meta, files=tuple(files), tensors=tensors)

    def _place(self, weight: BlockScaled, files: list[str]) -> ChunkMeta:
        """The chunk of ``weight``'s values, next in the dequantized file of its codes' file
        (appended to ``files`` when new); 8 bytes a value and a gap, whatever the dtype."""
        twin = weight.codes.file + TWIN_SUFFIX
        placed = self._twins.setdefault(twin, [])
        if not placed:
            files.append(twin)
        start = 0
        if placed:
            last = placed[-1].weight
            start = placed[-1].start + last.shape[0] * last.shape[1] * 8 + _GAP_BYTES
        placed.append(_Placed(start, weight))
        return ChunkMeta((0, 0), weight.shape, files.index(twin), start, weight.nbytes)

    def _state_dtypes(self, meta: Metadata, pairs: list[str]) -> dict[str, torch.dtype]:
        """The dtype the state holds at each of ``pairs`` it holds (as the load renames)."""
        flat = flatten_state(self._state, for_load=True)
        if self._keys is not None:
            flat = rename_to_saved(flat, meta.keys(), self._keys)
        found = {}
        for key in pairs:
            leaf = flat.tensors.get(flat.aliases.get(key, key))
            if leaf is not None:
                found[key] = leaf.dtype
        return found

    def _check_undequantized(self, meta: Metadata, dtypes: dict[str, torch.dtype]) -> None:
        wrong = sorted(k for k, d in dtypes.items() if d in DEQUANTIZED_DTYPES)
        if not wrong:
            return
        key = wrong[0]
        stored = meta.tensors[key].dtype
        more = f" (and {len(wrong) - 1} more such weights)" if len(wrong) > 1 else ""
        message = (
            f"'{key}' is {stored} in the checkpoint, stored in blocks with the scales "
            f"'{key}{SCALE_SUFFIX}', but {dtype_name(dtypes[key])} in the state{more}; pass "
            "dequantize=True to load such weights dequantized into the state's dtype (each "
            f"value times the scale of its block), or create the state with dtype {stored} to "
            "load the stored values and scales as they are"
        )
        if self._strict:
            raise CheckpointMismatchError(message + ".")
        warnings.warn(message + " (strict=False: they keep their current values).", stacklevel=2)

    def _placed(self, name: str, offset: int, nbytes: int) -> _Placed:
        placed = self._twins[name]
        i = bisect.bisect_right(placed, offset, key=lambda p: p.start) - 1
        if i >= 0 and offset + nbytes <= placed[i].start + placed[i].weight.nbytes:
            return placed[i]
        raise CheckpointError(  # the reader reads within one chunk at a time
            f"bytes [{offset}, {offset + nbytes}) of {name} are not within one dequantized "
            "weight; this is a bug in unickpt."
        )

    def size(self, name: str) -> int | None:
        placed = self._twins.get(name)
        if placed is None:
            return self.inner.size(name)
        return placed[-1].start + placed[-1].weight.nbytes

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        if name not in self._twins:
            self.inner.read_into(name, offset, out)
            return
        placed = self._placed(name, offset, out.nbytes)
        placed.weight.fill(self.inner, offset - placed.start, out)

    def map_range(self, name: str, offset: int, length: int) -> memoryview | None:
        if name in self._twins:
            return None
        return self.inner.map_range(name, offset, length)


def _common_dtype(dtypes: Iterable[torch.dtype]) -> torch.dtype:
    """The dtype most of a rank's dequantized weights load as; float32 where it holds none."""
    counts = Counter(d for d in dtypes if d in DEQUANTIZED_DTYPES)
    return counts.most_common(1)[0][0] if counts else torch.float32


def _kind(meta: Metadata) -> str:
    found = foreign_format(meta)
    return "a unickpt checkpoint" if found is None else f"a {found} checkpoint"
