"""Backends chosen by URL scheme, and a backend plugged in with one registration."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import unickpt
from unickpt import CheckpointError
from unickpt.storage import LocalStorage, open_storage, register_backend
from unickpt.storage.fsspec import FsspecStorage
from unickpt.storage.registry import scheme_of


def test_schemes(tmp_path: Path) -> None:
    assert isinstance(open_storage(tmp_path), LocalStorage)
    assert isinstance(open_storage(str(tmp_path)), LocalStorage)
    local = open_storage(f"file://{tmp_path}/a%20b")
    assert isinstance(local, LocalStorage) and local.location == f"{tmp_path}/a b"
    mem = open_storage("memory://reg/x")
    assert isinstance(mem, FsspecStorage) and mem.location == "memory:///reg/x"
    assert open_storage(mem) is mem
    assert scheme_of("S3://b/k") == "s3" and scheme_of("runs/gpt") == ""
    assert scheme_of("simplecache::memory://x") == "simplecache"


def test_unknown_scheme_says_what_is_known() -> None:
    with pytest.raises(CheckpointError, match=r"no storage backend for nosuch://.*memory://"):
        open_storage("nosuch://x/y")


class _Tagged(LocalStorage):
    """A backend of its own: local files under a folder named by the URL's host."""

    def __init__(self, url: str) -> None:
        super().__init__(url.replace("tagged://", "", 1))
        self.url = url

    @property
    def location(self) -> str:
        return self.url

    def child(self, name: str) -> _Tagged:
        return _Tagged(f"{self.url}/{name}")


def test_a_registered_backend_serves_save_load_and_checkpointer(tmp_path: Path) -> None:
    register_backend("tagged", _Tagged)
    url = f"tagged://{tmp_path}/run"
    state = {"w": torch.arange(10.0)}
    with unickpt.Checkpointer(url, mode="sync") as ckpt:
        ckpt.save(3, state)
        assert ckpt.path(3) == f"{url}/step-000000003"
    dest = {"w": torch.zeros(10)}
    unickpt.load(f"{url}/step-000000003", dest)
    assert torch.equal(dest["w"], state["w"])
    assert unickpt.Checkpointer(url).steps() == [3]
