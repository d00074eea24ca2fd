"""``unickpt bench --storage s3://``: every system against a real (moto) server over HTTP, the
resharded load's bytes counted exactly, and the options refused with a message."""

from __future__ import annotations

from pathlib import Path

import pytest

from unickpt.bench.s3 import S3BenchConfig
from unickpt.cli.main import main

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.usefixtures("tests_fork_server"),
]

MiB = 1 << 20


def test_s3_bench_against_a_server(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("moto.server")
    from tests.storage.s3_server import moto_server, new_bucket

    with moto_server() as endpoint:
        bucket = new_bucket(endpoint)
        argv = ["bench", "--storage", f"s3://{bucket}/bench", "--mib", "64", "--repeats", "1"]
        argv += ["--reshard-world", "2", "--out", str(tmp_path), "--peers-python", "/no/python"]
        assert main(argv) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert f"64 MiB in 1 float32 matrices against {endpoint}; 1 rounds after an untimed one" in out
    assert "warm-up (untimed): unickpt: save " in captured.err
    assert "| unickpt | " in out and "| boto3 transfer manager | " in out
    assert "| DCP + fsspec/s3fs | not run: no peers environment" in out
    assert "unickpt / transfer manager (medians): save " in out
    # each of 2 ranks needs half of the one 64 MiB chunk; as row blocks each reads its half
    # alone, as column blocks one rank reads each 1 MiB unit once and both copy from it
    half = 32 * MiB
    assert f"row blocks: read {2 * half:,} bytes for {2 * half:,} needed (1.000x; 0 bytes" in out
    assert f"column blocks: read {2 * half:,} bytes for {2 * half:,} needed (1.000x;" in out
    assert (tmp_path / "bench-s3.md").read_text().strip() == out.split("md: ")[0].strip()


def test_s3_bench_options_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--storage", "gs://bucket/x"]) == 2
    assert "only s3:// URLs" in capsys.readouterr().err
    assert main(["bench", "--storage", "s3://b/x", "--part-mib", "4"]) == 2
    assert "S3 parts are 5 MiB to 5 GiB" in capsys.readouterr().err
    with pytest.raises(ValueError, match="expected at least 64, 1, 1 and 2"):
        S3BenchConfig("s3://b/x", mib=32)
