"""Simulated planning cost of a save at scale (FSDP x TP layouts), without any process group.

python benchmarks/plan_scale.py --ranks 1024 --tensors 2000
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
    args = parser.parse_args(argv)
    print(json.dumps(simulate_fsdp_tp(args.ranks, args.tensors), indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
