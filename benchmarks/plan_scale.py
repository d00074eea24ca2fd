"""Simulated planning cost at scale (FSDP x TP layouts), without any process group.

The first save's global plan of every rank's packed local plan, then a resharding restore (the
same number of ranks, another TP degree): what one loading rank pays to read every chunk index
(estimated from a sample of index files) and to plan its reads. Times are wall seconds; the
``_cpu_s`` figures are this process's CPU seconds (meaningful on a loaded machine too).

python benchmarks/plan_scale.py --ranks 4096 --tensors 2000
"""

from __future__ import annotations

import argparse
import json
import sys

from unickpt.planning.simulate import simulate_fsdp_tp


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--tensors", type=int, default=2000)
    parser.add_argument("--tp", type=int, default=8, help="TP degree of the save")
    parser.add_argument("--tp-load", type=int, default=4, help="TP degree of the restore")
    args = parser.parse_args(argv)
    report = simulate_fsdp_tp(args.ranks, args.tensors, args.tp, args.tp_load)
    print(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
