"""Distinct values of NumPy arrays without ``np.unique``.

``np.unique`` imports ``numpy.ma`` on its first call in a process (about 10 ms), which a restart
would pay inside its restore. Sorting and comparing neighbours gives the same answer.
"""

from __future__ import annotations

import numpy as np


def distinct(values: np.ndarray) -> np.ndarray:
    """The distinct values of a 1-D array, sorted (``np.unique(values)``)."""
    ordered = np.sort(values, kind="stable")
    if len(ordered) < 2:
        return ordered
    keep = np.empty(len(ordered), dtype=bool)
    keep[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=keep[1:])
    return ordered[keep]


def distinct_rows(rows: np.ndarray) -> np.ndarray:
    """The distinct rows of a 2-D array, sorted (``np.unique(rows, axis=0)``)."""
    if len(rows) < 2:
        return rows.copy()
    ordered = rows[np.lexsort(rows.T[::-1])]
    keep = np.empty(len(ordered), dtype=bool)
    keep[0] = True
    np.any(ordered[1:] != ordered[:-1], axis=1, out=keep[1:])
    return ordered[keep]
