"""UnickptTrainer: a tiny GPT-2 (from a config, no downloads) under DDP on 2 CPU processes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers", reason="needs transformers: pip install 'unickpt[huggingface]'")
pytest.importorskip("accelerate", reason="needs accelerate: pip install 'unickpt[huggingface]'")

from tests.distributed import run_ranks

pytestmark = pytest.mark.slow


def _trainer(out: str, stop_at: int | None = None) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

    from unickpt.integrations.huggingface import UnickptTrainer

    class StopAt(TrainerCallback):  # an interruption: the job ends after this step's save
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            if stop_at is not None and state.global_step >= stop_at:
                control.should_training_stop = True
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
        save_total_limit=2,
        learning_rate=1e-3,
        use_cpu=True,
        seed=0,
        report_to=[],
        logging_steps=100,
        disable_tqdm=True,
    )
    return UnickptTrainer(
        model=model, args=args, train_dataset=data, callbacks=[StopAt()], unickpt_async=True
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


def test_ddp_train_stop_resume_and_export(tmp_path: Path) -> None:
    out = run_ranks(2, _train_stop_resume, str(tmp_path))
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
