"""Where bytes live. A backend sees names, byte ranges and buffers, nothing else."""

from .base import Storage, WriteHandle, check_name
from .local import LocalStorage

__all__ = ["LocalStorage", "Storage", "WriteHandle", "check_name"]
