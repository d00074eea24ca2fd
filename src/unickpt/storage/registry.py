"""Which backend serves a path or URL, by scheme.

- a plain path or ``file://`` URL: :class:`~unickpt.storage.local.LocalStorage`;
- a scheme registered with :func:`register_backend`, or listed in ``_MODULES`` (imported on
  first use; the module registers itself);
- any other scheme fsspec knows (``memory://``, ``gs://``, ``az://``, chained URLs with
  ``::``): :class:`~unickpt.storage.fsspec.FsspecStorage`.

A new backend is one module that ends with ``register_backend("scheme", TheStorage)`` and one
line in ``_MODULES``.
"""

from __future__ import annotations

import importlib
import os
import re
import threading
from collections.abc import Callable
from urllib.parse import unquote, urlparse

from ..errors import CheckpointError
from .base import Storage
from .local import LocalStorage

BackendFactory = Callable[[str], Storage]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_FACTORIES: dict[str, BackendFactory] = {}
_MODULES: dict[str, tuple[str, str]] = {
    # scheme: (module that registers it on import, the extra that installs its dependencies)
    "s3": ("unickpt.storage.s3", "s3"),
}
_LOCK = threading.Lock()


def register_backend(scheme: str, factory: BackendFactory) -> None:
    """Serve URLs ``scheme://...`` with ``factory(url)`` (replacing an earlier registration)."""
    with _LOCK:
        _FACTORIES[scheme.lower()] = factory


def scheme_of(location: str | os.PathLike[str]) -> str:
    """``"s3"`` for ``s3://b/k``; ``""`` for a plain path."""
    text = os.fspath(location)
    if "::" in text:
        text = text.split("::", 1)[0] + "://"
    m = _SCHEME.match(text)
    return m.group(1).lower() if m else ""


def is_local(location: str | os.PathLike[str] | Storage) -> bool:
    """Whether ``location`` names a local path (plain or ``file://``)."""
    if isinstance(location, Storage):
        return isinstance(location, LocalStorage)
    return scheme_of(location) in ("", "file")


def local_path(location: str | os.PathLike[str]) -> str:
    """The file system path of a plain path or ``file://`` URL."""
    text = os.fspath(location)
    if scheme_of(text) == "file":
        return unquote(urlparse(text).path)
    return text


def open_storage(location: str | os.PathLike[str] | Storage) -> Storage:
    """The backend for a path or URL; a :class:`Storage` is returned as it is.

    >>> open_storage("runs/gpt").location
    'runs/gpt'
    """
    if isinstance(location, Storage):
        return location
    text = os.fspath(location)
    scheme = scheme_of(text)
    if scheme in ("", "file"):
        return LocalStorage(local_path(text))
    factory = _factory(scheme)
    if factory is not None:
        return factory(text)
    return _fsspec(text, scheme)


def _factory(scheme: str) -> BackendFactory | None:
    with _LOCK:
        factory = _FACTORIES.get(scheme)
    if factory is not None or scheme not in _MODULES:
        return factory
    module, extra = _MODULES[scheme]
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise CheckpointError(
            f"{scheme}:// needs packages that are not installed ({e}); install them with "
            f"pip install 'unickpt[{extra}]'."
        ) from e
    with _LOCK:
        return _FACTORIES.get(scheme)


def _fsspec(url: str, scheme: str) -> Storage:
    try:
        import fsspec

        from .fsspec import FsspecStorage
    except ImportError as e:
        raise CheckpointError(
            f"{url}: the {scheme}:// scheme needs fsspec ({e}); pip install 'unickpt[fsspec]'."
        ) from e
    if scheme not in fsspec.available_protocols() and "::" not in url:
        raise CheckpointError(
            f"{url}: no storage backend for {scheme}://; expected a path, file://, "
            f"{', '.join(f'{s}://' for s in sorted({*_FACTORIES, *_MODULES}))} or a scheme "
            "fsspec knows (memory://, gs://, az://, ...)."
        )
    try:
        return FsspecStorage(url)
    except ImportError as e:
        raise CheckpointError(
            f"{url}: fsspec's {scheme}:// file system needs a package that is not installed "
            f"({e}); install it (for example gcsfs for gs://, adlfs for az://)."
        ) from e
