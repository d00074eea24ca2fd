"""Host copies that do not go through torch's intra-op thread pool.

Many small ``Tensor.copy_`` calls each open an OpenMP parallel region; on a busy machine
(training threads, data loaders) their barriers cost far more than the copy. Contiguous CPU
copies go through NumPy instead (a plain memcpy that releases the GIL), and several of them
run side by side on the engine's own threads.
"""

from __future__ import annotations

import numpy as np
import torch

from ..format.dtypes import byte_view


def copy_tensor(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> None:
    """``dst.copy_(src)`` for same-shaped, same-dtype tensors, memcpy when both allow it."""
    if (
        src.device.type == "cpu"
        and dst.device.type == "cpu"
        and src.is_contiguous()
        and dst.is_contiguous()
        and src.dtype == dst.dtype
    ):
        np.copyto(byte_view(dst).numpy(), byte_view(src).numpy())
    else:
        dst.copy_(src, non_blocking=non_blocking)
