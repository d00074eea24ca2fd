"""Small helpers of the integrity tests: bitwise comparison, checkpoint folder surgery."""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash


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
    metadata_path(folder).write_bytes(json.dumps(doc, separators=(",", ":")).encode())
    repin(folder, commit)


def _pin(raw: bytes) -> tuple[int, str]:
    return len(raw), xxhash.xxh3_64_hexdigest(raw)


def repin(folder: Path, commit: dict[str, Any] | None = None) -> None:
    """Recompute the sizes and checksums that pin files: index files in the metadata, the
    metadata in COMMIT (with ``commit`` fields overridden), so a forged file looks intact."""
    path = metadata_path(folder)
    doc = json.loads(path.read_bytes())
    files = doc.get("files") if isinstance(doc, dict) else None
    refs = [f for f in files or [] if isinstance(f, dict) and isinstance(f.get("index"), str)]
    for ref in refs:
        index = folder / ref["index"]
        if "/" not in ref["index"] and index.is_file():
            ref["index_nbytes"], ref["index_checksum"] = _pin(index.read_bytes())
    if refs:
        path.write_bytes(json.dumps(doc, separators=(",", ":")).encode())
    record = {**read_commit(folder), **(commit or {})}
    record["metadata_nbytes"], record["metadata_checksum"] = _pin(path.read_bytes())
    (folder / "COMMIT").write_text(json.dumps(record, indent=1))


def _strings(doc: Any) -> Iterator[str]:
    if isinstance(doc, str):
        yield doc
    elif isinstance(doc, dict):
        for v in doc.values():
            yield from _strings(v)
    elif isinstance(doc, list):
        for v in doc:
            yield from _strings(v)


def debris(folder: Path) -> list[str]:
    """Names in a committed checkpoint folder that neither COMMIT nor the metadata names."""
    commit = read_commit(folder)
    named = {"COMMIT", "LOCK", commit["metadata_file"], *_strings(read_metadata(folder))}
    return sorted(p.name for p in folder.iterdir() if p.name not in named)


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
