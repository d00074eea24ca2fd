"""Python values stored without pickle: a tagged JSON encoding.

JSON scalars (None, bool, int, str, finite float) are stored as themselves. Everything else is
a one-key object whose key names the type:

- ``{"$float": "nan" | "inf" | "-inf"}``
- ``{"$bytes": "<base64>"}``
- ``{"$list": [...]}``, ``{"$tuple": [...]}``, ``{"$dict": {"key": ...}}`` (string keys)
- ``{"$tensor": {"dtype": "float32", "shape": [2], "data": "<base64 of raw bytes>"}}``
  (small tensors inside a value, such as an RNG state)
- ``{"$pickle": "<base64>"}`` only when the caller allowed pickle, and loaded only when the
  reader allows it.
"""

from __future__ import annotations

import base64
import binascii
import math
import pickle
import sys
import warnings
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointCorruptError, CheckpointError, UnsafeObjectError
from .dtypes import dtype_from_name, dtype_name, tensor_bytes

LARGE_VALUE_TENSOR_BYTES = 1 << 20
"""A tensor inside a value larger than this is stored, with a warning, in the metadata."""
MAX_DEPTH = 100
"""How deep lists, tuples and dicts may nest in a state, and in a value (deeper ones are
refused naming the key, before Python's recursion limit is reached)."""


def too_deep(key: str) -> CheckpointError:
    """The error of a state or value nested more than :data:`MAX_DEPTH` deep at ``key``."""
    return CheckpointError(
        f"'{key}' nests lists, tuples or dicts more than {MAX_DEPTH} deep; unickpt walks "
        f"states and stores values up to {MAX_DEPTH} levels. Store it flatter (or as a tensor "
        "or bytes)."
    )


def encode_value(value: Any, key: str, allow_pickle: bool, depth: int = 0) -> Any:
    """Encode ``value`` (stored at ``key``, ``depth`` containers down) as JSON-able data;
    refuse unsafe types and nesting deeper than :data:`MAX_DEPTH`."""
    if depth > MAX_DEPTH:
        raise too_deep(key)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"$float": repr(value)}
    if isinstance(value, (bytes, bytearray)):
        return {"$bytes": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        tag = "$list" if isinstance(value, list) else "$tuple"
        items = [
            encode_value(v, f"{key}[{i}]", allow_pickle, depth + 1) for i, v in enumerate(value)
        ]
        return {tag: items}
    if type(value) is dict and all(isinstance(k, str) for k in value):
        found = {
            k: encode_value(v, f"{key}.{k}", allow_pickle, depth + 1) for k, v in value.items()
        }
        return {"$dict": found}
    torch = sys.modules.get("torch")  # a tensor's module is imported (none is, in the tools)
    if torch is not None and type(value) is torch.Tensor:
        t = value.detach().cpu().contiguous()
        if t.nbytes > LARGE_VALUE_TENSOR_BYTES:
            warnings.warn(
                f"'{key}' is a tensor of {t.nbytes:,} bytes inside a value (a tuple, or a "
                "container unickpt does not flatten into keys): it is stored in the metadata, "
                "which every rank reads whole at every load, and it is never resharded. Put it "
                "in a dict or a list of the state to store it as a tensor.",
                stacklevel=2,
            )
        raw = tensor_bytes(t).tobytes()
        data = {"dtype": dtype_name(t.dtype), "shape": list(t.shape)}
        return {"$tensor": {**data, "data": base64.b64encode(raw).decode("ascii")}}
    if allow_pickle:
        try:
            raw = pickle.dumps(value)
        except Exception as e:
            raise UnsafeObjectError(
                f"'{key}' holds a {type(value).__qualname__} that pickle cannot store "
                f"({type(e).__name__}: {e}); give it state_dict()/load_state_dict(), or leave it "
                "out of the checkpoint."
            ) from e
        return {"$pickle": base64.b64encode(raw).decode("ascii")}
    raise UnsafeObjectError(
        f"'{key}' holds a {type(value).__module__}.{type(value).__qualname__}, which unickpt "
        "cannot store without pickle (it stores None, bool, int, float, str, bytes, lists, "
        "tuples, dicts with str keys, tensors and objects with state_dict/load_state_dict). "
        "Give the object state_dict()/load_state_dict(), or pass allow_pickle=True."
    )


def needs_pickle(encoded: Any) -> bool:
    if isinstance(encoded, dict):
        if "$pickle" in encoded:
            return True
        return any(needs_pickle(v) for v in encoded.values())
    if isinstance(encoded, list):
        return any(needs_pickle(v) for v in encoded)
    return False


@dataclass(frozen=True)
class StoredTensor:
    """A tensor inside a value as stored (dtype name, shape, raw bytes): what the tools show
    and compare without importing torch."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    def __repr__(self) -> str:
        return f"tensor {self.dtype} {list(self.shape)} {self.data.hex()}"


def decode_value(
    encoded: Any, key: str, allow_pickle: bool, stored: bool = False, depth: int = 0
) -> Any:
    """Inverse of :func:`encode_value`; pickle only when ``allow_pickle``. With ``stored``,
    tensors inside the value come back as :class:`StoredTensor` (torch is not imported).
    ``depth``: how many containers down ``encoded`` lies (deeper than :data:`MAX_DEPTH` is
    refused: unickpt never writes it)."""
    if depth > MAX_DEPTH:
        raise CheckpointCorruptError(
            f"value of '{key}' in the metadata nests more than {MAX_DEPTH} deep, which unickpt "
            "never writes; the metadata is damaged or was not written by unickpt."
        )
    if encoded is None or isinstance(encoded, (bool, int, float, str)):
        return encoded
    if not isinstance(encoded, dict) or len(encoded) != 1:
        raise CheckpointCorruptError(
            f"value of '{key}' in the metadata is {type(encoded).__name__}, not a tagged value; "
            "the metadata is damaged or was not written by unickpt."
        )
    ((tag, payload),) = encoded.items()
    try:
        return _DECODERS[tag](payload, key, allow_pickle, stored, depth + 1)
    except KeyError:
        raise CheckpointCorruptError(
            f"value of '{key}' has unknown tag {tag!r}; expected one of {sorted(_DECODERS)}. "
            "Upgrade unickpt if the checkpoint comes from a newer version."
        ) from None
    except (ValueError, TypeError, AttributeError, RuntimeError, binascii.Error) as e:
        raise CheckpointCorruptError(f"value of '{key}' cannot be decoded: {e}") from e


def _decode_pickle(payload: str, key: str, allow_pickle: bool, stored: bool, depth: int) -> Any:
    if not allow_pickle:
        raise UnsafeObjectError(
            f"'{key}' was saved with pickle; loading it could run code from the checkpoint. "
            "Pass allow_pickle=True only if you trust where the checkpoint comes from."
        )
    return pickle.loads(base64.b64decode(payload))


def _decode_tensor(
    payload: dict[str, Any], key: str, allow_pickle: bool, stored: bool, depth: int
) -> Any:
    if stored:
        shape = tuple(int(s) for s in payload["shape"])
        return StoredTensor(str(payload["dtype"]), shape, base64.b64decode(payload["data"]))
    import torch

    dtype = dtype_from_name(payload["dtype"])
    shape = tuple(int(s) for s in payload["shape"])
    raw = bytearray(base64.b64decode(payload["data"]))
    flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(shape).clone()


_DECODERS: dict[str, Any] = {
    "$float": lambda p, k, a, s, d: float(p),
    "$bytes": lambda p, k, a, s, d: base64.b64decode(p),
    "$list": lambda p, k, a, s, d: [decode_value(v, f"{k}[{i}]", a, s, d) for i, v in enumerate(p)],
    "$tuple": lambda p, k, a, s, d: tuple(
        decode_value(v, f"{k}[{i}]", a, s, d) for i, v in enumerate(p)
    ),
    "$dict": lambda p, k, a, s, d: {
        str(n): decode_value(v, f"{k}.{n}", a, s, d) for n, v in p.items()
    },
    "$tensor": _decode_tensor,
    "$pickle": _decode_pickle,
}
