import subprocess
import sys

import numpy as np
import pytest

from unickpt.layouts.arrays import distinct, distinct_rows


@pytest.mark.parametrize("n", [0, 1, 2, 7, 500])
def test_distinct_values_and_rows_match_numpy(n: int) -> None:
    rng = np.random.default_rng(n)
    values = rng.integers(-3, 9, n)
    assert np.array_equal(distinct(values), np.unique(values))
    rows = rng.integers(0, 3, (n, 2))
    assert np.array_equal(distinct_rows(rows), np.unique(rows, axis=0).reshape(-1, 2))


def test_a_load_never_imports_numpy_ma(tmp_path: object) -> None:
    """np.unique imports numpy.ma (about 10 ms) on its first call; a restart's load avoids it."""
    code = f"""
import sys, torch, unickpt
state = {{"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5)}}
unickpt.save({str(tmp_path)!r} + "/ck", state)
out = {{"w": torch.zeros(3, 4), "b": torch.zeros(5)}}
unickpt.load({str(tmp_path)!r} + "/ck", out)
assert torch.equal(out["w"], state["w"]) and torch.equal(out["b"], state["b"])
print("numpy.ma" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False", done.stderr
