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
_LAZY = {
    "FORMATS": ".convert",
    "ConvertOptions": ".convert",
    "export_checkpoint": ".convert",
    "import_checkpoint": ".convert",
    "DiffReport": ".diff",
    "TensorDiff": ".diff",
    "ValueDiff": ".diff",
    "diff_checkpoints": ".diff",
    "import_dcp": ".from_dcp",
    "import_deepspeed": ".from_deepspeed",
    "import_megatron": ".from_megatron",
    "import_safetensors": ".from_safetensors",
    "import_torch": ".from_torch",
    "CheckpointSummary": ".inspection",
    "ObjectInfo": ".inspection",
    "TensorInfo": ".inspection",
    "inspect_checkpoint": ".inspection",
    "ConvertReport": ".reports",
    "export_dcp": ".to_dcp",
    "export_safetensors": ".to_safetensors",
    "export_torch": ".to_torch",
    "format_bytes": "..units",
    "parse_size": "..units",
    "Damage": ".verify",
    "VerifyReport": ".verify",
    "verify_checkpoint": ".verify",
}


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
