"""Where bytes live. A backend sees names, byte ranges and buffers, nothing else.

:func:`open_storage` picks the backend for a path or URL; see :mod:`.registry`.
"""

from .base import Storage, WriteHandle, check_name
from .local import LocalStorage
from .registry import open_storage, register_backend

__all__ = [
    "LocalStorage",
    "Storage",
    "WriteHandle",
    "check_name",
    "open_storage",
    "register_backend",
]
