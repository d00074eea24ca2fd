"""Bytes written per checkpoint with ``incremental=True``, against full checkpoints.

Three fine-tunes of the demo GPT, each saved every few optimizer steps by a Checkpointer with
``incremental=True`` and by one without:

- ``lora``: the whole model frozen, rank-8 adapters on every attention and MLP input layer;
- ``frozen-half``: the embeddings and the first half of the blocks frozen, the rest trained;
- ``full``: every parameter trained (incremental saves then write everything, plus hashing).

and an embedding workload (``--tables``): a few large tables trained with sparse Adagrad on
Zipf-distributed ids, saved with ``row_deltas`` (changed rows only) against full checkpoints.

It also times the two ways to find unchanged chunks on this machine: hashing the chunk bytes
(xxh3 per segment, what unickpt does; the digests double as the checksums written) and
comparing them with a copy kept from the previous save (``torch.equal``, one more copy of the
state in memory). Bytes are exact; times depend on the machine and its load.

    python benchmarks/incremental_bytes.py --d-model 512 --layers 8 --saves 4
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import unickpt
from unickpt.config import get_config
from unickpt.demo.lora import add_lora
from unickpt.demo.model import GPT, GPTConfig
from unickpt.engine.checksum import hash_items
from unickpt.engine.sources import ItemSource


def build(kind: str, d_model: int, layers: int) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=256, context_len=64, n_layers=layers, n_heads=8, d_model=d_model)
    model = GPT(config)
    if kind == "lora":
        add_lora(model, 8)
    elif kind == "frozen-half":
        for m in (model.tok_emb, model.pos_emb, *model.blocks[: layers // 2]):
            m.requires_grad_(False)
    return model


def run(kind: str, incremental: bool, args: argparse.Namespace, root: Path) -> list[int]:
    model = build(kind, args.d_model, args.layers)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    written = []
    with unickpt.Checkpointer(root, incremental=incremental, mode="sync") as ckpt:
        for save in range(args.saves):
            for _ in range(args.steps_between):
                idx = torch.randint(0, 256, (4, 65), generator=gen)
                model(idx[:, :-1], idx[:, 1:]).backward()
                opt.step()
                opt.zero_grad()
            report = ckpt.save(save, {"model": model, "optim": opt}).wait()
            assert report is not None
            written.append(report.bytes_written)
    adapters = sum(p.numel() * p.element_size() for p in trained)
    state = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())
    if incremental:
        print(
            f"  trained parameters {adapters / 1e6:.2f} MB + their optimizer state "
            f"{state / 1e6:.2f} MB = {(adapters + state) / 1e6:.2f} MB"
        )
    return written


def time_detection(args: argparse.Namespace) -> None:
    model = build("full", args.d_model, args.layers)
    tensors = [t.detach().contiguous() for t in model.state_dict().values()]
    nbytes = sum(t.nbytes for t in tensors)
    cfg = get_config()
    sources = [ItemSource(t) for t in tensors]
    t0 = time.perf_counter()
    hash_items(sources, [t.nbytes for t in tensors], cfg.segment_bytes, cfg.io_threads)
    hashing = time.perf_counter() - t0
    kept = [t.clone() for t in tensors]
    t0 = time.perf_counter()
    all(torch.equal(a, b) for a, b in zip(tensors, kept))
    comparing = time.perf_counter() - t0
    print(
        f"detecting unchanged chunks in {nbytes / 1e6:.0f} MB: hashing {hashing * 1e3:.0f} ms "
        f"({cfg.io_threads} threads, no extra memory), comparing with a kept copy "
        f"{comparing * 1e3:.0f} ms (+{nbytes / 1e6:.0f} MB held)"
    )


def zipf_ids(gen: torch.Generator, rows: int, n: int, alpha: float) -> torch.Tensor:
    weights = 1.0 / torch.arange(1, rows + 1, dtype=torch.float64) ** alpha
    ids = torch.multinomial(weights, n, replacement=True, generator=gen)
    return (ids * 1_000_003) % rows  # hot ids spread over the table


def folder_bytes(folder: str) -> tuple[int, int]:
    """(data bytes, metadata and index bytes) of a checkpoint folder."""
    files = [p for p in Path(folder).iterdir() if p.name != "LOCK"]
    data = sum(p.stat().st_size for p in files if p.name.startswith("data-"))
    return data, sum(p.stat().st_size for p in files) - data


def embedding_case(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    tables = nn.ModuleList(
        nn.Embedding(args.rows, args.dim, sparse=True) for _ in range(args.tables)
    )
    opt = torch.optim.Adagrad(tables.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1)
    state = {"tables": tables, "optim": opt}
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, options in (("full", {}), ("rows", {"row_deltas": ["*"]})):
            incremental = bool(options)
            ckpt = unickpt.Checkpointer(
                Path(tmp) / name, incremental=incremental, mode="sync", **options
            )
            sizes = []
            for save in range(args.saves):
                for _ in range(args.steps_between):
                    for table in tables:
                        ids = zipf_ids(gen, args.rows, args.batch, args.alpha)
                        table(ids).sum().backward()
                    opt.step()
                    opt.zero_grad()
                ckpt.save(save, state)
                sizes.append(folder_bytes(ckpt.path(save)))
            ckpt.close()
            out[name] = sizes
    full = out["full"][-1]
    later = [d + m for d, m in out["rows"][1:]]
    data = max(d for d, _ in out["rows"][1:])
    print(
        f"embeddings: {args.tables} tables of {args.rows} x {args.dim} float32, Adagrad, "
        f"{args.steps_between} steps of {args.batch} Zipf({args.alpha}) ids per table between "
        f"saves: full checkpoint {sum(full) / 1e6:.1f} MB; changed rows only "
        f"{max(later) / 1e6:.2f} MB at most ({data / 1e6:.2f} MB data), "
        f"{sum(full) / max(later):.1f}x smaller"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--steps-between", type=int, default=2)
    parser.add_argument("--tables", type=int, default=0, help="embedding case: tables (0: skip)")
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--alpha", type=float, default=1.05)
    args = parser.parse_args()
    if args.tables:
        embedding_case(args)
        return
    rows = [
        "| fine-tune | full checkpoint (MB) | incremental: first save, then each (MB) | ratio |"
    ]
    rows.append("| --- | --- | --- | --- |")
    for kind in ("lora", "frozen-half", "full"):
        with tempfile.TemporaryDirectory() as tmp:
            print(f"{kind}:")
            full = run(kind, False, args, Path(tmp) / "full")
            incr = run(kind, True, args, Path(tmp) / "incr")
        later = max(incr[1:])
        rows.append(
            f"| {kind} | {full[-1] / 1e6:.2f} | {incr[0] / 1e6:.2f}, then "
            f"{later / 1e6:.3f} | {full[-1] / later:.1f}x |"
        )
    print("\n".join(rows))
    time_detection(args)


if __name__ == "__main__":
    main()
