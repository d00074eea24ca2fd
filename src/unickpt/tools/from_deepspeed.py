"""Import a DeepSpeed ZeRO checkpoint (stages 1-3), or its universal-checkpoint layout.

A ZeRO checkpoint folder (``engine.save_checkpoint(dir, tag)``: ``dir/latest`` names ``tag``)
holds ``mp_rank_00_model_states.pt`` (stage 3: one ``zero_pp_rank_R_mp_rank_00_model_states.pt``
per rank) with the module's buffers, the parameter names and shapes per optimizer group
(``param_shapes``), the LR scheduler and the step counters, and one
``zero_pp_rank_R_mp_rank_00_optim_states.pt`` per data-parallel rank R with that rank's part of
the fp32 master weights and of the optimizer moments:

- stages 1 and 2: per group, one contiguous range of the group's flattening (parameters in
  ``param_shapes`` order, then padding), ranks in order;
- stage 3: per group, each parameter cut into ``ceil(numel / ranks)`` elements per rank, ranks in
  order, the last part padded.

The universal layout (``ds_to_universal``) holds one folder per parameter,
``zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt``, each a ``torch.save`` of ``{"param": tensor}``.

Either becomes ``model`` (fp32 master weights and buffers, by name), ``optimizer`` (state keyed
by parameter name, param groups listing names: the layout unickpt stores a torch optimizer in),
``lr_scheduler`` and the step counters, so ``unickpt.load(dst, {"model": model, "optimizer":
optimizer})`` resumes the job under FSDP2, DDP or any other layout. Pipeline and tensor
parallel (``mp_rank`` > 0) checkpoints are not handled: convert them to the universal layout.
"""

from __future__ import annotations

import math
import os
import re
import time
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError, CheckpointNotFoundError
from .from_torch import load_torch_file
from .imports import save_imported, with_prefix
from .output import check_distinct
from .progress import ProgressFn
from .reports import ConvertReport

_OPTIM = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_MOMENTS = ("exp_avg", "exp_avg_sq")
_MODEL = "mp_rank_00_model_states.pt"
_STAGE3_MODEL = "zero_pp_rank_0_mp_rank_00_model_states.pt"
_COUNTERS = ("global_steps", "global_samples", "skipped_steps", "ds_version", "ds_config")


def import_deepspeed(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    prefix: str | None = None,
    allow_pickle: bool = False,
    overwrite: bool = False,
    progress: ProgressFn | None = None,
) -> ConvertReport:
    """Save the DeepSpeed checkpoint ``src`` (a save folder with ``latest``, a tag folder, or
    a universal checkpoint folder) as unickpt checkpoint ``dst``.

    DeepSpeed's files hold objects only pickle reads (its loss scaler, the ZeRO stage enum):
    pass ``allow_pickle=True`` for checkpoints you trust; they are read with pickle then, and
    only plain values are kept.

    >>> import_deepspeed("runs/ds", "ckpt/step-2", allow_pickle=True)  # doctest: +SKIP
    """
    t0 = time.perf_counter()
    src_path = Path(src)
    check_distinct(src_path, dst)
    folder = _tag_folder(src_path)
    if (folder / "zero").is_dir():
        state = _universal(folder, allow_pickle)
    else:
        state = _zero(folder, allow_pickle)
    return save_imported(
        with_prefix(state, prefix, src_path),
        src_path,
        dst,
        "deepspeed",
        allow_pickle=False,
        overwrite=overwrite,
        started_s=t0,
        progress=progress,
    )


def _tag_folder(src: Path) -> Path:
    if not src.is_dir():
        raise CheckpointNotFoundError(f"{src} is not a folder; expected a DeepSpeed checkpoint.")
    latest = src / "latest"
    if latest.is_file():
        return src / latest.read_text().strip()
    return src


def _zero(folder: Path, allow_pickle: bool) -> dict[str, Any]:
    ranks = _optim_files(folder)
    optim = [_optimizer_state(load_torch_file(f, allow_pickle), f) for f in ranks]
    stage = int(getattr(optim[0].get("zero_stage"), "value", optim[0].get("zero_stage", 0)))
    name = (
        "zero_pp_rank_0_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"
    )
    model_file = folder / name
    if not model_file.is_file():
        raise CheckpointNotFoundError(
            f"{folder} has no {model_file.name}; the DeepSpeed checkpoint is incomplete."
        )
    model_states = load_torch_file(model_file, allow_pickle)
    shapes = [dict(g) for g in model_states["param_shapes"]]
    if stage == 3:
        groups = [_stage3_group(optim, g, s) for g, s in enumerate(shapes)]
    else:
        groups = [_stage12_group(optim, g, s) for g, s in enumerate(shapes)]
    base = optim[0].get("base_optimizer_state") or optim[0].get("optimizer_state_dict") or {}
    return _assemble(groups, base.get("param_groups", []), model_states)


def _optim_files(folder: Path) -> list[Path]:
    found: dict[int, Path] = {}
    for f in folder.iterdir():
        m = _OPTIM.match(f.name)
        if m and int(m.group(2)) == 0:
            found[int(m.group(1))] = f
        elif m:
            raise CheckpointError(
                f"{folder} holds model-parallel parts ({f.name}); convert it with DeepSpeed's "
                "ds_to_universal first and import the universal folder."
            )
    if not found or sorted(found) != list(range(len(found))):
        raise CheckpointNotFoundError(
            f"{folder} has no complete set of zero_pp_rank_*_mp_rank_00_optim_states.pt files "
            f"(ranks found: {sorted(found)}); expected a DeepSpeed ZeRO checkpoint folder."
        )
    return [found[r] for r in range(len(found))]


def _optimizer_state(saved: Any, path: Path) -> dict[str, Any]:
    if not isinstance(saved, dict) or "optimizer_state_dict" not in saved:
        raise CheckpointError(f"{path} has no optimizer_state_dict; it is not a ZeRO file.")
    return dict(saved["optimizer_state_dict"])


# A group: parameter name -> (fp32 weight, {moment: tensor}, step)
Group = dict[str, tuple[torch.Tensor, dict[str, torch.Tensor], Any]]


def _stage12_group(optim: list[dict[str, Any]], g: int, shapes: dict[str, Any]) -> Group:
    flat = torch.cat([o["single_partition_of_fp32_groups"][g].reshape(-1) for o in optim])
    states = [o["base_optimizer_state"]["state"][g] for o in optim]
    moments = {m: torch.cat([s[m].reshape(-1) for s in states]) for m in _MOMENTS if m in states[0]}
    out: Group = {}
    pos = 0
    for name, shape in shapes.items():
        n = math.prod(shape)
        if pos + n > flat.numel():
            raise CheckpointError(
                f"group {g} holds {flat.numel()} elements, fewer than its parameters need "
                f"('{name}' ends at {pos + n}); the checkpoint is damaged."
            )
        out[name] = (
            flat[pos : pos + n].view(shape).clone(),
            {m: t[pos : pos + n].view(shape).clone() for m, t in moments.items()},
            states[0].get("step"),
        )
        pos += n
    return out


def _stage3_group(optim: list[dict[str, Any]], g: int, shapes: dict[str, Any]) -> Group:
    ranks = len(optim)
    flats = [o["fp32_flat_groups"][g].reshape(-1) for o in optim]
    states = [o["optimizer_state_dict"]["state"][g] for o in optim]
    out: Group = {}
    pos = 0
    for name, shape in shapes.items():
        n = math.prod(shape)
        part = math.ceil(n / ranks)

        def whole(per_rank: list[torch.Tensor], p: int = pos, k: int = part) -> torch.Tensor:
            return torch.cat([t[p : p + k] for t in per_rank])[:n].view(shape).clone()  # noqa: B023

        moments = {m: whole([s[m].reshape(-1) for s in states]) for m in _MOMENTS if m in states[0]}
        out[name] = (whole(flats), moments, states[0].get("step"))
        pos += part
    return out


def _assemble(
    groups: list[Group], param_groups: list[dict[str, Any]], model_states: dict[str, Any]
) -> dict[str, Any]:
    model: dict[str, Any] = {}
    state: dict[str, Any] = {}
    for group in groups:
        for name, (weight, moments, step) in group.items():
            model[name] = weight
            entry: dict[str, Any] = dict(moments)
            if step is not None:
                entry["step"] = torch.as_tensor(step).clone()
            state[name] = entry
    module = model_states.get("module") or {}
    for name in model_states.get("buffer_names") or []:
        if name in module:
            model[name] = module[name]
    groups_out = []
    for i, group in enumerate(groups):
        hyper = _plain(param_groups[i]) if i < len(param_groups) else {}
        hyper.pop("params", None)
        groups_out.append({**hyper, "params": list(group)})
    out: dict[str, Any] = {
        "model": model,
        "optimizer": {"state": state, "param_groups": groups_out},
    }
    if model_states.get("lr_scheduler"):
        out["lr_scheduler"] = _plain(model_states["lr_scheduler"])
    out.update({k: _plain(model_states[k]) for k in _COUNTERS if k in model_states})
    return out


def _universal(folder: Path, allow_pickle: bool) -> dict[str, Any]:
    model_states = _universal_model_states(folder, allow_pickle)
    shapes: dict[str, Any] = {}
    for group in model_states.get("param_shapes") or []:
        shapes.update(dict(group))
    model: dict[str, Any] = {}
    state: dict[str, Any] = {}
    for param_dir in sorted((folder / "zero").iterdir()):
        if not (param_dir / "fp32.pt").is_file():
            continue
        name = param_dir.name
        if shapes and name not in shapes:
            continue  # not an optimized parameter (a buffer the conversion wrote out)
        shape = shapes.get(name)
        model[name] = _universal_tensor(param_dir / "fp32.pt", shape, allow_pickle)
        state[name] = {
            m: _universal_tensor(
                param_dir / f"{m}.pt", shape if m != "step" else None, allow_pickle
            )
            for m in (*_MOMENTS, "step")
            if (param_dir / f"{m}.pt").is_file()
        }
    if not model:
        raise CheckpointNotFoundError(
            f"{folder}/zero has no <parameter>/fp32.pt files; expected the output of DeepSpeed's "
            "ds_to_universal."
        )
    module = model_states.get("module") or {}
    for name in model_states.get("buffer_names") or []:
        if name in module:
            model[name] = module[name]
    out: dict[str, Any] = {
        "model": model,
        "optimizer": {"state": state, "param_groups": [{"params": _in_order(state, shapes)}]},
    }
    if model_states.get("lr_scheduler"):
        out["lr_scheduler"] = _plain(model_states["lr_scheduler"])
    out.update({k: _plain(model_states[k]) for k in _COUNTERS if k in model_states})
    return out


def _in_order(names: dict[str, Any], shapes: dict[str, Any]) -> list[str]:
    """The model's parameter order (the optimizer numbers its parameters in it)."""
    return [n for n in shapes if n in names] + [n for n in names if n not in shapes]


def _universal_model_states(folder: Path, allow_pickle: bool) -> dict[str, Any]:
    for name in (_MODEL, _STAGE3_MODEL):
        if (folder / name).is_file():
            saved = load_torch_file(folder / name, allow_pickle)
            return saved if isinstance(saved, dict) else {}
    return {}


def _universal_tensor(path: Path, shape: Any, allow_pickle: bool) -> torch.Tensor:
    """A parameter's file: ``{"param": tensor, ...}`` or (from ZeRO-3) the bare flat tensor."""
    saved = load_torch_file(path, allow_pickle)
    value = saved.get("param") if isinstance(saved, dict) else saved
    if not isinstance(value, torch.Tensor):
        raise CheckpointError(f"{path} holds no tensor; expected a ds_to_universal output file.")
    value = value.detach()
    if shape is not None and tuple(value.shape) != tuple(shape):
        if value.numel() != math.prod(shape):
            raise CheckpointError(
                f"{path} holds {value.numel()} elements but the parameter's shape is "
                f"{tuple(shape)}; the universal checkpoint does not match its model states."
            )
        value = value.reshape(tuple(shape))
    return value


def _plain(value: Any) -> Any:
    """Only what unickpt stores without pickle: DeepSpeed's own objects become their repr."""
    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return (
            type(value)(_plain(v) for v in value) if type(value) in (list, tuple) else list(value)
        )
    return repr(value)
