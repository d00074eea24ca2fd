"""``unickpt demo``: train a small GPT with FSDP2, kill a worker, resume elsewhere, compare.

The demo runs a reference training run, then the same run with asynchronous checkpoints, in
which one worker is killed with SIGKILL during a save; the run resumes on one process
(resharding the FSDP2 checkpoint) and later on two processes again. Every resumed loss curve is
compared with the reference step by step.

Example::

    from unickpt.demo import DemoConfig, run_demo

    result = run_demo(DemoConfig(out_dir="/tmp/unickpt-demo"))
    assert result.all_match
"""

from unickpt.demo.config import DemoConfig, DemoError, Phase, plan_phases
from unickpt.demo.record import DemoResult
from unickpt.demo.scenario import run_demo

__all__ = ["DemoConfig", "DemoError", "DemoResult", "Phase", "plan_phases", "run_demo"]
