"""Tools that work on saved checkpoints: inspect, verify, diff, and convert to and from
safetensors, ``torch.save`` files and ``torch.distributed.checkpoint`` folders (and from
Megatron-Core and DeepSpeed checkpoints).

Each runs in one process, without a process group, and reads a checkpoint tensor by tensor.

>>> from unickpt.tools import verify_checkpoint
>>> verify_checkpoint("ckpt/step-100").ok  # doctest: +SKIP
True
"""

from ..units import format_bytes, parse_size
from .convert import FORMATS, ConvertOptions, export_checkpoint, import_checkpoint
from .diff import DiffReport, TensorDiff, ValueDiff, diff_checkpoints
from .from_dcp import import_dcp
from .from_deepspeed import import_deepspeed
from .from_megatron import import_megatron
from .from_safetensors import import_safetensors
from .from_torch import import_torch
from .inspection import CheckpointSummary, ObjectInfo, TensorInfo, inspect_checkpoint
from .reports import ConvertReport
from .to_dcp import export_dcp
from .to_safetensors import export_safetensors
from .to_torch import export_torch
from .verify import Damage, VerifyReport, verify_checkpoint

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
