"""Import a Megatron-Core ``dist_checkpointing`` checkpoint (``torch_dist`` backend).

Such a folder holds ``metadata.json`` (the backends), ``common.pt`` (``torch.save`` of the
state every rank shares: iteration, arguments, ...) and a ``torch.distributed.checkpoint``
folder's files for the sharded part: each ``ShardedTensor`` as one global tensor under its
Megatron key (layer-stacked tensors keep their leading layer axis), each ``ShardedObject`` as
``key/shard_<offsets>_<fragments>``.

The new checkpoint holds the sharded tensors under their keys and the objects and common state
beside them, so a job loads it under any layout: each rank describes what it holds (DTensors,
:class:`unickpt.ShardedTensor` blocks, flat ranges) under the Megatron keys.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, CheckpointNotFoundError
from .from_dcp import DEFAULT_GROUP_BYTES, _half, _tensor_bytes, dcp_contents
from .from_torch import load_torch_file
from .imports import save_imported, with_prefix
from .output import check_distinct
from .progress import ProgressFn
from .reports import ConvertReport

METADATA = "metadata.json"
_OBJECT = re.compile(r"^.+/shard_[0-9_.]+$")
COMMON = "common.pt"


def import_megatron(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    prefix: str | None = None,
    allow_pickle: bool = False,
    overwrite: bool = False,
    group_bytes: int = DEFAULT_GROUP_BYTES,
    progress: ProgressFn | None = None,
) -> ConvertReport:
    """Save the Megatron-Core ``torch_dist`` checkpoint in folder ``src`` as unickpt ``dst``.

    ``common.pt`` usually holds the training arguments as an ``argparse.Namespace``, which only
    pickle reads: pass ``allow_pickle=True`` for checkpoints you trust.

    >>> import_megatron("megatron/iter_0001000", "ckpt/1000", allow_pickle=True)  # doctest: +SKIP
    """
    t0 = time.perf_counter()
    src_path = Path(src)
    check_distinct(src_path, dst)
    _check_backend(src_path)
    common = _common_state(src_path, allow_pickle)
    with dcp_contents(src_path, dst, allow_pickle, group_bytes, progress) as (flat, meta):
        clash = sorted(set(common) & set(flat))
        if clash:
            raise CheckpointError(
                f"{src_path}: keys {clash[:5]} are both in {COMMON} and in the sharded state; "
                "the checkpoint is inconsistent."
            )
        state = with_prefix({**common, **_unwrap_objects(flat)}, prefix, src_path)
        return save_imported(
            state,
            src_path,
            dst,
            "megatron",
            allow_pickle=allow_pickle,
            overwrite=overwrite,
            started_s=t0,
            progress=_half(progress, 1, _tensor_bytes(meta)),
        )


def _unwrap_objects(flat: dict[str, Any]) -> dict[str, Any]:
    """Megatron stores each ``ShardedObject`` as the list of that key's objects on the rank
    (one): the object itself is what its load returns."""
    out = {}
    for key, value in flat.items():
        if _OBJECT.match(key) and isinstance(value, list) and len(value) == 1:
            value = value[0]
        out[key] = value
    return out


def _check_backend(src: Path) -> None:
    path = src / METADATA
    if not path.is_file():
        raise CheckpointNotFoundError(
            f"{src} is not a Megatron-Core distributed checkpoint: it has no {METADATA} "
            "(dist_checkpointing.save writes one; legacy mp_rank_* folders are torch.save "
            "files: import them with --from torch)."
        )
    try:
        backends = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} could not be read ({e}); it is damaged.") from e
    backend = backends.get("sharded_backend") if isinstance(backends, dict) else None
    if backend != "torch_dist":
        raise CheckpointError(
            f"{src} was saved with Megatron's {backend!r} backend; unickpt imports 'torch_dist' "
            "(convert with Megatron's dist_checkpointing first: save with backend torch_dist)."
        )


def _common_state(src: Path, allow_pickle: bool) -> dict[str, Any]:
    path = src / COMMON
    if not path.is_file():
        return {}
    common = load_torch_file(path, allow_pickle)
    if not isinstance(common, dict):
        raise CheckpointError(f"{path} holds a {type(common).__name__}; expected a dict.")
    return common
