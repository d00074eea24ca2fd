"""Lightning through unickpt: fit, stop, resume from last.ckpt; one CPU process, seconds.

pip install -e ".[lightning]" && python examples/lightning_resume.py
"""

from __future__ import annotations

import tempfile

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from unickpt.integrations.lightning import UnickptCheckpointIO


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
        )

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def fit(folder: str, epochs: int, resume: str | None = None) -> Regression:
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8
    )
    model = Regression()
    trainer = L.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        plugins=[UnickptCheckpointIO(async_save=True)],  # the one-line switch
        callbacks=[ModelCheckpoint(dirpath=folder, save_last=True)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, data, ckpt_path=resume)
    return model


def main() -> None:
    with tempfile.TemporaryDirectory() as root:
        reference = fit(f"{root}/reference", 4)
        fit(f"{root}/run", 2)  # the job stops after 2 epochs
        resumed = fit(f"{root}/run", 4, resume=f"{root}/run/last.ckpt")
        same = all(torch.equal(a, b) for a, b in zip(reference.parameters(), resumed.parameters()))
        print(f"resumed from a unickpt checkpoint; matches the uninterrupted run: {same}")


if __name__ == "__main__":
    main()
