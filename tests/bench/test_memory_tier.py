"""The memory tier benchmark's own rows, measured for real on a small state."""

from __future__ import annotations

import os
from typing import Any

import pytest

from unickpt.bench import memory_tier

pytestmark = pytest.mark.usefixtures("tests_fork_server")


def test_every_unickpt_row_is_measured_and_restores_the_saved_values() -> None:
    # the restore jobs assert the values they loaded and where they came from (memory, peer)
    rows = memory_tier.measure(mib=16, saves=1, peers_python=None, restores=1)
    assert rows["mib_per_rank"] == 16
    for key in ("unickpt_stall", "unickpt_restore_local", "unickpt_restore_local_unverified"):
        assert len(rows[key]) == 1 and rows[key][0] > 0, key
    assert len(rows["unickpt_replicated"]) == 2  # one save after the first, on each rank
    assert len(rows["unickpt_restore_peer"]) == 1
    assert len(rows["link"]) == 3 and len(rows["link_both_ways"]) == 3
    assert "dlrover" not in rows
    floor = ["map_copy", "map_copy_hashed", "mapped_copy", "read", "read_hashed"]
    assert sorted(rows["floor_local"]) == floor
    assert all(v > 0 for v in rows["floor_local"].values())
    table = memory_tier.to_markdown(rows).splitlines()
    assert table[0] == "| memory tier (16 MiB per rank) | unickpt | DLRover flash checkpoint |"
    assert len(table) == 9
    assert table[7].startswith("| floor of a local restore") and "n/a" not in table[7]
    assert table[4].startswith("| restore from local memory in a new process")
    assert table[4].endswith("| n/a |")
    assert "without: n/a" in table[2]


def _affinity(rank: int, world: int, port: int, a: dict[str, Any], q: Any) -> None:
    import torch

    q.put((rank, (sorted(os.sched_getaffinity(0)), torch.get_num_threads())))


def test_pinned_nodes_run_on_a_cpu_each_and_the_parent_keeps_its_own() -> None:
    before = os.sched_getaffinity(0)
    cpus = sorted(before)
    pinned = memory_tier._spawn(2, _affinity, {}, pin=True)
    # one compute thread on its one CPU, as an interpreter started there would have
    assert pinned == [([cpus[0]], 1), ([cpus[1 % len(cpus)]], 1)]
    assert os.sched_getaffinity(0) == before
    assert [found for found, _ in memory_tier._spawn(2, _affinity, {})] == [cpus, cpus]
