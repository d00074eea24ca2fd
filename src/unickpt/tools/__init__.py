"""Tools that work on saved checkpoints: inspect, verify, diff, and convert to and from
safetensors, ``torch.save`` files and ``torch.distributed.checkpoint`` folders (and from
Megatron-Core and DeepSpeed checkpoints).

Each runs in one process, without a process group, and reads a checkpoint tensor by tensor.

>>> from unickpt.tools import verify_checkpoint
>>> verify_checkpoint("ckpt/step-100").ok  # doctest: +SKIP
True
"""

from __future__ import annotations

import importlib
from typing import Any

# Each name's module, imported on first use: ``unickpt inspect`` and ``verify`` import no torch
# (the conversions import what their formats need).
_MODULES = {
    ".convert": ("FORMATS", "ConvertOptions", "export_checkpoint", "import_checkpoint"),
    ".diff": ("DiffReport", "TensorDiff", "ValueDiff", "diff_checkpoints"),
    ".from_dcp": ("import_dcp",),
    ".from_deepspeed": ("import_deepspeed",),
    ".from_megatron": ("import_megatron",),
    ".from_safetensors": ("import_safetensors",),
    ".from_torch": ("import_torch",),
    ".inspection": ("CheckpointSummary", "ObjectInfo", "TensorInfo", "inspect_checkpoint"),
    ".reports": ("ConvertReport",),
    ".to_dcp": ("export_dcp",),
    ".to_safetensors": ("export_safetensors",),
    ".to_torch": ("export_torch",),
    "..units": ("format_bytes", "parse_size"),
    ".verify": ("Damage", "VerifyReport", "verify_checkpoint"),
}
_LAZY = {name: module for module, names in _MODULES.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = [
    "FORMATS",
    "CheckpointSummary",
    "ConvertOptions",
    "ConvertReport",
    "Damage",
    "DiffReport",
    "ObjectInfo",
    "TensorDiff",
    "TensorInfo",
    "ValueDiff",
    "VerifyReport",
    "diff_checkpoints",
    "export_checkpoint",
    "export_dcp",
    "export_safetensors",
    "export_torch",
    "import_checkpoint",
    "import_dcp",
    "import_deepspeed",
    "import_megatron",
    "import_safetensors",
    "import_torch",
    "format_bytes",
    "inspect_checkpoint",
    "parse_size",
    "verify_checkpoint",
]
