"""The DLRM-like benchmark as a script; same options as ``unickpt bench --workload dlrm``.

python benchmarks/dlrm.py --tables 4 --rows 500000 --dim 64
"""

from __future__ import annotations

import argparse
import sys

from unickpt.cli import bench


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dlrm")
    bench.register(parser.add_subparsers(dest="command"))
    rest = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(["bench", "--workload", "dlrm", *rest])
    return bench.run(args)


if __name__ == "__main__":
    sys.exit(main())
