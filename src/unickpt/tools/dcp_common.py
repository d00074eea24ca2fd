"""What the DCP exporter and importer share."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from ..errors import CheckpointCorruptError, CheckpointError

METADATA_FILE = ".metadata"


@contextmanager
def single_process(failure: str, kind: type[CheckpointError] = CheckpointError) -> Iterator[None]:
    """Run DCP in this process: silence its notice that it runs without a process group (the
    intent here), and turn its ``CheckpointException`` into the unickpt error inside it, or
    into ``kind`` with the message ``failure`` and DCP's first error."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            yield
    except CheckpointException as e:
        errors = [exc for exc, _ in e.failures.values()]
        ours = next((x for x in errors if isinstance(x, CheckpointError)), None)
        if ours is not None:
            raise ours from e
        first = next((f"{type(x).__name__}: {str(x).splitlines()[0]}" for x in errors), str(e))
        raise kind(f"{failure} ({first})") from e


def nest_by_paths(flat: dict[str, Any], paths: Any) -> dict[str, Any]:
    """The state ``dcp.save`` was given, rebuilt from DCP's dotted keys and the object paths
    its planner recorded (``("optimizer", "param_groups", 0, "lr")``; an int is a list index).
    Keys without a recorded path stay as they are. A list index is at most the number of
    entries (a list of ``n`` items has at least one entry per item): the file's numbers are
    not list lengths to allocate."""
    paths = paths if isinstance(paths, dict) else {}
    root: dict[str, Any] = {}
    for key, value in flat.items():
        path = paths.get(key)
        path = tuple(path) if isinstance(path, (tuple, list)) and path else (key,)
        bad = [p for p in path if type(p) is int and not 0 <= p < len(flat)]
        if bad:
            raise CheckpointCorruptError(
                f"DCP's planner data places {key!r} at list index {bad[0]}, but the checkpoint "
                f"has {len(flat)} entries; the metadata is damaged."
            )
        try:
            _set_path(root, path, value)
        except (TypeError, AttributeError) as e:  # a list index into a dict, a key into a list
            raise CheckpointCorruptError(
                f"DCP's planner data places {key!r} at {path!r}, which clashes with another "
                f"entry ({e}); the metadata is damaged."
            ) from e
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
