"""torch.distributed.checkpoint folders loaded online, resharded, without running their code."""

from __future__ import annotations

import json
import pickle
import shutil
import tracemalloc
from pathlib import Path

import pytest
import torch

import unickpt
from unickpt.errors import CheckpointCorruptError, UnsafeObjectError

from ..distributed import run_ranks, start_process
from ..tools.forged_pickle import (
    ALLOCATIONS,
    FORGERIES,
    forge_metadata,
    opcode_forgeries,
    prefix_metadata,
)
from .jobs import dcp_full, dcp_load, dcp_save, load_forged


@pytest.fixture(scope="module")
def dcp_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("dcp") / "ckpt"
    run_ranks(2, dcp_save, str(folder))
    return folder


def test_saved_at_two_ranks_loads_at_one(dcp_folder: Path) -> None:
    full = dcp_full()
    state = {"model": {k: torch.zeros_like(v) for k, v in full.items()}, "step": 0}
    report = unickpt.load(dcp_folder, state)
    for k, v in full.items():
        assert torch.equal(state["model"][k], v), k
    assert state["step"] == 7
    assert report.bytes_read == sum(v.numel() * v.element_size() for v in full.values())
    assert report.unverified_files and all(f.endswith(".distcp") for f in report.unverified_files)


def test_saved_at_two_ranks_loads_at_two_in_another_layout(dcp_folder: Path) -> None:
    for equal, bytes_read, held in run_ranks(2, dcp_load, str(dcp_folder)):
        assert equal
        assert bytes_read == held


@pytest.mark.parametrize("how", list(FORGERIES))
def test_forged_metadata_is_refused_without_running_it(
    tmp_path: Path, dcp_folder: Path, how: str
) -> None:
    folder = tmp_path / "forged"
    folder.mkdir()
    for f in dcp_folder.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    marker = tmp_path / "ran"
    forge_metadata(folder, how, marker)
    state = {"model": {k: torch.zeros_like(v) for k, v in dcp_full().items()}, "step": 0}
    with pytest.raises(UnsafeObjectError, match=FORGERIES[how]):
        unickpt.load(folder, state)
    assert not marker.exists()


def _copy(dcp_folder: Path, to: Path) -> Path:
    shutil.copytree(dcp_folder, to)
    return to


def _peak_of_failed_load(folder: Path, dcp_folder: Path) -> tuple[BaseException, int]:
    """The error of loading ``folder`` and the peak of the Python memory that load allocated
    (after a load of the real folder, so that no import is counted)."""
    state = {"model": {k: torch.zeros_like(v) for k, v in dcp_full().items()}, "step": 0}
    unickpt.load(dcp_folder, state)
    tracemalloc.start()
    try:
        unickpt.load(folder, state)
    except unickpt.CheckpointError as e:
        return e, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    raise AssertionError(f"{folder} loaded")


def test_forged_opcodes_are_refused_and_change_nothing(tmp_path: Path, dcp_folder: Path) -> None:
    """Real metadata led by opcodes that steer what allowed names build (BUILD on a class or on
    a process-wide enum member, items set on a class, INST, OBJ...): the online load and the
    conversion both refuse each with an error naming the opcode, and the process's classes and
    DCP's enum members are as they were (checked in a process of their own)."""
    forgeries = opcode_forgeries(str(tmp_path / "decoy"))
    folders = {}
    for i, (name, (ops, _)) in enumerate(forgeries.items()):
        folders[name] = _copy(dcp_folder, tmp_path / f"forged{i}")
        prefix_metadata(folders[name], ops)
    out = tmp_path / "found.json"
    proc = start_process(load_forged, [str(f) for f in folders.values()], str(out))
    proc.join(120)
    assert proc.exitcode == 0
    found = json.loads(out.read_text())
    for name, (_, says) in forgeries.items():
        for way in ("load", "convert"):
            got = found[f"{folders[name].name} {way}"]
            assert got["error"].startswith("UnsafeObjectError: "), (name, way, got)
            assert f"applies pickle's {says}" in got["error"], (name, way, got)
            assert "which DCP metadata never does; unickpt refused it." in got["error"]
            assert got["untouched"], (name, way)


@pytest.mark.parametrize("how", list(ALLOCATIONS))
def test_constructors_given_sizes_allocate_nothing(
    tmp_path: Path, dcp_folder: Path, how: str
) -> None:
    """At most 48 bytes of pickle asking an allowed constructor for hundreds of MiB: refused
    before anything is allocated (the load's Python allocations peak under 4 MiB)."""
    folder = _copy(dcp_folder, tmp_path / "forged")
    ops, says = ALLOCATIONS[how]
    assert len(ops) <= 48
    prefix_metadata(folder, ops)
    error, peak = _peak_of_failed_load(folder, dcp_folder)
    assert isinstance(error, UnsafeObjectError) and says in str(error), error
    assert peak < 1 << 20, f"{how}: {peak} bytes allocated at the peak"


def test_value_length_past_its_file_allocates_nothing(tmp_path: Path, dcp_folder: Path) -> None:
    """A non-tensor entry whose stated length (512 MiB) passes its file's end is refused,
    naming the file and its size, before its buffer is allocated; so is one whose range
    overlaps another's (a tensor's)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    folder = _copy(dcp_folder, tmp_path / "long")
    meta = pickle.loads((folder / ".metadata").read_bytes())  # the test's own, trusted file
    info = meta.storage_data[MetadataIndex("step")]
    info.length = 512 << 20
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    error, peak = _peak_of_failed_load(folder, dcp_folder)
    size = (folder / info.relative_path).stat().st_size
    assert isinstance(error, CheckpointCorruptError)
    assert f"{info.relative_path} has {size} bytes but the DCP metadata places 'step' at " in str(
        error
    )
    assert peak < 1 << 20, f"{peak} bytes allocated at the peak"
    other = next(i for i in meta.storage_data.values() if i.offset and i is not info)
    info.relative_path, info.offset, info.length = other.relative_path, other.offset, 16
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    state = {"model": {k: torch.zeros_like(v) for k, v in dcp_full().items()}, "step": 0}
    with pytest.raises(CheckpointCorruptError, match="in overlapping bytes of"):
        unickpt.load(folder, state)


def test_megatron_torch_dist_tensors_load_online(tmp_path: Path) -> None:
    """Megatron-Core's torch_dist backend is DCP underneath: its tensors (and sharded objects)
    load as they are; its common.pt (iteration, args) is a separate torch.save file."""
    pytest.importorskip("megatron.core")
    from ..tools.megatron_job import full_tensors, save_megatron

    path = tmp_path / "iter_0000007"
    path.mkdir()
    run_ranks(2, save_megatron, str(path))
    full = full_tensors()
    whole = {k: torch.zeros_like(v) for k, v in full.items()}
    state = {**whole, "rng_state/shard_0_2": None}
    report = unickpt.load(path, state, strict=False)
    for key, value in full.items():
        assert torch.equal(whole[key], value), key
    assert state["rng_state/shard_0_2"] == [{"seed": 1234}]  # Megatron wraps it in a list
    assert report.bytes_read == sum(v.numel() * v.element_size() for v in full.values())
