"""``unickpt bench``: measure checkpoint save and load against DCP, torch.save and peers.

Run it::

    unickpt bench                          # ~100M parameters, 2 ranks, every system, 3 runs each
    unickpt bench --params 20M --world 2 --systems unickpt,dcp --repeats 3
    unickpt bench --device cuda            # on a GPU host: CUDA tensors, pinned staging
    unickpt bench --storage s3://bucket/bench --mib 1024   # S3 throughput (see --storage)
    unickpt bench --workload dlrm --tables 4 --rows 500000   # embedding tables, row deltas
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
from pathlib import Path

from unickpt.bench import (
    BenchConfig,
    parse_param_count,
    parse_systems,
    run_bench,
    to_markdown,
    write_outputs,
)
from unickpt.bench.config import DEVICES
from unickpt.bench.dlrm import DlrmConfig, render, run_dlrm
from unickpt.bench.report import replace_results
from unickpt.bench.results import STATUS_SKIPPED
from unickpt.bench.systems.registry import SYSTEM_INFOS
from unickpt.cli.commands import add_command
from unickpt.errors import CheckpointError

_DEFAULT_PEERS_PYTHON = Path(".venv-peers/bin/python")
_PEERS_ENV = "UNICKPT_BENCH_PEERS_PYTHON"

_DESCRIPTION = """\
Build a GPT-style transformer with AdamW, shard it with FSDP2 over --world processes (gloo on
CPU; --device cuda: one GPU per rank), and checkpoint it with each system. Every system runs
--repeats times, systems alternating, each run in fresh processes; every figure is the median
of the runs, with the lowest and highest beside it.

Per run: blocking time (the save call and the wait before the state may change), stall (how
much longer the iteration with the save takes than one without), time until the checkpoint is
durable (fsync included), load time into the same layout and into another one (every matrix
Shard(1) instead of Shard(0)), each load checked by a digest of every element, bytes written
and read (/proc/<pid>/io, summed over ranks), and peak extra resident memory (summed over
ranks). The same run measures the machine's sequential write+fsync, read and memcpy speed.
Ratios are given against DCP and against the hardware. Prints a markdown table; writes
bench.json, bench.md and one bench-<measure>.png per measure.

Peer systems (bytecheckpoint, dlrover, megatron, torchsnapshot) run with the interpreter of a
separate environment: create it with benchmarks/setup_peers.sh. Without it their rows read
"not installed".

--storage s3://bucket/prefix measures object storage instead: save and load throughput of
--mib MiB of float32 matrices with unickpt, with boto3's transfer manager moving the same bytes
(the ceiling) and with DCP through fsspec/s3fs (in the peers environment, where s3fs installs),
--repeats rounds alternating after an untimed one (none with --no-warmup); then a resharded
load on --reshard-world spawned ranks, bytes read against bytes needed. The endpoint is
--endpoint, else AWS_ENDPOINT_URL; with neither, moto's server is started on loopback (and the
output says so); --endpoint aws means AWS itself.

--workload dlrm runs a DLRM-like recommendation job instead (one process): a few large
embedding tables trained with SGD on Zipf-distributed ids, saved every --steps-between steps by
a Checkpointer per way of saving (full; tables quantized per row at 8 and 4 bits; incremental
with changed rows only, alone and at 8 and 4 bits). Prints the bytes per checkpoint of each,
the error quantization made, the held-out loss after --more-steps more steps from each one's
last checkpoint against the full one, and the interval Checkpointer(every="auto") chose for the
full and the incremental 8-bit saves. Writes dlrm.json and dlrm.md."""


def _systems_epilog() -> str:
    width = max(len(info.name) for info in SYSTEM_INFOS)
    lines = [f"  {info.name:<{width}}  {info.description}" for info in SYSTEM_INFOS]
    return "systems:\n" + "\n".join(lines)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds the ``bench`` command."""
    parser = add_command(subparsers, "bench", _DESCRIPTION, epilog=_systems_epilog())
    parser.add_argument(
        "--params", default="100M", help="model size, e.g. 10M, 100M, 1B (default 100M)"
    )
    parser.add_argument("--world", type=int, default=2, help="number of ranks (default 2)")
    parser.add_argument(
        "--systems",
        default="all",
        help="comma-separated names (torch: torch-save), or all / peers (default all)",
    )
    parser.add_argument("--out", type=Path, default=Path("out/bench"), help="report folder")
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="folder for the checkpoints, on disk (default: OUT/ckpt-tmp, removed afterwards)",
    )
    parser.add_argument(
        "--peers-python",
        default=None,
        help=f"interpreter of the peers environment (default: ${_PEERS_ENV} or .venv-peers)",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs of every system, alternating (default 3)"
    )
    parser.add_argument(
        "--device",
        choices=DEVICES,
        default="cpu",
        help="where the state lives (default cpu); cuda skips every row without a GPU",
    )
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per training step")
    parser.add_argument(
        "--no-warmup", action="store_true", help="measure the first save instead of the second"
    )
    parser.add_argument(
        "--system-timeout", type=float, default=900.0, help="seconds before a run counts as hung"
    )
    parser.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds: start no run that would end past them (guessed from the longest job so "
        "far); the runs left out count as skipped (default: no budget)",
    )
    parser.add_argument(
        "--doc",
        type=Path,
        default=None,
        help="also put the table into this markdown file's results block (docs/benchmarks.md)",
    )
    s3 = parser.add_argument_group("object storage (--storage)")
    s3.add_argument("--storage", default=None, help="s3://bucket/prefix: measure S3 throughput")
    s3.add_argument("--endpoint", default=None, help="S3 endpoint URL, or aws (default: see above)")
    s3.add_argument("--mib", type=int, default=512, help="MiB to move (default 512)")
    s3.add_argument("--io-threads", type=int, default=8, help="threads of unickpt and boto3")
    s3.add_argument("--part-mib", type=int, default=16, help="upload part / read piece size")
    s3.add_argument("--reshard-world", type=int, default=3, help="ranks of the resharded load")
    parser.add_argument(
        "--workload",
        choices=("gpt", "dlrm"),
        default="gpt",
        help="gpt: the systems comparison (default); dlrm: embedding tables (see below)",
    )
    dlrm = parser.add_argument_group("--workload dlrm")
    defaults = DlrmConfig()
    for name, help_text in _DLRM_OPTIONS.items():
        value = getattr(defaults, name)
        dlrm.add_argument(
            "--" + name.replace("_", "-"),
            type=type(value),
            default=value,
            help=f"{help_text} (default {value})",
        )
    dlrm.add_argument(
        "--no-shm", action="store_true", help="no tuner jobs in /dev/shm, only on --workdir"
    )
    parser.add_argument(
        "--memory-tier",
        action="store_true",
        help="instead of the systems table: the memory tier's rows (save stall, replica on the "
        "peer beside the raw link, restore from local memory and from a peer) beside DLRover's "
        "flash checkpoint",
    )
    parser.add_argument(
        "--memory-mib", type=int, default=256, help="memory tier rows: state per rank, MiB"
    )
    parser.set_defaults(func=run)


_DLRM_OPTIONS = {
    "tables": "embedding tables",
    "rows": "rows per table",
    "dim": "columns per table",
    "batch": "samples per step",
    "zipf": "exponent of the ids' Zipf distribution",
    "warm_steps": "steps before the first save",
    "saves": "saves per way of saving",
    "steps_between": "steps between saves",
    "more_steps": "steps trained from each restored checkpoint",
    "tuner_steps": "most steps of each tuner job (0: none)",
    "max_overhead": "the tuner's bound on the loop's time spent saving",
}


def _peers_python(arg: str | None) -> str | None:
    candidate = arg or os.environ.get(_PEERS_ENV)
    if candidate:
        return candidate
    return str(_DEFAULT_PEERS_PYTHON) if _DEFAULT_PEERS_PYTHON.exists() else None


def _update_doc(doc: Path, markdown: str, charts: list[Path]) -> None:
    """Replace the results block of ``doc``; each chart is copied beside it
    (``<doc>-<measure>.png``)."""
    images: list[str] = []
    for chart in charts:
        target = doc.with_name(f"{doc.stem}-{chart.stem.removeprefix('bench-')}.png")
        shutil.copyfile(chart, target)
        images.append(target.name)
    doc.write_text(replace_results(doc.read_text(), markdown, images))


def _command(args: argparse.Namespace) -> str:
    """The command that reproduces this run, with every option that changes the figures."""
    parts = ["unickpt", "bench", "--params", args.params, "--world", str(args.world)]
    parts += ["--systems", args.systems, "--repeats", str(args.repeats)]
    parts += ["--seq-len", str(args.seq_len)]
    parts += ["--device", args.device] if args.device != "cpu" else []
    parts += ["--no-warmup"] if args.no_warmup else []
    parts += ["--time-budget", f"{args.time_budget:g}"] if args.time_budget else []
    return shlex.join(parts)


def run_dlrm_workload(args: argparse.Namespace) -> int:
    """``--workload dlrm``: run it, print its tables, write dlrm.json and dlrm.md."""
    cfg = DlrmConfig(**{name: getattr(args, name) for name in _DLRM_OPTIONS})
    result = run_dlrm(cfg, args.workdir or args.out / "ckpt-tmp", shm=not args.no_shm)
    if args.workdir is None:
        shutil.rmtree(args.out / "ckpt-tmp", ignore_errors=True)
    parts = ["unickpt", "bench", "--workload", "dlrm"]
    for name in _DLRM_OPTIONS:
        parts += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    markdown = f"`{shlex.join(parts)}`\n\n{render(cfg, result)}"
    result["command"] = shlex.join(parts)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dlrm.json").write_text(json.dumps(result, indent=1))
    (args.out / "dlrm.md").write_text(markdown + "\n")
    print(markdown)
    print(f"json: {args.out / 'dlrm.json'}")
    print(f"markdown: {args.out / 'dlrm.md'}")
    return 0


def run(args: argparse.Namespace) -> int:
    """Run the benchmark, print the markdown table and where the reports went."""
    if args.storage is not None:
        return _run_storage(args)
    if args.workload == "dlrm":
        return run_dlrm_workload(args)
    if args.memory_tier:
        return _memory_tier(args)
    try:
        config = BenchConfig(
            params=parse_param_count(args.params),
            world=args.world,
            systems=parse_systems(args.systems),
            out=args.out,
            workdir=args.workdir or args.out / "ckpt-tmp",
            peers_python=_peers_python(args.peers_python),
            seq_len=args.seq_len,
            warmup=not args.no_warmup,
            system_timeout_s=args.system_timeout,
            command=_command(args),
            repeats=args.repeats,
            device=args.device,
            time_budget_s=args.time_budget,
        )
    except ValueError as exc:
        print(f"unickpt bench: {exc}", file=sys.stderr)
        return 2
    cleanup = args.workdir is None
    try:
        report = run_bench(config, lambda line: print(f"unickpt bench: {line}", file=sys.stderr))
    finally:
        if cleanup:
            shutil.rmtree(config.workdir, ignore_errors=True)
    skipped = [row for row in report.systems if row.status == STATUS_SKIPPED]
    if skipped:
        print(f"unickpt bench: skipped: {skipped[0].message}", file=sys.stderr)
    paths = write_outputs(report, config.out)
    markdown = to_markdown(report)
    if args.doc is not None:
        charts = [path for kind, path in paths.items() if kind.startswith("png:")]
        _update_doc(args.doc, markdown, charts)
    print(markdown)
    for kind, path in paths.items():
        print(f"{kind}: {path}")
    return 0


def _run_storage(args: argparse.Namespace) -> int:
    """``--storage s3://...``: throughput against the endpoint; prints the markdown report."""
    from unickpt.bench.s3 import S3BenchConfig, run_s3_bench, to_markdown

    if not args.storage.startswith("s3://"):
        print(f"unickpt bench: --storage {args.storage}: only s3:// URLs", file=sys.stderr)
        return 2
    try:
        config = S3BenchConfig(
            url=args.storage,
            endpoint=args.endpoint,
            mib=args.mib,
            repeats=args.repeats,
            io_threads=args.io_threads,
            part_mib=args.part_mib,
            reshard_world=args.reshard_world,
            peers_python=_peers_python(args.peers_python),
            warmup=not args.no_warmup,
        )
    except (ValueError, CheckpointError) as exc:
        print(f"unickpt bench: {exc}", file=sys.stderr)
        return 2
    report = run_s3_bench(config, lambda line: print(f"unickpt bench: {line}", file=sys.stderr))
    markdown = to_markdown(report)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench-s3.md").write_text(markdown + "\n")
    print(markdown)
    print(f"md: {args.out / 'bench-s3.md'}")
    return 0


def _memory_tier(args: argparse.Namespace) -> int:
    from ..bench.memory_tier import measure
    from ..bench.memory_tier import to_markdown as memory_markdown

    rows = measure(args.memory_mib, 5, _peers_python(args.peers_python))
    markdown = memory_markdown(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "memory_tier.json").write_text(json.dumps(rows, indent=1))
    (args.out / "memory_tier.md").write_text(markdown + "\n")
    print(markdown)
    print(f"json: {args.out / 'memory_tier.json'}")
    return 0
