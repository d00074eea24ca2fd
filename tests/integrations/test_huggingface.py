"""UnickptTrainer: a tiny GPT-2 (from a config, no downloads) under DDP on 2 CPU processes."""

from __future__ import annotations

import logging
import os
import resource
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers", reason="needs transformers: pip install 'unickpt[huggingface]'")
pytest.importorskip("accelerate", reason="needs accelerate: pip install 'unickpt[huggingface]'")

from tests.distributed import run_ranks

pytestmark = pytest.mark.slow


FILE_LIMIT_BYTES = 16 * 1024  # above trainer_state.json, below a rank's unickpt data file


def _limit_file_size(limit: int) -> None:
    """Files of this process may not grow past ``limit`` bytes (EFBIG): a full device."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails, no signal
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))


def _trainer(
    out: str,
    stop_at: int | None = None,
    save_total_limit: int = 2,
    fail_from: int | None = None,
    arguments: dict[str, Any] | None = None,
    **unickpt: Any,
) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

    from unickpt import wait_pending
    from unickpt.integrations.huggingface import UnickptTrainer

    class StopAt(TrainerCallback):  # an interruption: the job ends after this step's save
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            if stop_at is not None and state.global_step >= stop_at:
                control.should_training_stop = True
            if fail_from is not None and state.global_step == fail_from:
                # The limit holds for the whole process: the earlier step's save, which may
                # still be writing in the background (on a loaded machine), ends first.
                wait_pending()
                _limit_file_size(FILE_LIMIT_BYTES)  # this step's save will fail to write
            return control

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=128, n_positions=16)
    model = GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(3)
    data = [{"input_ids": t, "labels": t} for t in torch.randint(0, 128, (24, 16), generator=g)]
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=2,
        max_steps=6,
        save_steps=2,
        save_total_limit=save_total_limit,
        learning_rate=1e-3,
        use_cpu=True,
        seed=0,
        report_to=[],
        logging_steps=100,
        disable_tqdm=True,
        **(arguments or {}),
    )
    return UnickptTrainer(
        model=model,
        args=args,
        train_dataset=data,
        callbacks=[StopAt()],
        **{"unickpt_async": True, **unickpt},
    )


def _train_stop_resume(rank: int, world: int, root: str) -> dict[str, Any]:
    os.environ.update(LOCAL_RANK=str(rank), HF_HUB_OFFLINE="1")
    from transformers import GPT2LMHeadModel

    reference = _trainer(f"{root}/reference")
    reference.train()
    _trainer(f"{root}/run", stop_at=4).train()
    stopped = sorted(os.listdir(f"{root}/run"))
    resumed = _trainer(f"{root}/run")
    resumed.train(resume_from_checkpoint=True)
    same = [
        torch.equal(a, b)
        for a, b in zip(reference.model.parameters(), resumed.model.parameters(), strict=True)
    ]
    resumed.save_model(f"{root}/final")  # written by rank 0
    torch.distributed.barrier()
    exported = GPT2LMHeadModel.from_pretrained(f"{root}/final")
    exported_same = all(
        torch.equal(a, b)
        for a, b in zip(exported.state_dict().values(), resumed.model.state_dict().values())
    )
    return {
        "stopped": stopped,
        "final": sorted(os.listdir(f"{root}/run")),
        "step": resumed.state.global_step,
        "same": same,
        "exported_same": exported_same,
    }


def test_ddp_train_stop_resume_and_export(runs: Runs) -> None:
    tmp_path, out = runs["resume"]
    for r in out:
        assert r["stopped"] == ["checkpoint-2", "checkpoint-4"]
        assert r["final"] == ["checkpoint-4", "checkpoint-6"]  # save_total_limit=2
        assert r["step"] == 6
        assert all(r["same"])  # the resumed run ends bit for bit where the reference does
        assert r["exported_same"]
    ckpt = tmp_path / "run" / "checkpoint-6"
    assert sorted(p.name for p in ckpt.iterdir()) == ["trainer_state.json", "unickpt"]
    assert (ckpt / "unickpt" / "COMMIT").is_file()
    final = {p.name for p in (tmp_path / "final").iterdir()}
    assert {"config.json", "model.safetensors"} <= final


def _committed(folder: str) -> list[str]:
    return sorted(
        name
        for name in os.listdir(folder)
        if os.path.isfile(os.path.join(folder, name, "unickpt", "COMMIT"))
    )


def _fail_save_of_step_4(rank: int, world: int, root: str) -> dict[str, Any]:
    """save_total_limit=1, asynchronous saves: the save of step 4 fails in the background."""
    os.environ.update(LOCAL_RANK=str(rank), HF_HUB_OFFLINE="1")
    trainer = _trainer(f"{root}/run", save_total_limit=1, fail_from=4)
    try:
        trainer.train()
        error = ""
    except Exception as e:  # noqa: BLE001 - the failure is the result
        error = f"{type(e).__name__}: {e}"
    return {"error": error, "left": sorted(os.listdir(f"{root}/run"))}


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _resume_after_failure(rank: int, world: int, root: str) -> dict[str, Any]:
    os.environ.update(LOCAL_RANK=str(rank), HF_HUB_OFFLINE="1")
    reference = _trainer(f"{root}/reference", save_total_limit=1)
    reference.train()
    records = _Records()
    logging.getLogger("unickpt.integrations.huggingface").addHandler(records)
    resumed = _trainer(f"{root}/run", save_total_limit=1)
    resumed.train(resume_from_checkpoint=True)
    same = [
        torch.equal(a, b)
        for a, b in zip(reference.model.parameters(), resumed.model.parameters(), strict=True)
    ]
    return {
        "same": same,
        "step": resumed.state.global_step,
        "left": _committed(f"{root}/run"),
        "warnings": records.messages,
    }


def test_save_total_limit_keeps_the_committed_checkpoint_when_an_async_save_fails(
    runs: Runs,
) -> None:
    tmp_path, failed = runs["failure"]
    for r in failed:
        assert "File too large" in r["error"]  # the failed save surfaces at the next save
        assert r["left"] == ["checkpoint-2", "checkpoint-4"]
    # the Trainer's rotation did not delete checkpoint-2 for a checkpoint-4 never committed
    assert _committed(str(tmp_path / "run")) == ["checkpoint-2"]

    resumed = run_ranks(2, _resume_after_failure, str(tmp_path))
    for r in resumed:
        assert r["warnings"] == [
            f"not resuming from {tmp_path}/run/checkpoint-4: its unickpt checkpoint was never "
            "committed (no unickpt/COMMIT); trying an older checkpoint"
        ]
        assert r["step"] == 6
        assert all(r["same"])  # resumed from checkpoint-2, ends bit for bit with the reference
        assert r["left"] == ["checkpoint-6"]  # rotated once step 6 was committed
    assert sorted(os.listdir(tmp_path / "reference")) == ["checkpoint-6"]


def _save_model_from_every_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    os.environ.update(LOCAL_RANK=str(rank), HF_HUB_OFFLINE="1")
    from safetensors import safe_open
    from transformers import GPT2LMHeadModel

    from unickpt.integrations.huggingface import save_pretrained

    trainer = _trainer(f"{root}/run", unickpt_save_model=True)
    trainer.train()
    trainer.save_model(f"{root}/final")  # every rank writes its share: no gather
    report = save_pretrained(trainer, f"{root}/again", max_shard_size=20_000)
    model = trainer.model.module if hasattr(trainer.model, "module") else trainer.model
    out: dict[str, Any] = {"bytes_written": report.bytes_written}
    if rank == 0:
        model.save_pretrained(f"{root}/reference")  # what the Trainer's save_model writes
        model.eval()
        inputs = torch.randint(0, 128, (3, 16), generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            logits = model(inputs).logits
        for name in ("final", "again"):
            loaded = GPT2LMHeadModel.from_pretrained(f"{root}/{name}").eval()
            with torch.no_grad():
                out[f"{name}_equal"] = torch.equal(loaded(inputs).logits, logits)
        with (
            safe_open(f"{root}/final/model.safetensors", "pt") as ours,
            safe_open(f"{root}/reference/model.safetensors", "pt") as ref,
        ):
            names = sorted(ref.keys())
            out["keys"] = (sorted(ours.keys()), names)
            out["unequal"] = [
                k for k in names if not torch.equal(ours.get_tensor(k), ref.get_tensor(k))
            ]
    return out


def test_save_model_writes_safetensors_from_every_ddp_rank(runs: Runs) -> None:
    tmp_path, out = runs["save_model"]
    first = out[0]
    assert first["final_equal"] and first["again_equal"]  # from_pretrained: the same logits
    ours, reference = first["keys"]
    assert ours == reference  # the keys save_pretrained writes (lm_head tied: left out)
    assert "lm_head.weight" not in ours
    assert first["unequal"] == []
    assert all(r["bytes_written"] > 0 for r in out)  # both ranks wrote their share
    final = sorted(p.name for p in (tmp_path / "final").iterdir())
    assert final == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "training_args.bin",
    ]
    again = {p.name for p in (tmp_path / "again").iterdir()}
    assert "model.safetensors.index.json" in again  # shards of about 20 kB
    assert "model-00001-of-" in " ".join(sorted(again))


def _best_model_at_end(rank: int, world: int, root: str) -> dict[str, Any]:
    """``load_best_model_at_end`` with ``save_total_limit=1``: evaluations at steps 2, 4 and 6
    score 1, 3 and 2, so the Trainer's end loads checkpoint-4 and removes checkpoint-6 (whose
    asynchronous save is still writing unless the integration waits for it)."""
    os.environ.update(LOCAL_RANK=str(rank), HF_HUB_OFFLINE="1")
    from transformers import GPT2LMHeadModel, TrainerCallback

    import unickpt

    class KeepLast(TrainerCallback):
        weights: dict[str, torch.Tensor] = {}

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            if state.global_step == state.max_steps:
                model = kwargs["model"]
                KeepLast.weights = {k: v.clone() for k, v in model.state_dict().items()}

    scores = iter([1.0, 3.0, 2.0])
    g = torch.Generator().manual_seed(4)
    held_out = [{"input_ids": t, "labels": t} for t in torch.randint(0, 128, (4, 16), generator=g)]
    trainer = _trainer(
        f"{root}/run",
        save_total_limit=1,
        arguments={
            "eval_strategy": "steps",
            "eval_steps": 2,
            "load_best_model_at_end": True,
            "metric_for_best_model": "score",
            "greater_is_better": True,
        },
        eval_dataset=held_out,
        compute_metrics=lambda _: {"score": next(scores)},
    )
    trainer.add_callback(KeepLast())
    trainer.train()
    final = trainer.model.state_dict()
    best = GPT2LMHeadModel(trainer.model.config)
    unickpt.load(f"{root}/run/checkpoint-4/unickpt", {"model": best})
    return {
        "best": os.path.basename(trainer.state.best_model_checkpoint),
        "is_best": all(torch.equal(v, final[k]) for k, v in best.state_dict().items()),
        "is_last": all(torch.equal(v, final[k]) for k, v in KeepLast.weights.items()),
        "left": sorted(os.listdir(f"{root}/run")),
    }


def test_load_best_model_at_end_loads_the_best_unickpt_checkpoint(runs: Runs) -> None:
    _, out = runs["best"]
    for r in out:
        assert r["best"] == "checkpoint-4"
        assert r["is_best"] and not r["is_last"]  # the best checkpoint's weights, not the last
        assert r["left"] == ["checkpoint-4"]  # the Trainer's end removed checkpoint-6


def _agree_on_the_checkpoint(rank: int, world: int, root: str) -> dict[str, Any]:
    """Each rank's output folder holds other checkpoints (node-local disks): rank 0 chooses."""
    from unickpt.errors import CheckpointError
    from unickpt.integrations.huggingface import _agreed_checkpoint, _unickpt_path

    mine = f"{root}/rank{rank}"
    for step in [2, 4] if rank == 0 else [2, 6]:
        folder = f"{mine}/checkpoint-{step}"
        os.makedirs(f"{folder}/unickpt")
        with open(f"{folder}/trainer_state.json", "w") as f:
            f.write("{}")
        if step != 6:  # rank 1's newest was never committed
            with open(f"{folder}/unickpt/COMMIT", "w") as f:
                f.write("{}")
    records = _Records()
    logger = logging.getLogger("unickpt.integrations.huggingface")
    logger.addHandler(records)
    try:
        chosen = _agreed_checkpoint(mine)
    finally:
        logger.removeHandler(records)
    # which loader a checkpoint needs, and a check that fails: rank 0 answers for every rank
    plain = f"{mine}/plain-{rank}"  # rank 0's has a unickpt folder, rank 1's none
    os.makedirs(f"{plain}/unickpt" if rank == 0 else plain)
    looped = f"{mine}/looped"
    os.makedirs(looped)
    if rank == 0:
        os.symlink(f"{looped}/unickpt", f"{looped}/unickpt")  # checking it fails: ELOOP
    try:
        _unickpt_path(looped)
        failed = ""
    except CheckpointError as e:
        failed = str(e)
    return {
        "chosen": chosen,
        "warnings": records.messages,
        "plain": _unickpt_path(plain),
        "failed": failed,
    }


def test_every_rank_resumes_from_the_checkpoint_the_first_rank_chose(runs: Runs) -> None:
    tmp_path, out = runs["agree"]
    assert [r["chosen"] for r in out] == [f"{tmp_path}/rank0/checkpoint-4"] * 2
    assert [r["warnings"] for r in out] == [[], []]  # rank 1's uncommitted folder: not looked at
    # rank 1's own folder has no unickpt/, but it loads as rank 0 found: with unickpt
    assert [r["plain"] for r in out] == [f"{tmp_path}/rank{i}/plain-{i}/unickpt" for i in (0, 1)]
    looped = f"{tmp_path}/rank0/looped/unickpt"
    for rank, r in enumerate(out):
        assert r["failed"] == (
            f"looking for a unickpt checkpoint in {tmp_path}/rank{rank}/looped failed on 1 of 2 "
            f"ranks:\n  rank 0: CheckpointError: checking {looped} failed (Too many levels of "
            "symbolic links); a failed check is not taken for a missing file. Fix the file "
            "system and resume again, or name the checkpoint to resume from "
            "(resume_from_checkpoint='.../checkpoint-N')."
        )


def test_a_failed_check_is_not_taken_for_a_missing_file(tmp_path: Path) -> None:
    """A ``trainer_state.json`` that cannot be checked (here a symbolic link to itself: ELOOP)
    stops the choice; it is not skipped for an older checkpoint."""
    from unickpt.errors import CheckpointError
    from unickpt.integrations.huggingface import last_complete_checkpoint

    for step in (2, 4):
        (tmp_path / f"checkpoint-{step}" / "unickpt").mkdir(parents=True)
        (tmp_path / f"checkpoint-{step}" / "unickpt" / "COMMIT").write_text("{}")
    (tmp_path / "checkpoint-2" / "trainer_state.json").write_text("{}")
    assert last_complete_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-2")
    looped = tmp_path / "checkpoint-4" / "trainer_state.json"
    looped.symlink_to(looped)
    with pytest.raises(CheckpointError) as caught:
        last_complete_checkpoint(str(tmp_path))
    assert str(caught.value) == (
        f"checking {looped} failed (Too many levels of symbolic links); a failed check is not "
        "taken for a missing file. Fix the file system and resume again, or name the checkpoint "
        "to resume from (resume_from_checkpoint='.../checkpoint-N')."
    )
    looped.unlink()  # absent: checkpoint-4 is skipped (with a warning) for checkpoint-2
    assert last_complete_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-2")


# The first jobs of the tests above, one after the other in the same 2 ranks, each in its
# folder: starting ranks that import transformers took much of a job's time. The job whose save
# fails comes last, as its file size limit stays on its processes; resuming after it is a new
# job, in new processes.
JOBS = {
    "resume": _train_stop_resume,
    "save_model": _save_model_from_every_rank,
    "agree": _agree_on_the_checkpoint,
    "best": _best_model_at_end,
    "failure": _fail_save_of_step_4,
}
Runs = dict[str, tuple[Path, list[dict[str, Any]]]]


def _every_job(rank: int, world: int, root: str) -> dict[str, dict[str, Any]]:
    return {name: job(rank, world, f"{root}/{name}") for name, job in JOBS.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """Each job's folder and its ranks' results."""
    root = tmp_path_factory.mktemp("huggingface")
    out = run_ranks(2, _every_job, str(root), timeout_s=900)
    return {name: (root / name, [r[name] for r in out]) for name in JOBS}
