"""UnickptCheckpointManager under torchtitan's own model and components, 2 gloo ranks."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torchtitan", reason="needs torchtitan: pip install 'unickpt[torchtitan]'")
pytest.importorskip("triton", reason="torchtitan's models import triton: pip install triton")

from tests.distributed import run_ranks
from tests.storage.s3_server import moto_server, new_bucket, raw_client
from unickpt.errors import CheckpointError
from unickpt.tools import inspect_checkpoint

pytestmark = pytest.mark.slow


def _reference_fsdp(rank: int, world: int, folder: str) -> dict[str, Any]:
    from tests.integrations import titan_job as tj

    records = tj.record_logs()
    job = tj.build(
        world,
        1,
        folder,
        6,
        interval=2,
        keep_latest_k=2,
        async_mode="async_with_pinned_mem",
        last_save_model_only=False,
    )
    losses = tj.train(job, 6, 6)
    job.manager.close()
    return {"losses": losses, "digests": tj.digests(job), "logs": records.messages}


def _resume_fsdp(rank: int, world: int, folder: str) -> dict[str, Any]:
    from tests.integrations import titan_job as tj

    records = tj.record_logs()
    job = tj.build(world, 1, folder, 6, interval=2, load_only=True)
    assert job.manager.load(step=4)
    assert job.train_state.step == 4
    losses = tj.train(job, 6, 6)
    job.manager.close()
    return {"losses": losses, "digests": tj.digests(job), "logs": records.messages}


def _load_one_rank(rank: int, world: int, folder: str) -> dict[str, Any]:
    from tests.integrations import titan_job as tj

    records = tj.record_logs()
    job = tj.build(world, 1, folder, 6, load_only=True, exclude_from_loading=["dataloader"])
    assert job.manager.load()
    step = job.train_state.step
    job.manager.close()
    return {"step": step, "digests": tj.digests(job), "logs": records.messages}


SECONDS = r"\d+\.\d\d seconds"


def _saved(ckpt: Path, step: int) -> list[str]:
    return [
        re.escape(f"Saving the checkpoint (step {step}) to {ckpt}/step-{step:09d}"),
        rf"Finished saving the checkpoint in {SECONDS} \(\d+ bytes written by this rank\)",
    ]


def _loaded(ckpt: Path, step: int) -> list[str]:
    return [
        re.escape(f"Loading the checkpoint from {ckpt}/step-{step:09d}"),
        rf"Finished loading the checkpoint in {SECONDS} \(step {step}, source storage\)",
    ]


def _assert_logs(messages: list[str], patterns: list[str]) -> None:
    titan = [m for m in messages if m.startswith(("Saving", "Finished", "Loading"))]
    assert len(titan) == len(patterns), titan
    for message, pattern in zip(titan, patterns, strict=True):
        assert re.fullmatch(pattern, message), (message, pattern)


def test_fsdp2_save_resume_on_two_and_one_rank(tmp_path: Path) -> None:
    folder = str(tmp_path)
    ref = run_ranks(2, _reference_fsdp, folder)[0]
    ckpt = tmp_path / "ckpt"
    _assert_logs(ref["logs"], _saved(ckpt, 2) + _saved(ckpt, 4) + _saved(ckpt, 6))
    # keep_latest_k=2: of the saves at steps 2, 4 and 6, the last two remain
    assert sorted(p.name for p in ckpt.glob("step-*")) == ["step-000000004", "step-000000006"]
    summary = inspect_checkpoint(ckpt / "step-000000004")
    assert summary.world_size == 2
    keys = {t.key for t in summary.tensors} | {o.key for o in summary.objects}
    assert "model.tok_embeddings.weight" in keys
    assert "optimizer.state.tok_embeddings.weight.exp_avg" in keys
    assert "lr_scheduler.last_epoch" in keys and "train_state.step" in keys
    assert any(o.key == "dataloader.state" and o.per_rank for o in summary.objects)

    one = run_ranks(1, _load_one_rank, folder)[0]
    assert one["step"] == 6
    assert one["digests"] == ref["digests"]  # resharded 2 -> 1 rank, bit for bit
    _assert_logs(one["logs"], _loaded(ckpt, 6))  # load(): the newest step

    resumed = run_ranks(2, _resume_fsdp, folder)[0]
    assert resumed["losses"] == ref["losses"][4:]
    assert resumed["digests"] == ref["digests"]  # same layout: training continues bit for bit
    _assert_logs(resumed["logs"], _loaded(ckpt, 4))  # load_only: no saves


def _reference_tp(rank: int, world: int, folder: str) -> dict[str, Any]:
    from tests.integrations import titan_job as tj

    job = tj.build(world, 2, folder, 4, interval=2, keep_latest_k=0, async_mode="async")
    tj.train(job, 2, 4)
    at_two = tj.digests(job)
    losses = tj.train(job, 4, 4)
    job.manager.close()
    return {"at_two": at_two, "losses": losses, "digests": tj.digests(job)}


def _resume_tp_and_fsdp(rank: int, world: int, folder: str) -> dict[str, Any]:
    from tests.integrations import titan_job as tj

    job = tj.build(world, 2, folder, 4, interval=2, load_only=True)
    assert job.manager.load(step=2)
    losses = tj.train(job, 4, 4)
    resumed = tj.digests(job)
    job.manager.close()
    # the same checkpoint into FSDP2 (dp_shard=2): another layout, another data-parallel degree
    fsdp = tj.build(world, 1, folder, 4, load_only=True, exclude_from_loading=["dataloader"])
    assert fsdp.manager.load(step=2)
    fsdp.manager.close()
    return {"losses": losses, "digests": resumed, "fsdp_at_two": tj.digests(fsdp)}


def test_tensor_parallel_save_resume_and_reshard_to_fsdp2(tmp_path: Path) -> None:
    folder = str(tmp_path)
    ref = run_ranks(2, _reference_tp, folder)[0]
    last = inspect_checkpoint(tmp_path / "ckpt" / "step-000000004")
    # the last save is the model only (torchtitan's last_save_model_only default)
    assert {t.key.split(".")[0] for t in last.tensors} == {"model"}
    assert not any(o.per_rank for o in last.objects)

    out = run_ranks(2, _resume_tp_and_fsdp, folder)[0]
    assert out["losses"] == ref["losses"]
    assert out["digests"] == ref["digests"]
    assert out["fsdp_at_two"] == ref["at_two"]


def _initial_load_in_hf(rank: int, world: int, folder: str, hf: str) -> dict[str, Any]:
    import torch.distributed as dist
    from safetensors.torch import load_file

    from tests.integrations import titan_job as tj

    local = f"{folder}/local-hf"
    if rank == 0:
        os.makedirs(local)
        tj.write_hf_model(local, seed=1)
        if hf.startswith("s3://"):
            bucket, prefix = hf.removeprefix("s3://").split("/", 1)
            with open(f"{local}/model.safetensors", "rb") as f:
                body = f.read()
            client = raw_client(os.environ["AWS_ENDPOINT_URL"])
            client.put_object(Bucket=bucket, Key=f"{prefix}/model.safetensors", Body=body)
    dist.barrier()
    records = tj.record_logs()
    job = tj.build(world, 1, folder, 4, initial_load_path=hf, initial_load_in_hf=True)
    before = tj.full_state(job.model)
    assert job.manager.load()
    after = tj.full_state(job.model)
    job.manager.close()
    out: dict[str, Any] = {"logs": records.messages}
    if rank == 0:
        expected = tj.adapter().from_hf(load_file(f"{local}/model.safetensors"))
        out["keys"] = sorted(after) == sorted(expected)
        out["unequal"] = [k for k in after if not torch.equal(after[k], expected[k])]
        out["changed"] = sum(not torch.equal(before[k], after[k]) for k in after)
        out["total"] = len(after)
    return out


def _assert_loaded_hf(out: dict[str, Any], hf: str) -> None:
    assert out["keys"] and out["unequal"] == []  # every parameter, bit for bit
    assert out["changed"] == out["total"]  # the job's own init differs everywhere
    _assert_logs(
        out["logs"],
        [
            re.escape(f"Loading the checkpoint from {hf}"),
            rf"Finished loading the checkpoint in {SECONDS} "
            r"\(checkpoint.initial_load_path, source storage\)",
        ],
    )


def test_initial_load_in_hf_loads_a_safetensors_model_into_fsdp2(tmp_path: Path) -> None:
    hf = str(tmp_path / "local-hf")
    _assert_loaded_hf(run_ranks(2, _initial_load_in_hf, str(tmp_path), hf)[0], hf)


def test_initial_load_in_hf_reads_a_model_on_s3(tmp_path: Path) -> None:
    with moto_server() as endpoint:
        hf = f"s3://{new_bucket(endpoint)}/models/debug"
        _assert_loaded_hf(run_ranks(2, _initial_load_in_hf, str(tmp_path), hf)[0], hf)


def _last_save_in_hf(rank: int, world: int, folder: str) -> dict[str, Any]:
    from tests.integrations import titan_job as tj

    records = tj.record_logs()
    job = tj.build(world, 1, folder, 3, interval=2, last_save_in_hf=True, export_dtype="bfloat16")
    tj.train(job, 3, 3)
    steps = job.manager._ckpt.steps()
    path = job.manager.hf_path(3)
    job.manager.close()
    expected = tj.adapter().to_hf(tj.full_state(job.model))
    return {
        "logs": records.messages,
        "steps": steps,
        "path": path,
        "expected": {k: _digest(v.bfloat16()) for k, v in expected.items()},
    }


def _digest(tensor: Any) -> str:
    raw = tensor.detach().reshape(-1).contiguous().view(torch.uint8).numpy()
    return hashlib.sha256(raw.tobytes()).hexdigest()


def test_last_save_in_hf_writes_the_model_as_safetensors(tmp_path: Path) -> None:
    from safetensors import safe_open

    out = run_ranks(2, _last_save_in_hf, str(tmp_path))[0]
    ckpt = tmp_path / "ckpt"
    hf = ckpt / "step-000000003-hf"
    assert out["path"] == str(hf)
    assert out["steps"] == [2]  # the unickpt checkpoints: the HF folder is not one
    _assert_logs(
        out["logs"],
        [
            *_saved(ckpt, 2),
            re.escape(f"Saving the checkpoint (step 3) to {hf}"),
            rf"Finished saving the checkpoint in {SECONDS} \(\d+ bytes written by this rank\)",
        ],
    )
    assert sorted(p.name for p in hf.iterdir()) == ["model.safetensors"]
    expected = out["expected"]
    with safe_open(str(hf / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(expected)
        assert "model.layers.0.self_attn.q_proj.weight" in expected
        for key in expected:
            saved = f.get_tensor(key)
            assert saved.dtype == torch.bfloat16, key
            assert _digest(saved) == expected[key], key  # bit for bit


def test_config_refuses_what_it_cannot_do() -> None:
    from unickpt.integrations.torchtitan import UnickptCheckpointManager

    with pytest.raises(ValueError, match="last_save_in_hf requires last_save_model_only"):
        UnickptCheckpointManager.Config(last_save_in_hf=True, last_save_model_only=False)
    with pytest.raises(ValueError, match="initial_load_in_hf requires initial_load_model_only"):
        UnickptCheckpointManager.Config(
            initial_load_path="s3://bucket/hf",
            initial_load_in_hf=True,
            initial_load_model_only=False,
        )
    with pytest.raises(ValueError, match="initial_load_in_hf_quantized is True"):
        UnickptCheckpointManager.Config(
            initial_load_path="/hf", initial_load_in_hf=True, initial_load_in_hf_quantized=True
        )
    with pytest.raises(ValueError, match="the model has no state dict adapter"):
        UnickptCheckpointManager(
            UnickptCheckpointManager.Config(enable=True, last_save_in_hf=True),
            dataloader=None,
            model_parts=[torch.nn.Linear(2, 2)],
            optimizers=None,
            lr_schedulers=None,
            states={},
            sd_adapter=None,
        )
    # a remote Hugging Face model is a URL unickpt.load reads, not a path to refuse
    remote = UnickptCheckpointManager.Config(initial_load_path="s3://b/hf", initial_load_in_hf=True)
    assert remote.initial_load_in_hf
    with pytest.raises(ValueError, match="async_mode is 'sometimes'"):
        UnickptCheckpointManager.Config(async_mode="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="keep_latest_k"):  # torchtitan's own checks still apply
        UnickptCheckpointManager.Config(keep_latest_k=-1)


def test_config_from_config_keeps_every_setting_of_the_registry_config(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from unickpt.integrations.torchtitan import UnickptCheckpointManager

    registry = llama3_debugmodel().checkpoint  # interval=10, last_save_model_only=False
    ours = UnickptCheckpointManager.Config.from_config(registry, enable=True, async_mode="async")
    assert isinstance(ours, UnickptCheckpointManager.Config)
    assert (ours.enable, ours.async_mode) == (True, "async")
    assert (ours.interval, ours.last_save_model_only) == (10, False)
    kept = {"enable", "async_mode"}
    for field in dataclasses.fields(registry):
        if field.init and field.name not in kept:
            assert getattr(ours, field.name) == getattr(registry, field.name), field.name

    @dataclass(kw_only=True, slots=True)
    class Other(CheckpointManager.Config):  # another manager's, with a setting ours lacks
        staging_gb: int = 0

    with caplog.at_level(logging.WARNING, logger="unickpt.integrations.torchtitan"):
        other = UnickptCheckpointManager.Config.from_config(Other(interval=7, staging_gb=4))
    assert other.interval == 7
    ours_only = [r for r in caplog.records if r.name == "unickpt.integrations.torchtitan"]
    assert [r.getMessage() for r in ours_only] == [
        "UnickptCheckpointManager ignores these settings of "
        "test_config_from_config_keeps_every_setting_of_the_registry_config.<locals>.Other: "
        "staging_gb=4"
    ]
    with pytest.raises(TypeError, match="has no field intervall; expected some of"):
        UnickptCheckpointManager.Config.from_config(registry, intervall=5)


def _initial_load_found_by_one_rank(rank: int, world: int, folder: str) -> str:
    from tests.integrations import titan_job as tj

    os.environ["UNICKPT_COLLECTIVE_TIMEOUT_S"] = "20"  # a rank left waiting gives up soon
    here = Path(folder, f"init-{rank}")
    if rank == 1:
        here.mkdir(parents=True, exist_ok=True)  # rank 1 finds a folder, rank 0 none
    job = tj.build(world, 1, folder, 6, load_only=True, initial_load_path=str(here))
    try:
        job.manager.load()
        return "loaded"
    except CheckpointError as e:
        return str(e)
    finally:
        job.manager.close()


def test_the_initial_load_path_is_looked_at_once_for_every_rank(tmp_path: Path) -> None:
    """The ranks see different things at ``initial_load_path``: the first rank's finding
    holds for every rank (all raise together; none goes into the load alone)."""
    results = run_ranks(2, _initial_load_found_by_one_rank, str(tmp_path))
    assert results[0] == results[1]
    assert results[0].startswith(
        "looking at checkpoint.initial_load_path failed on 1 of 2 ranks:\n  rank 0: "
        f"CheckpointNotFoundError: checkpoint.initial_load_path {tmp_path}/init-0 is not a "
        "folder"
    ), results[0]
