"""Byte sizes as people write them (``5GB``, ``100MiB``) and as the tools print them."""

from __future__ import annotations

import re

from .errors import CheckpointError

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: str) -> int:
    """Bytes in ``text``: a number with an optional unit (KB, MB, GB, TB are powers of 1000,
    KiB, MiB, GiB, TiB powers of 1024), as Hugging Face's ``max_shard_size`` reads them.

    >>> parse_size("5GB"), parse_size("100MB"), parse_size("1.5KiB"), parse_size("4096")
    (5000000000, 100000000, 1536, 4096)
    """
    match = _SIZE.match(text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS:
        raise CheckpointError(
            f"size {text!r} is not understood; expected a number with an optional unit such as "
            "5GB, 100MB, 512MiB or 1000000 (bytes)."
        )
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise CheckpointError(f"size {text!r} is not positive; give a size above zero.")
    return value


def format_bytes(n: int) -> str:
    """A short human-readable size in powers of 1024.

    >>> format_bytes(0), format_bytes(1536), format_bytes(5 * 2**30)
    ('0 B', '1.5 KiB', '5.0 GiB')
    """
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
