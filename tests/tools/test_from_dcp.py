"""torch.distributed.checkpoint.save folders -> unickpt -> unickpt.load, bitwise."""

from __future__ import annotations

import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import unickpt
from unickpt.cli.main import main
from unickpt.errors import CheckpointCorruptError, UnsafeObjectError
from unickpt.foreign.dcp_pickles import load_dcp_metadata
from unickpt.tools import import_dcp

from .forged_pickle import FORGERIES, call_pickle, forge_metadata
from .helpers import assert_bitwise, assert_same, make_model, zeros_like


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_checkpoint_roundtrip(tmp_path: Path) -> None:
    model = make_model(7)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 6)).sum().backward()
    optimizer.step()
    state = {
        "model": model.state_dict(),
        "momentum": {k: optimizer.state[p]["momentum_buffer"] for k, p in model.named_parameters()},
        "extra": {"big": torch.randn(300, 200), "ids": torch.arange(7)},
        "sched": {"milestones": [3, 6], "groups": [{"lr": 0.1, "name": "a"}]},
        "step": 5,
        "tag": "x",
    }
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    report = import_dcp(tmp_path / "dcp", tmp_path / "c", group_bytes=4096)
    assert (report.tensors, report.values) == (10, 4)
    dest = zeros_like(state)
    unickpt.load(tmp_path / "c", dest)
    assert_same(dest, state)
    fresh = make_model(8)
    unickpt.load(tmp_path / "c", {"model": fresh}, strict=False)
    for k, v in model.state_dict().items():
        assert_bitwise(fresh.state_dict()[k], v, k)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_import_progress_covers_reading_then_saving(tmp_path: Path) -> None:
    state = {"a": torch.randn(300, 200), "b": torch.arange(7)}
    dcp.save(state, checkpoint_id=tmp_path / "dcp", no_dist=True)
    calls: list[tuple[int, int]] = []
    import_dcp(tmp_path / "dcp", tmp_path / "c", progress=lambda d, t: calls.append((d, t)))
    done = [d for d, _ in calls]
    assert done == sorted(done) and calls[-1][0] == calls[-1][1]
    assert {t for _, t in calls} == {2 * (300 * 200 * 4 + 7 * 8)}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("how", list(FORGERIES))
def test_forged_metadata_runs_no_code(
    tmp_path: Path, how: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """DCP pickles its .metadata: a forged one is refused, naming what it would have built,
    before anything of it runs; the CLI says the same."""
    state = {"w": torch.randn(4, 3), "step": 3}
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    marker = tmp_path / "ran"
    forge_metadata(tmp_path / "dcp", how, marker)
    with pytest.raises(UnsafeObjectError) as info:
        import_dcp(tmp_path / "dcp", tmp_path / "c")
    message = str(info.value)
    assert f"asks pickle to build {FORGERIES[how]}, which DCP metadata does not hold" in message
    assert "Pass --allow-pickle (allow_pickle=True) only if you trust" in message
    assert not marker.exists(), "the forged metadata ran code"
    assert not (tmp_path / "c").exists()
    assert main(["convert", str(tmp_path / "dcp"), str(tmp_path / "c"), "--from", "dcp"]) != 0
    assert f"build {FORGERIES[how]}" in capsys.readouterr().err
    assert not marker.exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("outside", ["relative", "absolute"])
def test_a_data_file_outside_the_folder_is_refused(
    tmp_path: Path, outside: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Metadata naming its data file by a path out of the folder (``../``, absolute) is refused
    by the conversion, with and without pickle, as by the online load, before torch's reader
    opens the file (here a real copy of it, which would read back without error)."""
    state = {"w": torch.randn(4, 3), "step": 3}
    src = tmp_path / "dcp"
    dcp.save(state, checkpoint_id=src, no_dist=True)
    shutil.copy(src / "__0_0.distcp", tmp_path / "outside.distcp")
    name = "../outside.distcp" if outside == "relative" else str(tmp_path / "outside.distcp")
    meta = pickle.loads((src / ".metadata").read_bytes())  # the test's own, trusted file
    for info in meta.storage_data.values():
        info.relative_path = name
    (src / ".metadata").write_bytes(pickle.dumps(meta))
    says = f"names data file {name!r} for "
    expected = "a file of the checkpoint's folder (a name, not a path)"
    for allow in (False, True):
        with pytest.raises(CheckpointCorruptError) as info:
            import_dcp(src, tmp_path / f"c{allow}", allow_pickle=allow)
        assert says in str(info.value) and expected in str(info.value)
        assert not (tmp_path / f"c{allow}").exists()
    with pytest.raises(CheckpointCorruptError) as info:
        unickpt.load(src, {"w": torch.zeros(4, 3), "step": 0})
    assert says in str(info.value) and expected in str(info.value)
    assert main(["convert", str(src), str(tmp_path / "c"), "--from", "dcp"]) != 0
    assert says in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_list_index_past_the_entries_allocates_nothing(tmp_path: Path) -> None:
    """DCP's planner data places each entry in the state's lists by index: an index beyond
    the number of entries is refused, not a list of that length allocated."""
    src = tmp_path / "dcp"
    dcp.save({"groups": [{"lr": 0.5}], "w": torch.ones(2)}, checkpoint_id=src, no_dist=True)
    meta = pickle.loads((src / ".metadata").read_bytes())  # the test's own, trusted file
    meta.planner_data["groups.0.lr"] = ("groups", 10**9, "lr")
    (src / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(CheckpointCorruptError, match="at list index 1000000000, but the"):
        import_dcp(src, tmp_path / "c")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_real_metadata_reads_with_only_dcp_classes(tmp_path: Path) -> None:
    """Every class real DCP metadata holds (dtypes, layouts, paths, storage info) is allowed:
    the import is bitwise, with and without pickle allowed."""
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8]
    dtypes += [torch.uint8, torch.int16, torch.int64, torch.bool, torch.complex64]
    state: dict[str, Any] = {f"t{i}": torch.ones(3, 2).to(d) for i, d in enumerate(dtypes)}
    state["f8"] = torch.randn(5).to(torch.float8_e4m3fn)
    state["big"] = torch.randn(300, 200)
    state["empty"] = torch.zeros(0, 3)
    state["scalar"] = torch.tensor(2.5)
    model = make_model(3)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 6)).sum().backward()
    optimizer.step()
    state["optim"] = optimizer.state_dict()
    state["misc"] = {"lst": [1, {"q": "s"}], "b": b"x", "f": 1.5, "n": None, "t": (1, 2)}
    dcp.save(state, checkpoint_id=tmp_path / "dcp", no_dist=True)
    for allow in (False, True):
        target = tmp_path / f"c{allow}"
        import_dcp(tmp_path / "dcp", target, allow_pickle=allow)
        dest = zeros_like(state)
        unickpt.load(target, dest)
        assert_same(dest, state)


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("torch", "load"),
        ("torch.serialization", "load"),
        ("torch.distributed.checkpoint.metadata", "dataclass"),  # imported there, not defined
        ("torch.distributed.checkpoint.metadata", "Enum"),
        ("torch.distributed.checkpoint.metadata", "__builtins__"),
        ("torch.distributed.checkpoint.metadata", "torch.load"),
        ("pathlib", "Path.write_text"),
        ("builtins", "getattr"),
        ("__builtin__", "eval"),
    ],
)
def test_only_what_dcp_metadata_holds_is_built(module: str, name: str) -> None:
    raw = call_pickle(module, name, "x")
    with pytest.raises(UnsafeObjectError, match=f"build {re.escape(f'{module}.{name}')}, "):
        load_dcp_metadata(raw, "m")
