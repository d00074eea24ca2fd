"""``unickpt run SCRIPT ...``: torchrun's static launch, with warm spares that take a failed
rank's place while the other processes stay (docs/recovery.md)."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

from .commands import add_command
from .errors import print_error

_DESCRIPTION = """\
Start this node's processes of a training job, as torchrun does for a static job (one launcher
per node, the same options, the same environment in each process), plus --spares warm spare
processes that run the script up to unickpt.recover(train) and wait there. When a worker dies,
every node is told at once; the other processes leave train and call it again in the same
process with a spare in the dead rank's place, restoring from memory (a Checkpointer with a
MemoryTier). Without a spare, or when a process fails during that, every process is restarted.

exit status: 0 when every rank's train returned, 1 when the job failed"""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds the ``run`` command."""
    parser = add_command(subparsers, "run", _DESCRIPTION)
    add = parser.add_argument
    add("--nnodes", type=int, default=1, metavar="N", help="nodes of the job (default 1)")
    add("--node-rank", type=int, default=0, metavar="I", help="this node's index (default 0)")
    add("--nproc-per-node", type=int, default=1, metavar="P", help="workers per node (default 1)")
    add("--spares", type=int, default=0, metavar="K", help="warm spare processes on this node")
    add("--node-name", default=None, metavar="NAME", help="UNICKPT_NODE (default: host name)")
    add("--master-addr", default="127.0.0.1", metavar="ADDR", help="the first node's address")
    add("--master-port", type=int, default=29500, metavar="PORT", help="its store's port")
    add("--max-restarts", type=int, default=3, metavar="R", help="full restarts at most (3)")
    add(
        "--recovery-timeout",
        type=float,
        default=120.0,
        metavar="S",
        help="seconds for processes to leave a failed membership, and to form the next (120)",
    )
    add(
        "--stop-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds between SIGTERM and SIGKILL when processes are stopped (30)",
    )
    add("script", metavar="SCRIPT", help="the training script")
    add("args", nargs=argparse.REMAINDER, help="its arguments")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..errors import CheckpointError
    from ..launch.launcher import RunOptions
    from ..launch.launcher import run as launch

    problem = _problem(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    opts = RunOptions(
        argv=(sys.executable, "-u", args.script, *args.args),
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        nproc_per_node=args.nproc_per_node,
        spares=args.spares,
        node_name=args.node_name or os.environ.get("UNICKPT_NODE") or socket.gethostname(),
        master_addr=args.master_addr,
        master_port=args.master_port,
        max_restarts=args.max_restarts,
        recovery_timeout_s=args.recovery_timeout,
        stop_timeout_s=args.stop_timeout,
    )
    logging.getLogger("unickpt.launch").setLevel(logging.INFO)  # what happens to the job
    try:
        return launch(opts)
    except CheckpointError as e:
        return print_error(e)


def _problem(args: argparse.Namespace) -> str:
    if args.nnodes < 1 or args.nproc_per_node < 1 or args.spares < 0 or args.max_restarts < 0:
        return (
            f"--nnodes {args.nnodes}, --nproc-per-node {args.nproc_per_node}, --spares "
            f"{args.spares}, --max-restarts {args.max_restarts}: expected at least 1, 1, 0, 0."
        )
    if not 0 <= args.node_rank < args.nnodes:
        return f"--node-rank {args.node_rank}: expected 0 to {args.nnodes - 1} (--nnodes)."
    if not os.path.isfile(args.script):
        return f"{args.script}: no such script; expected a Python file to run."
    return ""
