from __future__ import annotations

import pytest

from unickpt.demo.config import DemoConfig, DemoError, plan_phases


def test_default_kill_and_regrow_steps_fall_on_saves() -> None:
    config = DemoConfig(steps=60, save_every=5)
    assert (config.kill_step, config.regrow_step) == (25, 40)
    small = DemoConfig(steps=12, save_every=2)
    assert (small.kill_step, small.regrow_step) == (4, 8)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"steps": 15, "save_every": 5}, "at least four saves"),
        ({"kill_at": 23}, "not a multiple of save_every"),
        ({"kill_at": 45, "regrow_at": 40}, "kill_at .* < regrow_at"),
        ({"regrow_at": 60}, "< steps"),
        ({"batch_size": 15}, "batch_size=15"),
        ({"world_size": 3}, "world_size=3"),
    ],
)
def test_invalid_settings_say_what_to_change(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(DemoError, match=message):
        DemoConfig(**kwargs)


def test_phases_kill_shrink_and_regrow() -> None:
    config = DemoConfig(steps=60, save_every=5)
    phases = plan_phases(config)
    assert [(p.world_size, p.end_step, p.checkpoint, p.resume) for p in phases] == [
        (2, 60, False, False),
        (2, 60, True, False),
        (1, 40, True, True),
        (2, 60, True, True),
    ]
    assert phases[1].kill_at == 25
    assert all(p.kill_at is None for p in phases[2:])
