from __future__ import annotations

from unickpt.demo.events import (
    Event,
    Loaded,
    PhaseStarted,
    SaveDurable,
    SaveStarted,
    StepDone,
    WorkerKilled,
)
from unickpt.demo.record import Recorder, compare_with_reference

REFERENCE = {1: 3.0, 2: 2.5, 3: 2.25, 4: 2.0}


def _run(name: str, world_size: int, losses: dict[int, float], saves: list[int]) -> list[Event]:
    events: list[Event] = [PhaseStarted(name, name, world_size, 4, 100, False)]
    for step, loss in losses.items():
        events.append(StepDone(name, step, loss, f"state-{step}" if step % 2 == 0 else None))
        if step in saves:
            events += [SaveStarted(name, step, 0.01), SaveDurable(name, step, 0.1, 1000)]
    return events


def _record(*runs: list[Event]) -> Recorder:
    recorder = Recorder()
    for run in runs:
        for event in run:
            recorder(event)
    return recorder


def test_recorder_keeps_losses_saves_and_the_kill() -> None:
    train = [*_run("train", 2, {1: 3.0, 2: 2.5}, [2]), SaveStarted("train", 4, 0.02)]
    train.append(WorkerKilled("train", 1, 1234, 4))
    record = _record(train).phases["train"]
    assert record.losses == {1: 3.0, 2: 2.5}
    assert record.digests == {2: "state-2"}
    assert record.saves[2].durable_s == 0.1 and record.saves[2].size_bytes == 1000
    assert record.saves[4].durable_s is None
    assert record.killed is not None and record.killed.step == 4


def test_identical_resume_is_expected_and_found_bit_for_bit() -> None:
    resumed = _run("resume", 2, {3: 2.25, 4: 2.0}, [4])
    resumed.insert(1, Loaded("resume", 2, 0.05, "state-2"))
    recorder = _record(
        _run("reference", 2, REFERENCE, []), _run("train", 2, {1: 3.0, 2: 2.5}, [2]), resumed
    )
    phases = list(recorder.phases.values())
    train, resume = compare_with_reference(phases, phases[0], tolerance=1e-3)
    assert train.expected == "bitwise" and train.bitwise and train.matches
    assert resume.restored_exactly and resume.started_as_reference
    assert resume.expected == "bitwise" and resume.bitwise and resume.matches


def test_other_world_size_is_held_to_the_tolerance() -> None:
    shrunk = _run("shrunk", 1, {3: 2.25 + 1e-6, 4: 2.0}, [4])
    shrunk.insert(1, Loaded("shrunk", 2, 0.05, "state-2"))
    recorder = _record(
        _run("reference", 2, REFERENCE, []), _run("train", 2, {1: 3.0, 2: 2.5}, [2]), shrunk
    )
    phases = list(recorder.phases.values())
    comparison = compare_with_reference(phases, phases[0], tolerance=1e-3)[1]
    assert comparison.expected == "tolerance" and not comparison.bitwise
    assert comparison.matches
    too_far = compare_with_reference(phases, phases[0], tolerance=1e-7)[1]
    assert not too_far.matches


def test_a_state_that_differs_after_loading_is_a_mismatch() -> None:
    resumed = _run("resume", 2, {3: 2.25, 4: 2.0}, [])
    resumed.insert(1, Loaded("resume", 2, 0.05, "something else"))
    recorder = _record(
        _run("reference", 2, REFERENCE, []), _run("train", 2, {1: 3.0, 2: 2.5}, [2]), resumed
    )
    phases = list(recorder.phases.values())
    comparison = compare_with_reference(phases, phases[0], tolerance=1e-3)[1]
    assert comparison.restored_exactly is False
    assert comparison.expected == "tolerance"  # it did not start from the reference's state
    assert not comparison.matches


def test_a_save_cut_off_by_the_crash_but_loaded_later_counts_as_committed() -> None:
    train = [*_run("train", 2, {1: 3.0, 2: 2.5}, []), SaveStarted("train", 2, 0.02)]
    resumed = [PhaseStarted("resume", "resume", 1, 4, 100, True)]
    resumed.append(Loaded("resume", 2, 0.05, "state-2"))
    recorder = _record(train)
    assert not recorder.phases["train"].saves[2].committed
    for event in resumed:
        recorder(event)
    save = recorder.phases["train"].saves[2]
    assert save.committed and save.durable_s is None
