"""``unickpt bench``: checkpoint save/load benchmark of unickpt against DCP, torch.save and peers.

Example::

    from pathlib import Path
    from unickpt.bench import BenchConfig, run_bench, write_outputs

    config = BenchConfig(params=10_000_000, world=2, systems=("dcp", "unickpt"),
                         out=Path("out/bench"), workdir=Path("out/bench/ckpt-tmp"))
    report = run_bench(config)
    write_outputs(report, config.out)
"""

from unickpt.bench.config import BenchConfig, parse_param_count, parse_systems
from unickpt.bench.harness import run_bench
from unickpt.bench.report import to_markdown, write_outputs
from unickpt.bench.results import BenchReport, HardwareResult, SystemResult

__all__ = [
    "BenchConfig",
    "BenchReport",
    "HardwareResult",
    "SystemResult",
    "parse_param_count",
    "parse_systems",
    "run_bench",
    "to_markdown",
    "write_outputs",
]
