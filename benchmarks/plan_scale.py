"""Simulated planning cost at scale (FSDP x TP layouts), without any process group.

The first save's global plan of every rank's packed local plan (and the global metadata with
its chunk map, for the first save and for a later one of the same plan), what a rank exchanges
for it, then one rank of a resharding restore (the same number of ranks, another TP
degree) on real files: reading the commit marker and the metadata, reading and decoding the
index files listing chunks it needs, checking that the chunks tile each tensor, and matching
its boxes against them. Times are wall seconds; the ``_cpu_s`` figures are this process's CPU
seconds (``time.process_time``, meaningful on a loaded machine too). The ``without_map``
figures estimate, from a sample of index files, what a rank pays to decode every index (a
checkpoint without a chunk map).

python benchmarks/plan_scale.py --ranks 4096 --tensors 2000
"""

from __future__ import annotations

import argparse
import json
import sys

from unickpt.bench.restore_plan import restore_figures
from unickpt.planning.simulate import simulate_save


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--tensors", type=int, default=2000)
    parser.add_argument("--tp", type=int, default=8, help="TP degree of the save")
    parser.add_argument("--tp-load", type=int, default=4, help="TP degree of the restore")
    parser.add_argument("--replicas", type=int, default=1, help="replica groups (HSDP)")
    parser.add_argument("--share-mib", type=int, default=16, help="replica_share_bytes, MiB")
    args = parser.parse_args(argv)
    save = simulate_save(args.ranks, args.tensors, args.tp, args.replicas, args.share_mib << 20)
    report = {**save.report, **restore_figures(save, args.tp_load)}
    print(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
