"""Incremental checkpoints: unchanged chunks are referred to, never written again."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import unickpt
from tests.distributed import run_ranks
from tests.integrity._helpers import metadata_path
from unickpt.checkpointer import step_name
from unickpt.cli.main import main
from unickpt.demo.lora import add_lora
from unickpt.demo.model import GPT, GPTConfig
from unickpt.engine.checksum import digest
from unickpt.tools.convert import ConvertOptions, export_checkpoint
from unickpt.tools.verify import verify_checkpoint


def _lora_gpt(rank: int = 4) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=64, context_len=32, n_layers=2, n_heads=4, d_model=128)
    return add_lora(GPT(config), rank)


def _train(model: GPT, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, 64, (4, 33), generator=gen)
        model(idx[:, :-1], idx[:, 1:]).backward()
        opt.step()
        opt.zero_grad()


def _data_bytes(folder: str) -> int:
    return sum(p.stat().st_size for p in Path(folder).glob("data-*.bin"))


def _same(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_lora_fine_tune_writes_only_the_adapters(tmp_path: Path) -> None:
    model = _lora_gpt()
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-3)
    ckpt = unickpt.Checkpointer(tmp_path, incremental=True, mode="sync")
    sizes = []
    for step in range(4):
        _train(model, opt, 2, seed=step)
        report = ckpt.save(step, {"model": model, "optim": opt}).wait()
        assert report is not None
        sizes.append(report.bytes_written)
        assert _data_bytes(ckpt.path(step)) == report.bytes_written
    adapters = sum(p.numel() * p.element_size() for p in trained)
    optimizer = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())
    full = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert sizes[0] >= full, "the first save of a Checkpointer is full"
    for n in sizes[1:]:
        assert n <= 1.1 * (adapters + optimizer), (n, adapters, optimizer)
    meta = json.loads(next(Path(ckpt.path(3)).glob("metadata-*.json")).read_text())
    assert meta["version"] == 2 and meta["references"] == ["step-000000000"]

    restored = _lora_gpt()
    ropt = torch.optim.AdamW([p for p in restored.parameters() if p.requires_grad], lr=1e-3)
    with torch.no_grad():
        for p in restored.parameters():
            p.zero_()
    assert ckpt.load_latest({"model": restored, "optim": ropt}) == 3
    assert _same(model, restored)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    _train(model, opt, 1, seed=9)
    _train(restored, ropt, 1, seed=9)
    assert _same(model, restored), "the optimizer state came back too"

    report = verify_checkpoint(ckpt.path(3))
    assert report.ok and report.bytes_verified >= full
    out = tmp_path / "model.pt"
    export_checkpoint(ckpt.path(3), out, "torch", ConvertOptions(only="model"))
    exported = torch.load(out, weights_only=True)
    assert exported.keys() == saved.keys()
    assert all(torch.equal(exported[k], v) for k, v in saved.items())
    ckpt.close()


def _state(frozen: torch.Tensor, step: int) -> dict[str, Any]:
    return {"frozen": frozen, "live": torch.full((1000,), float(step)), "meta": {"step": step}}


def test_compaction_and_retention_keep_what_is_referred_to(tmp_path: Path) -> None:
    frozen = torch.arange(300_000, dtype=torch.float32)
    ckpt = unickpt.Checkpointer(tmp_path, keep_last=2, incremental=True, full_every=3, mode="sync")
    listed = []
    for step in range(7):
        report = ckpt.save(step, _state(frozen, step)).wait()
        assert report is not None
        full = step % 3 == 0
        assert (report.bytes_written > frozen.nbytes) == full, (step, report.bytes_written)
        listed.append(ckpt.steps())
    # step 1 and 2 refer to 0, 4 and 5 to 3: a step stays while a kept one refers to it
    assert listed == [[0], [0, 1], [0, 1, 2], [0, 2, 3], [3, 4], [3, 4, 5], [3, 5, 6]]
    for step in ckpt.steps():
        dest = _state(torch.zeros_like(frozen), -1)
        unickpt.load(ckpt.path(step), dest)
        assert torch.equal(dest["frozen"], frozen) and dest["meta"]["step"] == step
        assert torch.equal(dest["live"], torch.full((1000,), float(step)))
    ckpt.close()


def test_a_restarted_job_refers_to_the_newest_checkpoint(tmp_path: Path) -> None:
    frozen = torch.arange(300_000, dtype=torch.float32)
    options: dict[str, Any] = {"incremental": True, "full_every": 3, "mode": "sync"}
    with unickpt.Checkpointer(tmp_path / "run", **options) as ckpt:
        for step in range(2):
            ckpt.save(step, _state(frozen, step))
    with unickpt.Checkpointer(tmp_path / "run", **options) as ckpt:  # the job restarted
        sizes = [ckpt.save(step, _state(frozen, step)).wait() for step in (2, 3)]
        assert sizes[0] is not None and sizes[0].bytes_written < frozen.nbytes  # refers to 0
        # step 1 referred to step 0 and step 2 to step 0: the chain is due for a full save
        assert sizes[1] is not None and sizes[1].bytes_written > frozen.nbytes
        dest = _state(torch.zeros_like(frozen), -1)
        unickpt.load(ckpt.path(2), dest)
        assert torch.equal(dest["frozen"], frozen) and dest["meta"]["step"] == 2
        assert json.loads(metadata_path(Path(ckpt.path(2))).read_bytes())["references"] == [
            step_name(0)
        ]
    with unickpt.Checkpointer(tmp_path / "damaged", **options) as ckpt:
        ckpt.save(0, _state(frozen, 0))
        metadata_path(Path(ckpt.path(0))).write_bytes(b"{}")
    with unickpt.Checkpointer(tmp_path / "damaged", **options) as ckpt:
        report = ckpt.save(1, _state(frozen, 1)).wait()  # step 0 does not read: a full save
        assert report is not None and report.bytes_written > frozen.nbytes


def test_saving_over_a_step_others_refer_to_is_refused(tmp_path: Path) -> None:
    frozen = torch.arange(300_000, dtype=torch.float32)
    ckpt = unickpt.Checkpointer(tmp_path, incremental=True, mode="sync")
    for step in range(3):
        ckpt.save(step, _state(frozen, step))
    with pytest.raises(unickpt.CheckpointError) as info:
        ckpt.save(0, _state(frozen, 9))
    assert str(info.value) == (
        f"{tmp_path}/step-000000000 holds a committed checkpoint whose bytes the incremental "
        "checkpoints in step-000000001, step-000000002 refer to; replacing it would break them. "
        "Save under a new step, or delete those checkpoints first. Nothing was written."
    )
    ckpt.save(2, _state(frozen, 7))  # nothing refers to the newest step: saved again
    for step, value in ((0, 0), (1, 1), (2, 7)):
        dest = _state(torch.zeros_like(frozen), -1)
        unickpt.load(ckpt.path(step), dest)
        assert torch.equal(dest["frozen"], frozen) and dest["meta"]["step"] == value
    ckpt.close()


def test_missing_or_damaged_referenced_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    frozen = torch.arange(300_000, dtype=torch.float32)
    ckpt = unickpt.Checkpointer(tmp_path, incremental=True, mode="sync")
    for step in range(3):
        ckpt.save(step, _state(frozen, step))
    assert main(["verify", ckpt.path(2)]) == 0
    assert main(["inspect", ckpt.path(2)]) == 0
    assert "refers to   step-000000000" in capsys.readouterr().out
    data = next(Path(ckpt.path(0)).glob("data-*.bin"))
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0x5A
    data.write_bytes(bytes(raw))
    report = verify_checkpoint(ckpt.path(2))
    assert not report.ok
    assert report.damage[0].file == f"../step-000000000/{data.name}"
    assert (
        "checksum mismatch" in report.damage[0].message and "'frozen'" in report.damage[0].message
    )
    with pytest.raises(unickpt.CheckpointCorruptError, match="checksum mismatch"):
        unickpt.load(ckpt.path(2), _state(torch.zeros_like(frozen), -1))
    capsys.readouterr()
    assert main(["verify", ckpt.path(2)]) == 1
    assert f"checksum mismatch in ../step-000000000/{data.name}" in capsys.readouterr().out

    (Path(ckpt.path(0)) / "COMMIT").unlink()
    dest = _state(torch.zeros_like(frozen), -1)
    with pytest.raises(unickpt.CheckpointCorruptError, match=r"step-000000000.*no committed"):
        unickpt.load(ckpt.path(2), dest)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(unickpt.CheckpointCorruptError) as failed:
            ckpt.load_latest(dest)  # steps 1 and 2 both need step 0: nothing loads, and it says so
    assert len(caught) == 2 and "step-000000000" in str(caught[0].message)
    tried = [line.split()[1] for line in str(failed.value).splitlines() if "  step " in line]
    assert tried == ["2", "1"] and str(failed.value).count("which holds no committed") == 2
    report = verify_checkpoint(ckpt.path(1))
    assert "no committed checkpoint" in report.damage[0].message
    ckpt.save(3, _state(frozen, 3))
    assert ckpt.load_latest(dest) == 3, "a new chain starts after a failed load"
    ckpt.close()


def test_async_and_zero_stall_saves(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 4))
    model[0].requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for background in (False, True):
        root = tmp_path / str(background)
        ckpt = unickpt.Checkpointer(
            root, incremental=True, mode="zero_stall" if background else "async"
        )
        for step in range(3):
            model(torch.randn(2, 256)).sum().backward()
            opt.step()
            ckpt.save(step, {"model": model, "optim": opt})
        ckpt.wait()
        assert _data_bytes(ckpt.path(2)) < 256 * 256 * 4
        fresh = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 4))
        assert ckpt.load_latest({"model": fresh}, strict=False) == 2
        assert _same(model, fresh)
        ckpt.close()


def _repin(folder: Path, version: int) -> None:
    """Rewrite a checkpoint's commit, metadata and indexes with another format version."""
    commit = json.loads((folder / "COMMIT").read_text())
    meta_path = folder / commit["metadata_file"]
    meta = json.loads(meta_path.read_text())
    for f in meta["files"]:
        index = folder / f["index"]
        doc = json.loads(index.read_text())
        doc["version"] = version
        raw = json.dumps(doc).encode()
        index.write_bytes(raw)
        f["index_nbytes"], f["index_checksum"] = len(raw), digest(memoryview(raw))
    meta["version"] = version
    raw = json.dumps(meta).encode()
    meta_path.write_bytes(raw)
    commit.update(
        version=version, metadata_nbytes=len(raw), metadata_checksum=digest(memoryview(raw))
    )
    (folder / "COMMIT").write_text(json.dumps(commit))


def test_version_1_checkpoints_still_load(tmp_path: Path) -> None:
    model = nn.Linear(64, 32)
    unickpt.save(tmp_path / "v1", {"model": model, "step": 5})
    _repin(tmp_path / "v1", 1)
    fresh = nn.Linear(64, 32)
    unickpt.load(tmp_path / "v1", {"model": fresh})
    assert _same(model, fresh)
    assert verify_checkpoint(tmp_path / "v1").ok
    _repin(tmp_path / "v1", 4)
    with pytest.raises(unickpt.CheckpointVersionError, match="versions up to 3"):
        unickpt.load(tmp_path / "v1", {"model": fresh})


def _save_on_ranks(rank: int, world: int, root: str) -> list[int]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 128), nn.Linear(128, 2))
    model[0].requires_grad_(False)
    model[1].requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    written = []
    with unickpt.Checkpointer(root, incremental=True, mode="sync") as ckpt:
        for step in range(3):
            model(torch.ones(2, 128)).sum().backward()
            opt.step()
            report = ckpt.save(step, {"model": model}).wait()
            assert report is not None
            written.append(report.bytes_written)
        fresh = nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 128), nn.Linear(128, 2))
        assert ckpt.load_latest({"model": fresh}) == 2
        assert _same(model, fresh)
    return written


def test_two_ranks_share_the_writing_and_the_references(tmp_path: Path) -> None:
    results = run_ranks(2, _save_on_ranks, str(tmp_path))
    for written in results:
        assert written[1] < 2048 and written[2] < 2048, written  # the last layer only
    assert sum(r[0] for r in results) >= 2 * 128 * 128 * 4
    meta = json.loads(next((tmp_path / "step-000000002").glob("metadata-*.json")).read_text())
    assert meta["references"] == ["step-000000000"] and len(meta["files"]) == 2
