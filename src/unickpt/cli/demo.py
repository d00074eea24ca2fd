"""``unickpt demo``: the crash-and-resume demonstration, with progress bars and a report.

Run it (checkpoints, chart and summary go to ``out/demo``)::

    unickpt demo

Under ``torchrun`` it trains one run that resumes from ``--out`` when checkpoints are there, so
it can be stopped and restarted at another world size by hand::

    torchrun --nproc-per-node 2 -m unickpt.demo --out out/demo-torchrun
    torchrun --nproc-per-node 1 -m unickpt.demo --out out/demo-torchrun

Progress bars are drawn only when stderr is a terminal. When stdout is not a terminal (piped
into a log or ``tee``), one line per phase event goes to stdout as it happens.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from typing import TextIO

from tqdm import tqdm

from unickpt.cli.commands import add_command
from unickpt.demo import DemoConfig, DemoError, DemoResult, run_demo
from unickpt.demo.events import (
    Event,
    EventSink,
    Loaded,
    PhaseFinished,
    PhaseStarted,
    StepDone,
    WorkerKilled,
)
from unickpt.demo.launch import run_under_torchrun
from unickpt.demo.record import Recorder
from unickpt.demo.report import format_phases, format_saves, format_verdicts
from unickpt.tools.progress import wants_progress

_DESCRIPTION = """\
Train a small GPT (character level, generated text, CPU) with FSDP2 on 2 processes over gloo,
checkpointing asynchronously with unickpt.Checkpointer. One worker is killed with SIGKILL while
a save is in flight; the run resumes on 1 process from the FSDP2 checkpoint, then on 2 processes
again. An uninterrupted reference run shows that every resumed loss curve matches: bit for bit
at the same world size, within float tolerance at another. Prints a table of save and load
costs and writes a chart (loss.png) and a summary (summary.json) into --out.

Under torchrun (RANK and WORLD_SIZE set) it trains one run instead, resuming from --out when it
holds checkpoints."""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds the ``demo`` command."""
    parser = add_command(subparsers, "demo", _DESCRIPTION)
    add_arguments(parser)
    parser.set_defaults(func=run)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = DemoConfig()
    parser.add_argument(
        "--out",
        default=defaults.out_dir,
        metavar="DIR",
        help="folder for checkpoints, chart and summary (default: %(default)s)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=defaults.steps,
        help="optimizer steps of each full run (default: %(default)s)",
    )
    parser.add_argument(
        "--save-every",
        type=int,
        default=defaults.save_every,
        metavar="N",
        help="save a checkpoint every N steps (default: %(default)s)",
    )
    parser.add_argument(
        "--kill-at",
        type=int,
        metavar="STEP",
        help="kill a worker during the save of STEP (default: ~40%% of --steps)",
    )
    parser.add_argument(
        "--regrow-at",
        type=int,
        metavar="STEP",
        help="go back from 1 to 2 processes at STEP (default: ~70%% of --steps)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=defaults.seed,
        help="seed of the text and the weights (default: %(default)s)",
    )
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help="hide the progress bars (they are drawn only when stderr is a terminal)",
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=argparse.SUPPRESS,
        help="log what the demo does",
    )


def run(args: argparse.Namespace) -> int:
    """Runs the demo; returns 0 when every resumed run matched the reference."""
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING)
    try:
        config = DemoConfig(
            out_dir=args.out,
            steps=args.steps,
            save_every=args.save_every,
            kill_at=args.kill_at,
            regrow_at=args.regrow_at,
            seed=args.seed,
        )
        progress = wants_bars(args)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            return _run_under_torchrun(config, progress)
        print(
            f"unickpt demo: checkpoints go to {os.path.abspath(config.checkpoint_dir)}",
            file=sys.stderr,
        )
        view = ProgressView(enabled=progress)
        try:
            result = run_demo(config, with_phase_lines(view))
        finally:
            view.close()
    except DemoError as error:
        print(f"unickpt demo: {error}", file=sys.stderr)
        return 2
    print(render(result))
    return 0 if result.all_match else 1


def wants_bars(args: argparse.Namespace) -> bool:
    """Progress bars on a terminal only: piped into a log, each redraw would be a line."""
    return not args.no_progress and wants_progress(False)


def main(argv: list[str] | None = None) -> int:
    """``python -m unickpt.demo``."""
    parser = argparse.ArgumentParser(
        prog="unickpt demo",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


def render(result: DemoResult) -> str:
    """The report printed at the end of a demo run."""
    config, reference = result.config, result.phases[0]
    verdict = (
        "every resumed run matches the reference"
        if result.all_match
        else ("SOME RESUMED RUNS DO NOT MATCH THE REFERENCE")
    )
    return "\n".join(
        [
            f"unickpt demo: GPT with {reference.num_parameters / 1e6:.2f}M parameters, "
            f"{config.steps} steps, FSDP2 on {config.world_size} processes (gloo, CPU)",
            "",
            "phases",
            format_phases(result.phases),
            "",
            "saves (asynchronous)",
            format_saves(result.phases[1:]),
            "",
            "compared with the reference run",
            format_verdicts(result.comparisons),
            "",
            f"result:      {verdict}",
            f"checkpoints: {os.path.abspath(config.checkpoint_dir)}",
            f"chart:       {result.chart_path or 'not drawn (pip install matplotlib)'}",
            f"summary:     {result.summary_path}",
            f"time:        {result.elapsed_s:.1f} s",
        ]
    )


class ProgressView:
    """An event sink that draws one progress bar per phase on stderr."""

    def __init__(self, enabled: bool = True) -> None:
        self._enabled = enabled
        self._bar: tqdm | None = None
        self._starting: PhaseStarted | None = None
        self._lock = threading.Lock()

    def __call__(self, event: Event) -> None:
        if not self._enabled:
            return
        with self._lock:
            self._show(event)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _open(self, phase: PhaseStarted, first_step: int) -> None:
        self.close()
        self._bar = tqdm(
            total=phase.end_step,
            initial=first_step,
            desc=f"{phase.label:<22}",
            file=sys.stderr,
            unit="step",
            dynamic_ncols=True,
        )

    def _show(self, event: Event) -> None:
        if isinstance(event, PhaseStarted):
            self._starting = event
            if not event.resumes:
                self._open(event, 0)
        elif isinstance(event, Loaded) and self._starting is not None:
            self._open(self._starting, event.step or 0)
            self._bar_note(f"resumed from step {event.step}")
        elif isinstance(event, StepDone) and self._bar is not None:
            self._bar.update(event.step - self._bar.n)
            self._bar_note(f"loss {event.loss:.4f}")
        elif isinstance(event, WorkerKilled):
            self._bar_note(f"rank {event.rank} SIGKILLed during the save of step {event.step}")
            self.close()
        elif isinstance(event, PhaseFinished):
            self.close()

    def _bar_note(self, text: str) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(text)


class PhaseLines:
    """An event sink that prints one line per phase event (start, resume, kill, end) and
    flushes it, so a demo piped into a log shows its progress as it goes."""

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._labels: dict[str, str] = {}
        self._lock = threading.Lock()

    def __call__(self, event: Event) -> None:
        text = self._line(event)
        if text is not None:
            with self._lock:
                print(text, file=self._out, flush=True)

    def _line(self, event: Event) -> str | None:
        if isinstance(event, PhaseStarted):
            self._labels[event.phase] = event.label
            what = "resuming" if event.resumes else "starting"
            return (
                f"{event.label}: {what} on {event.world_size} process"
                f"{'es' if event.world_size != 1 else ''}, training to step {event.end_step}"
            )
        label = self._labels.get(event.phase, event.phase)
        if isinstance(event, Loaded):
            found = f"step {event.step}" if event.step is not None else "no checkpoint"
            return f"{label}: loaded {found} in {event.load_s:.2f} s"
        if isinstance(event, WorkerKilled):
            return f"{label}: rank {event.rank} killed during the save of step {event.step}"
        if isinstance(event, PhaseFinished):
            return f"{label}: finished at step {event.last_step} in {event.elapsed_s:.1f} s"
        return None


def with_phase_lines(sink: EventSink, out: TextIO | None = None) -> EventSink:
    """``sink``, plus :class:`PhaseLines` on ``out`` (stdout) when it is not a terminal."""
    stream = sys.stdout if out is None else out
    if stream.isatty():
        return sink
    lines = PhaseLines(stream)

    def both(event: Event) -> None:
        sink(event)
        lines(event)

    return both


def _run_under_torchrun(config: DemoConfig, progress: bool) -> int:
    recorder = Recorder()
    view = ProgressView(enabled=progress)

    lines = with_phase_lines(view)

    def sink(event: Event) -> None:
        recorder(event)
        lines(event)

    try:
        rank = run_under_torchrun(config, sink)
    finally:
        view.close()
    if rank == 0:
        phases = list(recorder.phases.values())
        print("\n".join(["phases", format_phases(phases), "", "saves", format_saves(phases)]))
        print(f"\ncheckpoints: {os.path.abspath(config.checkpoint_dir)}")
    return 0
