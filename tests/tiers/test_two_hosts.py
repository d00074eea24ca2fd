"""Two hosts for real: network namespaces joined by a veth pair, each with a tmpfs of its own.

Four ranks (two per host) save in memory over gloo across the veth link; every rank is killed;
host b's memory is wiped (its tmpfs unmounted and mounted fresh); a restart of four ranks loads
the newest step exactly, host b's ranks from host a's memory. Needs root and ``ip netns``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

_REPO = Path(__file__).resolve().parents[2]


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


def _can_make_namespaces() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces and mount tmpfs"
    if shutil.which("ip") is None:
        return "needs iproute2 (the ip command) for network namespaces"
    probe = f"uc-probe-{uuid.uuid4().hex[:6]}"
    try:
        _run("ip", "netns", "add", probe)
        _run("ip", "netns", "del", probe)
    except (subprocess.CalledProcessError, OSError) as e:
        return f"network namespaces are unavailable here ({e})"
    return None


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[dict[str, tuple[str, str, str]]]:
    """Two namespaces a, b: name, address, tmpfs folder."""
    why = _can_make_namespaces()
    if why is not None:
        pytest.skip(why)
    tag = uuid.uuid4().hex[:6]
    made: list[str] = []
    mounts: list[Path] = []
    out = {}
    try:
        for host, addr in (("a", "10.213.7.1"), ("b", "10.213.7.2")):
            ns = f"uc-{host}-{tag}"
            _run("ip", "netns", "add", ns)
            made.append(ns)
            shm = tmp_path / f"shm-{host}"
            shm.mkdir()
            _run("mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(shm))
            mounts.append(shm)
            out[host] = (ns, addr, str(shm))
        _run("ip", "link", "add", f"uca{tag}", "type", "veth", "peer", "name", f"ucb{tag}")
        for host in ("a", "b"):
            ns, addr, _ = out[host]
            dev = f"uc{host}{tag}"
            _run("ip", "link", "set", dev, "netns", ns)
            _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _run("ip", "-n", ns, "link", "set", dev, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        yield out
    finally:
        for m in mounts:
            subprocess.run(["umount", "-l", str(m)], capture_output=True)
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _start(
    hosts: dict[str, tuple[str, str, str]], mode: str, root: str, port: int, out: Path
) -> list[subprocess.Popen[bytes]]:
    procs = []
    for rank in range(4):
        host = "a" if rank < 2 else "b"
        ns, _, shm = hosts[host]
        env = {
            **os.environ,
            "MASTER_ADDR": hosts["a"][1],
            "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": f"uc{host}{ns.rsplit('-', 1)[1]}",
            "PYTHONPATH": os.pathsep.join([str(_REPO / "src"), str(_REPO)]),
        }
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "tests.tiers.host_rank"]
        cmd += [mode, str(rank), "4", root, shm, host, str(out / f"{mode}-{rank}")]
        procs.append(subprocess.Popen(cmd, env=env, cwd=_REPO))
    return procs


def _wait_for(files: list[Path], procs: list[subprocess.Popen[bytes]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(f.exists() and f.read_text() for f in files):
        failed = [p.args for p in procs if p.poll() not in (None, 0)]
        assert not failed and time.monotonic() < deadline, f"ranks failed or hung: {failed}"
        time.sleep(0.2)


def test_node_loss_across_two_hosts(hosts: dict[str, tuple[str, str, str]], tmp_path: Path) -> None:
    root = str(tmp_path / "store")
    procs = _start(hosts, "save", root, 29611, tmp_path)
    try:
        _wait_for([tmp_path / f"save-{r}" for r in range(4)], procs, 300)
    finally:
        for p in procs:
            p.send_signal(signal.SIGKILL)
            p.wait()
    shm_b = hosts["b"][2]
    _run("umount", shm_b)  # host b's memory is gone
    _run("mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", shm_b)
    assert not os.listdir(shm_b)
    procs = _start(hosts, "restart", root, 29612, tmp_path)
    try:
        _wait_for([tmp_path / f"restart-{r}" for r in range(4)], procs, 300)
        results = [json.loads((tmp_path / f"restart-{r}").read_text()) for r in range(4)]
    finally:
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
    assert results == [[3, "memory"], [3, "memory"], [3, "peer"], [3, "peer"]]
