"""Hugging Face Trainer through unickpt: a tiny GPT-2 from a config (no downloads), stopped at
step 4, resumed, exported with save_pretrained; one CPU process, seconds.

    pip install -e ".[huggingface]" && HF_HUB_OFFLINE=1 python examples/huggingface_resume.py
"""

from __future__ import annotations

import os
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

from unickpt.integrations.huggingface import UnickptTrainer


class StopAt(TrainerCallback):
    def __init__(self, step: int | None) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if self.step is not None and state.global_step >= self.step:
            control.should_training_stop = True
        return control


def trainer(out: str, stop_at: int | None = None) -> UnickptTrainer:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=256, n_positions=32)
    )
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": t, "labels": t} for t in torch.randint(0, 256, (64, 32), generator=g)]
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=4,
        max_steps=8,
        save_steps=4,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        logging_steps=100,
    )
    return UnickptTrainer(model=model, args=args, train_dataset=data, callbacks=[StopAt(stop_at)])


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as root:
        reference = trainer(f"{root}/reference")
        reference.train()
        trainer(f"{root}/run", stop_at=4).train()
        resumed = trainer(f"{root}/run")
        resumed.train(resume_from_checkpoint=True)  # from checkpoint-4/unickpt
        resumed.save_model(f"{root}/final")  # save_pretrained: config.json + model.safetensors
        same = all(
            torch.equal(a, b)
            for a, b in zip(reference.model.parameters(), resumed.model.parameters())
        )
        print(f"checkpoint-4 holds {sorted(os.listdir(f'{root}/run/checkpoint-4'))}")
        print(f"resumed run matches the uninterrupted one: {same}")
        print(f"exported: {sorted(os.listdir(f'{root}/final'))}")


if __name__ == "__main__":
    main()
