"""Small helpers of the integrity tests: bitwise comparison, checkpoint folder surgery."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

_DATA = re.compile(r"^data-([0-9a-f]+)-\d+\.bin$")
_METADATA = re.compile(r"^metadata-([0-9a-f]+)\.json$")


def bits(t: torch.Tensor) -> bytes:
    """The raw bytes of a tensor (bitwise comparison; NaN equals the same NaN)."""
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bits(a) == bits(b)


def read_commit(folder: Path) -> dict[str, Any]:
    return dict(json.loads((folder / "COMMIT").read_text()))


def metadata_path(folder: Path) -> Path:
    return folder / read_commit(folder)["metadata_file"]


def read_metadata(folder: Path) -> dict[str, Any]:
    return dict(json.loads(metadata_path(folder).read_bytes()))


def write_metadata(folder: Path, doc: dict[str, Any], commit: dict[str, Any] | None = None) -> None:
    """Replace the metadata with ``doc`` and re-pin it in COMMIT (a well-formed forgery)."""
    raw = json.dumps(doc, separators=(",", ":")).encode()
    path = metadata_path(folder)
    path.write_bytes(raw)
    record = {**read_commit(folder), **(commit or {})}
    record["metadata_nbytes"] = len(raw)
    record["metadata_checksum"] = xxhash.xxh3_64_hexdigest(raw)
    (folder / "COMMIT").write_text(json.dumps(record, indent=1))


def debris(folder: Path) -> list[str]:
    """Names in a committed checkpoint folder that its COMMIT does not account for."""
    commit = read_commit(folder)
    save_id = commit["save_id"]
    extra = []
    for p in sorted(folder.iterdir()):
        name = p.name
        if name in ("COMMIT", "LOCK", commit["metadata_file"]):
            continue
        m = _DATA.match(name)
        if m and m.group(1) == save_id:
            continue
        extra.append(name)
    return extra


def tmp_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.tmp"))


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


@contextlib.contextmanager
def small_tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted on ``where``; skips the test when mounting is not allowed."""
    where.mkdir(parents=True, exist_ok=True)
    done = _run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)])
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill up ({done.stderr.strip()})")
    try:
        yield where
    finally:
        _run(["umount", "-l", str(where)])


@contextlib.contextmanager
def read_only_view(source: Path, where: Path) -> Iterator[Path]:
    """``source`` seen read-only at ``where`` (a read-only bind mount); skips when not allowed."""
    where.mkdir(parents=True, exist_ok=True)
    done = _run(["mount", "--bind", str(source), str(where)])
    if done.returncode != 0:
        pytest.skip(f"cannot bind-mount a read-only view ({done.stderr.strip()})")
    try:
        done = _run(["mount", "-o", "remount,bind,ro", str(where)])
        if done.returncode != 0:
            pytest.skip(f"cannot remount read-only ({done.stderr.strip()})")
        yield where
    finally:
        _run(["umount", "-l", str(where)])
