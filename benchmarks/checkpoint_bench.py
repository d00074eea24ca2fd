"""The checkpoint benchmark as a script; same options as ``unickpt bench``.

python benchmarks/checkpoint_bench.py --params 10M --systems dcp,unickpt
"""

from __future__ import annotations

import argparse
import sys

from unickpt.cli import bench


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="checkpoint_bench")
    bench.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    return bench.run(args)


if __name__ == "__main__":
    sys.exit(main())
