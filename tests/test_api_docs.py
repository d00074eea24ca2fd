"""docs/api.md is what scripts/api_docs.py writes from the docstrings: regenerating it is one
command, and a renamed argument or a new public name shows here until it is run."""

from __future__ import annotations

import runpy
from pathlib import Path

import unickpt

ROOT = Path(__file__).resolve().parent.parent


def test_api_reference_is_up_to_date() -> None:
    script = runpy.run_path(str(ROOT / "scripts" / "api_docs.py"))
    expected = script["render"]()
    found = (ROOT / "docs" / "api.md").read_text()
    assert found == expected, "docs/api.md is out of date: run python scripts/api_docs.py"
    for name in unickpt.__all__:
        assert f"`unickpt.{name}`" in found, name
