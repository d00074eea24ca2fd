"""Engine settings: defaults, then the environment, then arguments; bad values named."""

from __future__ import annotations

import pytest

from unickpt.config import Config, get_config
from unickpt.errors import CheckpointError


def test_environment_then_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UNICKPT_VERIFY", "0")
    monkeypatch.setenv("UNICKPT_IO_THREADS", "2")
    assert get_config() == Config(verify=False, io_threads=2)
    # an argument wins over the same field set in the environment
    assert get_config(verify=True) == Config(verify=True, io_threads=2)
    assert get_config(io_threads=3, verify=True) == Config(verify=True, io_threads=3)


@pytest.mark.parametrize(
    ("raw", "value"), [("1", True), ("Yes", True), ("on", True), ("0", False), ("off", False)]
)
def test_boolean_words(monkeypatch: pytest.MonkeyPatch, raw: str, value: bool) -> None:
    monkeypatch.setenv("UNICKPT_SHARE_READS", raw)
    assert get_config().share_reads is value


def test_bad_values_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UNICKPT_VERIFY", "maybe")
    with pytest.raises(
        CheckpointError,
        match=r"UNICKPT_VERIFY='maybe' is not a valid bool \(one of 1, true, yes, on, 0, false, "
        r"no, off\); correct it or unset it",
    ):
        get_config()
    monkeypatch.delenv("UNICKPT_VERIFY")
    monkeypatch.setenv("UNICKPT_IO_THREADS", "four")
    with pytest.raises(
        CheckpointError,
        match=r"UNICKPT_IO_THREADS='four' is not a valid int; correct it or unset it",
    ):
        get_config()
    monkeypatch.setenv("UNICKPT_IO_THREADS", "0")
    with pytest.raises(CheckpointError, match="io_threads is 0; expected at least 1"):
        get_config()


def test_unknown_fields_are_refused() -> None:
    with pytest.raises(
        CheckpointError, match=r"unknown config field\(s\) io_thread; expected some of .*io_threads"
    ):
        get_config(io_thread=2)


def test_an_empty_variable_counts_as_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UNICKPT_VERIFY", "")
    monkeypatch.setenv("UNICKPT_IO_THREADS", " ")
    assert get_config() == Config()
