"""A local folder whose requests fail on command: transient storage errors, for real saves.

A rule names an operation (``size``, ``read_bytes``, ``list_names``, ``write_atomic``,
``remove``, ``remove_tree``, ``read_into``, ``create``), a part of the file name it applies
to, and how many requests fail. Everything else reaches the real file system.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from unickpt.errors import CheckpointError
from unickpt.storage.base import HeldLock, Storage, WriteHandle
from unickpt.storage.local import LocalStorage


@dataclass
class Rule:
    op: str
    contains: str = ""
    times: int = 1
    hits: list[str] = field(default_factory=list)


class Faults:
    """The rules of one process, shared by every folder opened from one root."""

    def __init__(self) -> None:
        self.rules: list[Rule] = []
        self.armed = True

    def fail(self, op: str, contains: str = "", times: int = 1) -> Rule:
        rule = Rule(op, contains, times)
        self.rules.append(rule)
        return rule

    def check(self, op: str, where: str) -> None:
        if not self.armed:
            return
        for rule in self.rules:
            if rule.op == op and rule.contains in where and rule.times > 0:
                rule.times -= 1
                rule.hits.append(where)
                raise CheckpointError(f"injected failure: {op} {where} (503 Slow Down)")


class FaultyStorage(LocalStorage):
    def __init__(self, path: str | Path, faults: Faults) -> None:
        super().__init__(path)
        self.faults = faults

    def _at(self, op: str, name: str) -> None:
        self.faults.check(op, f"{self.location}/{name}")

    def child(self, name: str) -> FaultyStorage:
        return FaultyStorage(self.root / name, self.faults)

    def parent(self) -> FaultyStorage:
        return FaultyStorage(self.root.parent, self.faults)

    def size(self, name: str) -> int | None:
        self._at("size", name)
        return super().size(name)

    def read_bytes(self, name: str) -> bytes | None:
        self._at("read_bytes", name)
        return super().read_bytes(name)

    def list_names(self) -> list[str]:
        self._at("list_names", "")
        return super().list_names()

    def write_atomic(self, name: str, data: bytes) -> None:
        self._at("write_atomic", name)
        super().write_atomic(name, data)

    def remove(self, name: str) -> None:
        self._at("remove", name)
        super().remove(name)

    def remove_tree(self, name: str) -> None:
        self._at("remove_tree", name)
        super().remove_tree(name)

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        self._at("read_into", name)
        super().read_into(name, offset, out)

    def create(self, name: str, part_sizes: Sequence[int]) -> WriteHandle:
        self._at("create", name)
        return super().create(name, part_sizes)

    def acquire_lock(self) -> HeldLock:
        self._at("acquire_lock", "")
        return super().acquire_lock()


def faulty(path: str | Path) -> tuple[Storage, Faults]:
    faults = Faults()
    return FaultyStorage(path, faults), faults
