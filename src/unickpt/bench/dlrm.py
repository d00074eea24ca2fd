"""A DLRM-like recommendation job: bytes per checkpoint, quantization's effect, the tuner's choice.

The model: ``tables`` embedding tables of ``rows`` x ``dim`` (plain SGD on sparse gradients, as
DLRM trains them), a bottom MLP over 13 dense features and a top MLP over the concatenated
embeddings. Ids are drawn from a Zipf distribution (``zipf``) over each table's rows, hot rows
scattered by a fixed permutation; labels come from a fixed random teacher.

1. Train ``warm_steps`` steps, then ``saves`` times: train ``steps_between`` steps and save the
   state with one Checkpointer per variant (full; the tables quantized per row at 8 and 4 bits;
   incremental with changed rows only, alone and with 8 or 4 bits). Bytes per checkpoint: the
   mean over the saves after the first (the first incremental save in a fresh root is full);
   quantization's error: the save reports' largest.
2. From each variant's last checkpoint (an incremental one refers to the earlier ones), restore
   a fresh model, train ``more_steps`` more steps on the same batches and compare the held-out
   loss with the one restored from the full checkpoint.
3. For the full and the incremental 8-bit variants, train with ``Checkpointer(every="auto",
   max_overhead=...)`` and ``maybe_save`` every step, until ``tuner_saves`` saves or
   ``tuner_steps`` steps: the interval the tuner chose and why.

    unickpt bench --workload dlrm --tables 4 --rows 500000 --dim 64
"""

from __future__ import annotations

import math
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..checkpointer import Checkpointer

DENSE = 13


@dataclass(frozen=True)
class DlrmConfig:
    tables: int = 4
    rows: int = 500_000
    dim: int = 64
    batch: int = 2048
    zipf: float = 1.05
    lr: float = 0.05
    warm_steps: int = 100
    saves: int = 4
    steps_between: int = 10
    more_steps: int = 50
    eval_batches: int = 8
    tuner_steps: int = 2000
    tuner_saves: int = 4
    max_overhead: float = 0.01
    mtbf_s: float | None = None
    seed: int = 0


class Dlrm(torch.nn.Module):
    def __init__(self, cfg: DlrmConfig) -> None:
        super().__init__()
        self.emb = torch.nn.ModuleList(
            torch.nn.Embedding(cfg.rows, cfg.dim, sparse=True) for _ in range(cfg.tables)
        )
        for table in self.emb:
            assert isinstance(table, torch.nn.Embedding)
            torch.nn.init.uniform_(table.weight, -0.05, 0.05)
        self.bottom = torch.nn.Sequential(
            torch.nn.Linear(DENSE, 64), torch.nn.ReLU(), torch.nn.Linear(64, cfg.dim)
        )
        self.top = torch.nn.Sequential(
            torch.nn.Linear((cfg.tables + 1) * cfg.dim, 128),
            torch.nn.ReLU(),
            torch.nn.Linear(128, 1),
        )

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        parts = [self.bottom(dense)] + [t(ids[:, i]) for i, t in enumerate(self.emb)]
        return self.top(torch.cat(parts, dim=1)).squeeze(1)


class Data:
    """Batch ``n`` is the same whenever it is asked for: Zipf ids, dense features, labels."""

    def __init__(self, cfg: DlrmConfig) -> None:
        self.cfg = cfg
        g = torch.Generator().manual_seed(cfg.seed + 1)
        weights = torch.arange(1, cfg.rows + 1, dtype=torch.float64).pow(-cfg.zipf)
        self.cdf = (weights.cumsum(0) / weights.sum()).float()
        self.perms = [torch.randperm(cfg.rows, generator=g) for _ in range(cfg.tables)]
        self.teacher = [torch.randn(cfg.rows, generator=g) for _ in range(cfg.tables)]
        self.dense_teacher = torch.randn(DENSE, generator=g)

    def batch(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + n)
        ranks = torch.searchsorted(self.cdf, torch.rand(cfg.batch, cfg.tables, generator=g))
        ranks = ranks.clamp_(max=cfg.rows - 1)
        ids = torch.stack([self.perms[t][ranks[:, t]] for t in range(cfg.tables)], dim=1)
        dense = torch.randn(cfg.batch, DENSE, generator=g)
        score = dense @ self.dense_teacher / math.sqrt(DENSE)
        for t in range(cfg.tables):
            score += self.teacher[t][ids[:, t]]
        noise = 0.5 * torch.randn(cfg.batch, generator=g)
        return dense, ids, (score + noise > 0).float()


def train(model: Dlrm, opt: torch.optim.Optimizer, data: Data, steps: range) -> float:
    """Train on batches ``steps``; the last batch's loss."""
    loss = torch.zeros(())
    for n in steps:
        dense, ids, labels = data.batch(n)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, ids), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item()


@torch.no_grad()
def held_out_loss(model: Dlrm, data: Data) -> float:
    losses = []
    for n in range(data.cfg.eval_batches):
        dense, ids, labels = data.batch(-1 - n)
        logits = model(dense, ids)
        losses.append(float(torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)))
    return sum(losses) / len(losses)


def table_keys(cfg: DlrmConfig) -> list[str]:
    return [f"model.emb.{t}.weight" for t in range(cfg.tables)]


def variants(cfg: DlrmConfig) -> dict[str, dict[str, Any]]:
    """Ways of saving the same state: the keyword arguments of each variant's Checkpointer."""
    rows = {"incremental": True, "row_deltas": ["model.emb.*.weight"]}
    return {
        "full": {},
        "8-bit": {"quantize": dict.fromkeys(table_keys(cfg), 8)},
        "4-bit": {"quantize": dict.fromkeys(table_keys(cfg), 4)},
        "incremental": rows,
        "incremental + 8-bit": {**rows, "quantize": dict.fromkeys(table_keys(cfg), 8)},
        "incremental + 4-bit": {**rows, "quantize": dict.fromkeys(table_keys(cfg), 4)},
    }


def _fresh(cfg: DlrmConfig) -> tuple[Dlrm, torch.optim.Optimizer]:
    torch.manual_seed(cfg.seed)
    model = Dlrm(cfg)
    return model, torch.optim.SGD(model.parameters(), lr=cfg.lr)


def folder_bytes(folder: Path) -> int:
    """Every file a save wrote: data, indexes, metadata, commit marker."""
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def measure_checkpoints(cfg: DlrmConfig, batches: Data, work: Path) -> dict[str, Any]:
    """Parts 1 and 2: bytes per checkpoint and error per variant, then the loss after more
    steps from each variant's last checkpoint."""
    model, opt = _fresh(cfg)
    train(model, opt, batches, range(cfg.warm_steps))
    state = {"model": model, "optimizer": opt}
    kinds = variants(cfg)
    ckpts = {
        name: Checkpointer(work / f"v{i}", mode="sync", keep_last=1, **kwargs)
        for i, (name, kwargs) in enumerate(kinds.items())
    }
    written: dict[str, list[int]] = {name: [] for name in kinds}
    data: dict[str, list[int]] = {name: [] for name in kinds}
    seconds: dict[str, list[float]] = {name: [] for name in kinds}
    errors: dict[str, list[Any]] = {name: [] for name in kinds}
    step = cfg.warm_steps
    try:
        for _ in range(cfg.saves):
            train(model, opt, batches, range(step, step + cfg.steps_between))
            step += cfg.steps_between
            for name, ckpt in ckpts.items():
                t0 = time.perf_counter()
                report = ckpt.save(step, state).wait()
                seconds[name].append(time.perf_counter() - t0)
                assert report is not None
                data[name].append(report.bytes_written)
                written[name].append(folder_bytes(Path(ckpt.path(step))))
                errors[name].extend(report.encoding_errors.values())
        out: dict[str, Any] = {"warm_loss": held_out_loss(model, batches), "variants": {}}
        more = range(step, step + cfg.more_steps)
        for name, ckpt in ckpts.items():
            restored, restored_opt = _fresh(cfg)
            ckpt.load_latest({"model": restored, "optimizer": restored_opt})
            train(restored, restored_opt, batches, more)
            later = written[name][1:] or written[name]
            later_data = data[name][1:] or data[name]
            out["variants"][name] = {
                "first_save_bytes": written[name][0],
                "bytes_per_checkpoint": sum(later) / len(later),
                "data_bytes_per_checkpoint": sum(later_data) / len(later_data),
                "save_s": sum(seconds[name][1:] or seconds[name]) / len(later),
                "max_abs_error": max((e.max_abs for e in errors[name]), default=0.0),
                "rms_relative_error": max((e.rms_relative for e in errors[name]), default=0.0),
                "loss_after_more_steps": held_out_loss(restored, batches),
            }
    finally:
        for ckpt in ckpts.values():
            ckpt.close()
    full = out["variants"]["full"]
    for v in out["variants"].values():
        v["bytes_vs_full"] = full["bytes_per_checkpoint"] / v["bytes_per_checkpoint"]
        v["loss_vs_full"] = v["loss_after_more_steps"] / full["loss_after_more_steps"] - 1.0
    return out


TUNED = ("full", "incremental + 8-bit")


def tuner_jobs(cfg: DlrmConfig, data: Data, roots: dict[str, Path]) -> list[dict[str, Any]]:
    """Part 3: the interval the tuner chooses for the full and incremental 8-bit saves."""
    model, opt = _fresh(cfg)
    state = {"model": model, "optimizer": opt}
    jobs: list[dict[str, Any]] = []
    step = 0
    kinds = variants(cfg)
    for root_name, root in roots.items():
        for name in TUNED:
            folder = root / f"tuned-{len(jobs)}"
            with Checkpointer(
                folder,
                keep_last=1,
                every="auto",
                max_overhead=cfg.max_overhead,
                mtbf_s=cfg.mtbf_s,
                **kinds[name],
            ) as ckpt:
                saves = 0
                for _ in range(cfg.tuner_steps):
                    train(model, opt, data, range(step, step + 1))
                    saves += ckpt.maybe_save(step, state) is not None
                    step += 1
                    if saves > cfg.tuner_saves:
                        break
                ckpt.wait()
                tuning = ckpt.tuning
            shutil.rmtree(folder, ignore_errors=True)
            assert tuning is not None
            jobs.append(
                {
                    "root": root_name,
                    "variant": name,
                    "saves": tuning.saves,
                    "every": tuning.every,
                    "step_s": tuning.step_s,
                    "save_cost_s": tuning.save_cost_s,
                    "overhead": tuning.overhead,
                    "reason": tuning.reason,
                    "decisions": [(d.step, d.every) for d in tuning.decisions],
                }
            )
    return jobs


def render(cfg: DlrmConfig, result: dict[str, Any]) -> str:
    """The results as markdown tables."""
    lines = [
        f"DLRM-like: {cfg.tables} tables x {cfg.rows} rows x {cfg.dim}, batch {cfg.batch}, "
        f"Zipf {cfg.zipf}; {cfg.saves} saves {cfg.steps_between} steps apart after "
        f"{cfg.warm_steps} steps (held-out loss then {result['warm_loss']:.4f})",
        "",
        "| save | first save | bytes per checkpoint | of which data | vs full | max abs error | "
        f"RMS rel. error | loss after {cfg.more_steps} more steps | vs full |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, v in result["variants"].items():
        lines.append(
            f"| {name} | {_mb(v['first_save_bytes'])} | {_mb(v['bytes_per_checkpoint'])} | "
            f"{_mb(v['data_bytes_per_checkpoint'])} | "
            f"{v['bytes_vs_full']:.2f}x | {v['max_abs_error']:.2e} | "
            f"{v['rms_relative_error']:.3%} | {v['loss_after_more_steps']:.5f} | "
            f"{v['loss_vs_full']:+.3%} |"
        )
    if result.get("tuner"):
        lines += [
            "",
            f"| root | save | saves | chosen every | step | save cost | overhead "
            f"(bound {cfg.max_overhead:.1%}) |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for j in result["tuner"]:
            overhead = "-" if j["overhead"] is None else f"{j['overhead']:.2%}"
            cost = "-" if j["save_cost_s"] is None else f"{j['save_cost_s']:.3f} s"
            step = "-" if j["step_s"] is None else f"{j['step_s'] * 1e3:.1f} ms"
            lines.append(
                f"| {j['root']} | {j['variant']} | {j['saves']} | {j['every']} steps | "
                f"{step} | {cost} | {overhead} |"
            )
    return "\n".join(lines)


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def run_dlrm(cfg: DlrmConfig, workdir: Path | None = None, shm: bool = True) -> dict[str, Any]:
    """Every part; checkpoints go to a temporary folder under ``workdir`` (removed after)."""
    if workdir is not None:
        workdir.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="unickpt-dlrm-", dir=workdir))
    shm_base = (
        Path(tempfile.mkdtemp(prefix="unickpt-dlrm-", dir="/dev/shm"))
        if shm and cfg.tuner_steps and Path("/dev/shm").is_dir()
        else None
    )
    try:
        data = Data(cfg)
        result = measure_checkpoints(cfg, data, base)
        roots = {"disk": base} | ({"/dev/shm": shm_base} if shm_base else {})
        result["tuner"] = tuner_jobs(cfg, data, roots) if cfg.tuner_steps else []
        result["config"] = asdict(cfg)
        return result
    finally:
        shutil.rmtree(base, ignore_errors=True)
        if shm_base is not None:
            shutil.rmtree(shm_base, ignore_errors=True)


__all__ = ["DlrmConfig", "render", "run_dlrm"]
