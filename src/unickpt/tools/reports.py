"""What a conversion did, for the caller to show or check."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ConvertReport:
    """One finished conversion (export from unickpt, or import into unickpt).

    ``left_out`` names each entry that was not converted, with the reason. ``tied``: the
    (name left out, name written) of each tied tensor an export wrote once.
    """

    source: str
    destination: str
    format: str
    files: tuple[str, ...]
    tensors: int
    values: int
    tensor_bytes: int
    left_out: tuple[str, ...]
    elapsed_s: float
    tied: tuple[tuple[str, str], ...] = ()

    @property
    def mb_per_s(self) -> float:
        return self.tensor_bytes / 1e6 / self.elapsed_s if self.elapsed_s > 0 else 0.0
