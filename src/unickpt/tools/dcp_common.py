"""What the DCP exporter and importer share."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

METADATA_FILE = ".metadata"


@contextmanager
def single_process() -> Iterator[None]:
    """Silence DCP's notice that it runs without a process group: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def nest_by_paths(flat: dict[str, Any], paths: Any) -> dict[str, Any]:
    """The state ``dcp.save`` was given, rebuilt from DCP's dotted keys and the object paths
    its planner recorded (``("optimizer", "param_groups", 0, "lr")``; an int is a list index).
    Keys without a recorded path stay as they are."""
    paths = paths if isinstance(paths, dict) else {}
    root: dict[str, Any] = {}
    for key, value in flat.items():
        path = paths.get(key)
        path = tuple(path) if isinstance(path, (tuple, list)) and path else (key,)
        _set_path(root, path, value)
    return root


def _set_path(root: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    node: Any = root
    for part, following in itertools.pairwise(path):
        empty: Any = [] if isinstance(following, int) else {}
        if isinstance(node, list):
            node.extend([None] * (part + 1 - len(node)))
            if node[part] is None:
                node[part] = empty
            node = node[part]
        else:
            node = node.setdefault(part, empty)
    last = path[-1]
    if isinstance(node, list):
        node.extend([None] * (last + 1 - len(node)))
    node[last] = value
