"""The MTBF learnt from the starts recorded at a root counts running time only: a long pause
between two jobs is not time between failures."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

import unickpt
from unickpt.engine.tensor_reader import CheckpointReader
from unickpt.storage import open_storage
from unickpt.tuning.restarts import (
    STARTS_FILE,
    Start,
    mtbf_from_starts,
    read_starts,
    record_start,
    running_s,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

HOUR = 3600.0
WEEK = 7 * 24 * HOUR


def test_a_pause_between_jobs_is_not_running_time() -> None:
    # Job 1 ran 10 h (last save at 10 h), failed, job 2 started at once and ran 10 h, was
    # stopped, and job 3 started a week later.
    starts = [Start(0.0, 10 * HOUR), Start(10 * HOUR, 20 * HOUR), Start(20 * HOUR + WEEK)]
    now = 20 * HOUR + WEEK + 60.0
    assert running_s(starts, now) == 20 * HOUR + 60.0
    assert mtbf_from_starts(starts, now) == (20 * HOUR + 60.0) / 2
    # Wall time since the first start would have made it (20 h + a week) / 2: 9.4x longer.


def test_a_job_without_a_save_adds_no_running_time() -> None:
    starts = [Start(0.0, None), Start(HOUR, 2 * HOUR), Start(3 * HOUR)]
    assert running_s(starts, 3 * HOUR) == HOUR
    assert mtbf_from_starts([Start(0.0, None), Start(HOUR)], HOUR) is None


def test_a_save_time_past_the_next_start_is_capped() -> None:
    assert running_s([Start(0.0, 5 * HOUR), Start(2 * HOUR)], 2 * HOUR) == 2 * HOUR


def test_record_start_notes_the_previous_jobs_last_save(tmp_path: Path) -> None:
    root = open_storage(tmp_path)
    first = time.time() - 2 * HOUR
    assert [s.start_unix_s for s in record_start(root, first)] == [first]
    unickpt.save(tmp_path / "step-000000010", {"w": torch.ones(3)})
    with CheckpointReader(tmp_path / "step-000000010") as reader:
        saved = reader.metadata.created_unix_s
    later = saved + WEEK  # the next job starts a week after the last save
    starts = record_start(root, later)
    assert starts == [Start(first, saved), Start(later)]
    assert read_starts(root) == starts
    assert mtbf_from_starts(starts, later) == pytest.approx(saved - first)
    doc = json.loads((tmp_path / STARTS_FILE).read_text())
    assert doc["version"] == 2 and doc["last_saves_unix_s"] == [saved, None]


def test_record_start_reads_version_1_records(tmp_path: Path) -> None:
    doc = {"format": "unickpt-starts", "version": 1, "starts_unix_s": [100.0, 300.0]}
    (tmp_path / STARTS_FILE).write_text(json.dumps(doc))
    # Version 1 knows no save times: each job counts until the next start.
    assert read_starts(open_storage(tmp_path)) == [Start(100.0, 300.0), Start(300.0)]
    starts = record_start(open_storage(tmp_path), 500.0)  # no step at the root
    assert starts == [Start(100.0, 300.0), Start(300.0), Start(500.0)]
    # The job started at 300 committed no save at the root: it adds no running time.
    assert mtbf_from_starts(starts, 500.0) == 200.0 / 2
