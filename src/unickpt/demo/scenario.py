"""The demo from end to end: reference, crash, shrink, regrow, then the verdict and the report.

Example::

    from unickpt.demo import DemoConfig, run_demo

    result = run_demo(DemoConfig(out_dir="/tmp/unickpt-demo"))
    print(result.all_match, result.chart_path)
"""

from __future__ import annotations

import logging
import os
import shutil
import time

from unickpt.demo.chart import write_chart
from unickpt.demo.config import DemoConfig, DemoError, plan_phases
from unickpt.demo.events import Event, EventSink, discard
from unickpt.demo.launch import launch_phase
from unickpt.demo.record import DemoResult, Recorder, compare_with_reference
from unickpt.demo.report import write_summary

logger = logging.getLogger(__name__)

_MARKER = ".unickpt-demo"


def run_demo(config: DemoConfig, sink: EventSink = discard) -> DemoResult:
    """Runs every phase of :func:`plan_phases`, then writes the summary JSON and the chart.

    Events go to ``sink`` as they happen (for progress display).
    """
    started = time.perf_counter()
    prepare_out_dir(config.out_dir)
    recorder = Recorder()

    def record_and_forward(event: Event) -> None:
        recorder(event)
        sink(event)

    for phase in plan_phases(config):
        logger.info("starting phase %s (%d processes)", phase.name, phase.world_size)
        launch_phase(config, phase, record_and_forward)
    phases = list(recorder.phases.values())
    comparisons = compare_with_reference(phases, phases[0], config.loss_tolerance)
    chart_path = write_chart(config, phases, comparisons, os.path.join(config.out_dir, "loss.png"))
    result = DemoResult(
        config=config,
        phases=phases,
        comparisons=comparisons,
        summary_path=os.path.join(config.out_dir, "summary.json"),
        chart_path=chart_path,
        elapsed_s=time.perf_counter() - started,
    )
    write_summary(result)
    return result


def prepare_out_dir(out_dir: str) -> None:
    """Creates ``out_dir`` and empties the checkpoints of an earlier demo run in it."""
    checkpoints = os.path.join(out_dir, "checkpoints")
    marker = os.path.join(out_dir, _MARKER)
    if os.path.exists(checkpoints) and not os.path.exists(marker):
        raise DemoError(
            f"{out_dir!r} already holds a 'checkpoints' folder that the demo did not create; "
            "choose another --out"
        )
    os.makedirs(out_dir, exist_ok=True)
    shutil.rmtree(checkpoints, ignore_errors=True)
    with open(marker, "w") as f:
        f.write("written by `unickpt demo`; its checkpoints folder is replaced on every run\n")
