"""S3 save and load throughput as a script; same as ``unickpt bench --storage s3://...``.

python benchmarks/s3_throughput.py                         # starts moto_server on loopback
python benchmarks/s3_throughput.py --mib 1024 --repeats 5 --io-threads 8
python benchmarks/s3_throughput.py --storage s3://bench/run1 --endpoint http://127.0.0.1:9000

Credentials and endpoint come from the environment (AWS_*) unless ``--endpoint`` is given;
on a test server the bucket is created when missing. DCP through fsspec/s3fs runs with the
peers environment (benchmarks/setup_peers.sh) when s3fs imports there.
"""

from __future__ import annotations

import sys

from checkpoint_bench import main as bench_main


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not any(a == "--storage" or a.startswith("--storage=") for a in args):
        args = ["--storage", "s3://unickpt-bench/throughput", *args]
    return bench_main(args)


if __name__ == "__main__":
    sys.exit(main())
