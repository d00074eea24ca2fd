"""How the systems are set up: DCP and the peers get unickpt's writer threads, DCP its plan
caching, and every registered system names a class that exists."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import pytest

from unickpt.bench.harness import _system_env
from unickpt.bench.systems import CheckpointSystem, create_system
from unickpt.bench.systems.registry import SYSTEM_INFOS
from unickpt.bench.systems.torch_systems import DcpSystem, _has_plan_caching, stager_reusable


@pytest.mark.parametrize("threads", ["4", "7"])
def test_dcp_writes_with_unickpts_threads_and_caches_its_plan(
    threads: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UNICKPT_IO_THREADS", threads)
    system = create_system("dcp")
    assert isinstance(system, DcpSystem)
    writer = system._writer(tmp_path / "ckpt")
    assert writer.thread_count == int(threads)
    assert writer.sync_files  # durable, as unickpt's save is
    assert f"thread_count={threads}" in system.notes
    assert _has_plan_caching()  # the installed torch (2.13) has it
    assert system._planner()._enable_plan_caching  # type: ignore[attr-defined]
    assert "DefaultSavePlanner(enable_plan_caching=True)" in system.notes


def test_peers_get_unickpts_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UNICKPT_IO_THREADS", "6")
    assert _system_env("bytecheckpoint")["BYTECHECKPOINT_STORE_WORKER_COUNT"] == "6"
    assert _system_env("dcp") == {}


def test_every_system_names_its_class() -> None:
    for info in SYSTEM_INFOS:
        module_name, class_name = info.impl.split(":")
        assert info.description and info.label
        if info.peer:  # their modules import the peer libraries: found, not imported
            assert importlib.util.find_spec(module_name) is not None, info
            continue
        cls = getattr(importlib.import_module(module_name), class_name)
        assert issubclass(cls, CheckpointSystem), info


def test_stager_reused_except_on_torch_2_11() -> None:
    assert not stager_reusable("2.11.0+cu130") and not stager_reusable("2.11.1")
    assert stager_reusable("2.10.0") and stager_reusable("2.13.0+cpu")
