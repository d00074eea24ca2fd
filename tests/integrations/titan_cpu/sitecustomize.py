"""CPU shims for torchtitan 0.3.0's own entry point (``-m torchtitan.train``) on torch 2.13.0.

For the tests only, never the product: Python imports this module at start-up when its folder
is on ``PYTHONPATH``. It acts only in a torchrun worker (``RANK`` set) whose environment has
``UNICKPT_TITAN_CPU=1``, before torchtitan is imported:

- torchtitan's device type becomes ``cpu`` (with no accelerator it picks ``cuda``), and its
  device module ``torch.cpu`` plus the calls torchtitan makes of CUDA's (device name and
  properties, memory statistics, ``set_device``);
- ``torch.distributed.set_timeout`` (torch 2.14), which the trainer calls after its first step,
  is torch 2.13.0's ``_set_pg_timeout``;
- FSDP reduces gradients with a plain sum (gloo has no ``PREMUL_SUM``);
- with ``UNICKPT_TITAN_HOLD_AT_STEP=N`` the trainer stops before step N, logs
  ``held before step N (pid P)`` and waits to be killed: the test's crash point.
"""

from __future__ import annotations

import logging
import os
import threading
import types
from datetime import timedelta
from typing import Any

import torch
import torch._utils
import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout
from torch.distributed.fsdp import FSDPModule

log = logging.getLogger("titan_cpu")


class CpuDeviceModule:
    """``torch.cpu`` with the CUDA calls torchtitan makes of its device module."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    def get_device_name(self, device: Any = None) -> str:
        return "cpu"

    def get_device_properties(self, device: Any = None) -> types.SimpleNamespace:
        return types.SimpleNamespace(
            total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        )

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        return {}

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def set_device(self, device: Any) -> None:
        pass

    def current_device(self) -> int:
        return 0


def use_cpu_device() -> None:
    """torchtitan's ``device_type`` and ``device_module``, set before its modules import them."""
    available = torch._utils._get_available_device_type
    torch._utils._get_available_device_type = lambda: "cpu"
    try:
        import torchtitan.tools.utils as titan_utils
    finally:
        torch._utils._get_available_device_type = available
    titan_utils.device_module = CpuDeviceModule()


def set_timeout(timeout: timedelta, group: dist.ProcessGroup | None = None) -> None:
    """torch 2.14's ``torch.distributed.set_timeout`` on torch 2.13.0."""
    _set_pg_timeout(timeout, group)


def reduce_with_plain_sum() -> None:
    """torchtitan's FSDP setup ends with ``disable_fsdp_gradient_division``; after it, every
    FSDP module also reduces with a plain sum."""
    import torchtitan.distributed.fsdp as titan_fsdp

    disable_division = titan_fsdp.disable_fsdp_gradient_division

    def disable_division_sum(model: torch.nn.Module) -> None:
        disable_division(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    titan_fsdp.disable_fsdp_gradient_division = disable_division_sum


def hold_at_step(step: int) -> None:
    """The trainer waits, forever, before step ``step``: the test kills it there."""
    from torchtitan.trainer import Trainer

    train_step = Trainer.train_step

    def held_train_step(self: Any, data_iterator: Any) -> Any:
        if self.step == step:
            log.warning("held before step %d (pid %d)", step, os.getpid())
            threading.Event().wait()
        return train_step(self, data_iterator)

    Trainer.train_step = held_train_step  # type: ignore[method-assign]


def install() -> None:
    use_cpu_device()
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = set_timeout  # type: ignore[attr-defined]
    reduce_with_plain_sum()
    hold = os.environ.get("UNICKPT_TITAN_HOLD_AT_STEP")
    if hold:
        hold_at_step(int(hold))


if "RANK" in os.environ and os.environ.get("UNICKPT_TITAN_CPU") == "1":
    install()
