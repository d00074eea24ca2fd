"""save/load in one process with no process group: every dtype, shapes, values, objects."""

from __future__ import annotations

import threading
import warnings
from pathlib import Path

import pytest
import torch

import unickpt
from unickpt.errors import CheckpointError
from unickpt.storage import LocalStorage


def _all_dtypes() -> list[torch.dtype]:
    names = [
        "float32",
        "float64",
        "float16",
        "bfloat16",
        "complex64",
        "complex128",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "bool",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
    ]
    return [getattr(torch, n) for n in names if hasattr(torch, n)]


def _sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    raw = torch.randint(0, 256, (max(1, torch.Size(shape).numel()) * 16,), dtype=torch.uint8)
    size = torch.empty(0, dtype=dtype).element_size()
    n = torch.Size(shape).numel()
    t = raw[: n * size].view(dtype).reshape(shape).clone()
    if dtype == torch.bool:
        t = raw[:n].reshape(shape) % 2 == 1
    return t


def test_every_dtype_roundtrips_bitwise(tmp_path: Path) -> None:
    state = {str(d).removeprefix("torch."): _sample(d, (3, 5)) for d in _all_dtypes()}
    unickpt.save(tmp_path / "c", state)
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    unickpt.load(tmp_path / "c", dest)
    for k, v in state.items():
        assert dest[k].dtype == v.dtype
        assert torch.equal(dest[k].view(torch.uint8), v.view(torch.uint8)), k


def test_scalars_empty_noncontiguous_and_big(tmp_path: Path) -> None:
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    state = {
        "zero_d": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "expanded": torch.arange(3.0).expand(4, 3),
        "big": torch.randn(3_000_000),
    }
    unickpt.save(tmp_path / "c", state)
    dest = {k: torch.full_like(v.contiguous(), -1.0) for k, v in state.items()}
    dest["transposed"] = torch.zeros(10, 6).t().contiguous().t()
    unickpt.load(tmp_path / "c", dest)
    for k, v in state.items():
        assert torch.equal(dest[k], v), k


@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (64, 0, 257), (0, 0)])
def test_empty_tensor_of_more_dims_than_the_rest(tmp_path: Path, shape: tuple[int, ...]) -> None:
    """An empty tensor has no chunk; the others have fewer dimensions than it (the packed
    coordinates are as wide as the others need)."""
    state = {"empty": torch.empty(shape), "v": torch.arange(3.0), "s": torch.tensor(2)}
    unickpt.save(tmp_path / "c", state)
    dest = {"empty": torch.empty(shape), "v": torch.zeros(3), "s": torch.tensor(0)}
    unickpt.load(tmp_path / "c", dest)
    assert dest["empty"].shape == shape
    assert torch.equal(dest["v"], state["v"]) and int(dest["s"]) == 2


def test_load_into_noncontiguous_destination(tmp_path: Path) -> None:
    t = torch.randn(8, 6)
    unickpt.save(tmp_path / "c", {"t": t})
    holder = torch.zeros(6, 8)
    dest = {"t": holder.t()}
    unickpt.load(tmp_path / "c", dest)
    assert torch.equal(holder.t(), t)


def test_tensors_that_are_not_plain_memory_are_refused(tmp_path: Path) -> None:
    """A meta tensor has no values to save nor memory to load into; an expanded view cannot
    hold different values; sparse, quantized and nested tensors are not plain memory. Each is an
    error naming the key (a quantized one crashed the process before; a meta one loaded
    nothing, silently)."""
    with pytest.raises(CheckpointError, match=r"'w' is on the meta device: it has no values"):
        unickpt.save(tmp_path / "m", {"w": torch.empty(3, device="meta")})
    unickpt.save(tmp_path / "c", {"w": torch.arange(4.0), "b": torch.arange(5)})
    with pytest.raises(CheckpointError, match=r"'w' is on the meta device: it has no memory"):
        unickpt.load(tmp_path / "c", {"w": torch.empty(4, device="meta")})
    expanded = {"w": torch.zeros(4), "b": torch.zeros(1, dtype=torch.int64).expand(5)}
    with pytest.raises(CheckpointError, match=r"'b' has elements that share memory"):
        unickpt.load(tmp_path / "c", expanded)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized and nested tensors are beta or deprecated
        odd = {
            "sparse": torch.eye(3).to_sparse(),
            "quantized": torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8),
            "nested": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
        }
    for kind, t in odd.items():
        with pytest.raises(CheckpointError, match=rf"'t' is a {kind} tensor of .*dense tensors"):
            unickpt.save(tmp_path / kind, {"t": t})
    row = torch.zeros(5, dtype=torch.int64)
    dest = {"w": torch.zeros(4), "b": row.as_strided((1, 5), (0, 1))}  # stride 0, size 1
    unickpt.save(tmp_path / "r", {"w": torch.arange(4.0), "b": torch.arange(5).reshape(1, 5)})
    unickpt.load(tmp_path / "r", dest)
    assert torch.equal(row, torch.arange(5))


def test_values_and_nested_structure(tmp_path: Path) -> None:
    state = {
        "train": {"step": 12, "lr": 3e-4, "name": "run-a", "done": False, "none": None},
        "floats": [float("nan"), float("inf"), -0.0],
        "blob": b"\x00\xff",
        "tuple": (1, (2, "x")),
        "empty_dict": {},
        "empty_list": [],
        "layers": [torch.ones(2), {"w": torch.zeros(3)}],
    }
    unickpt.save(tmp_path / "c", state)
    dest = {
        "train": {"step": 0, "lr": 0.0, "name": "", "done": True, "none": 1},
        "floats": [0.0, 0.0, 0.0],
        "blob": b"",
        "tuple": None,
        "empty_dict": {},
        "empty_list": [],
        "layers": [torch.zeros(2), {"w": torch.ones(3)}],
    }
    unickpt.load(tmp_path / "c", dest)
    assert dest["train"] == state["train"]
    assert str(dest["floats"]) == str(state["floats"])
    assert dest["blob"] == b"\x00\xff" and dest["tuple"] == (1, (2, "x"))
    assert torch.equal(dest["layers"][0], torch.ones(2))
    assert torch.equal(dest["layers"][1]["w"], torch.zeros(3))


class Counter:
    def __init__(self) -> None:
        self.n = 0
        self.history: list[int] = []

    def state_dict(self) -> dict[str, object]:
        return {"n": self.n, "history": list(self.history), "t": torch.tensor([self.n])}

    def load_state_dict(self, sd: dict[str, object]) -> None:
        self.n = int(sd["n"])  # type: ignore[call-overload]
        self.history = list(sd["history"])  # type: ignore[call-overload]


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(11, 4)
        self.head = torch.nn.Linear(4, 11, bias=False)
        self.head.weight = self.emb.weight


def test_modules_optimizers_schedulers_user_objects(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Tied()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(3):
        model.head(model.emb(torch.tensor([1, 2]))).sum().backward()
        opt.step()
        sched.step()
    counter = Counter()
    counter.n, counter.history = 7, [1, 2, 3]
    unickpt.save(tmp_path / "c", {"model": model, "opt": opt, "sched": sched, "c": counter})

    torch.manual_seed(1)
    model2 = Tied()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=5.0)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    counter2 = Counter()
    unickpt.load(tmp_path / "c", {"model": model2, "opt": opt2, "sched": sched2, "c": counter2})
    assert model2.head.weight is model2.emb.weight
    assert torch.equal(model2.emb.weight, model.emb.weight)
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    for k in s1["state"]:
        for name, v in s1["state"][k].items():
            assert torch.equal(v, s2["state"][k][name]), name
    assert sched2.state_dict() == sched.state_dict()
    assert (counter2.n, counter2.history) == (7, [1, 2, 3])


def test_optimizer_state_is_keyed_by_parameter_name(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    unickpt.save(tmp_path / "c", {"model": model, "optim": opt})
    from unickpt.engine.tensor_reader import CheckpointReader

    keys = CheckpointReader(tmp_path / "c").keys()
    assert "optim.state.0.weight.exp_avg" in keys
    assert "optim.state.1.bias.exp_avg_sq" in keys


def test_per_rank_value_single_process(tmp_path: Path) -> None:
    torch.manual_seed(5)
    state = {"rng": unickpt.PerRank(torch.get_rng_state()), "pos": unickpt.PerRank(41)}
    expected = torch.rand(3)
    unickpt.save(tmp_path / "c", state)
    dest = {"rng": unickpt.PerRank(None), "pos": unickpt.PerRank(0)}
    unickpt.load(tmp_path / "c", dest)
    torch.set_rng_state(dest["rng"].value)
    assert torch.equal(torch.rand(3), expected)
    assert dest["pos"].value == 41


def test_pickle_only_when_allowed(tmp_path: Path) -> None:
    class Opaque:
        pass

    with pytest.raises(unickpt.UnsafeObjectError, match=r"'x\.obj' holds a"):
        unickpt.save(tmp_path / "a", {"x": {"obj": Opaque()}})
    unickpt.save(tmp_path / "b", {"x": {"obj": {1, 2}}}, allow_pickle=True)
    with pytest.raises(unickpt.UnsafeObjectError, match="allow_pickle=True"):
        unickpt.load(tmp_path / "b", {"x": {"obj": None}})
    dest: dict[str, dict[str, object]] = {"x": {"obj": None}}
    unickpt.load(tmp_path / "b", dest, allow_pickle=True)
    assert dest["x"]["obj"] == {1, 2}


def test_sharded_and_flat_leaves_in_one_process(tmp_path: Path) -> None:
    full = torch.arange(24.0).reshape(4, 6)
    state = {
        "left": unickpt.ShardedTensor(full[:, :3].clone(), (4, 6), (0, 0)),
        "right": unickpt.ShardedTensor(full[:, 3:].clone(), (4, 6), (0, 3)),
    }
    gap = r"elements \[0:4, 3:6\] are held by no shard"
    with pytest.raises(unickpt.CheckpointMismatchError, match=gap):
        unickpt.save(tmp_path / "c", state)
    whole = {"w": unickpt.FlatShard(full.reshape(-1).clone(), (4, 6), 0)}
    unickpt.save(tmp_path / "f", whole)
    dest = {"w": unickpt.ShardedTensor(torch.zeros(2, 4), (4, 6), (1, 1))}
    unickpt.load(tmp_path / "f", dest)
    assert torch.equal(dest["w"].local, full[1:3, 1:5])


class _ThreadRecordingStorage(LocalStorage):
    """A real folder that notes which threads read its data."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.readers: set[str] = set()

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        self.readers.add(threading.current_thread().name)
        super().read_into(name, offset, out)


def test_load_keeps_the_config_when_verify_is_given(tmp_path: Path) -> None:
    state = {"a": torch.arange(1000.0), "b": torch.arange(2000.0)}
    unickpt.save(tmp_path / "c", state)
    data = next((tmp_path / "c").glob("data-*.bin"))
    raw = bytearray(data.read_bytes())
    raw[0] ^= 0xFF  # damage the first element of 'a'
    data.write_bytes(bytes(raw))
    with pytest.raises(unickpt.CheckpointCorruptError, match="checksum mismatch"):
        unickpt.load(tmp_path / "c", {k: torch.zeros_like(v) for k, v in state.items()})
    one_thread = unickpt.get_config(io_threads=1)
    storage = _ThreadRecordingStorage(tmp_path / "c")
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    unickpt.load(storage, dest, config=one_thread, verify=False)
    assert storage.readers == {threading.current_thread().name}  # io_threads=1 was kept
    assert torch.equal(dest["b"], state["b"]) and torch.equal(dest["a"][1:], state["a"][1:])
    assert not torch.equal(dest["a"][:1], state["a"][:1])  # verify=False was applied


def test_keys_rename_every_save_and_the_checkpointer_loads_them_back(tmp_path: Path) -> None:
    """keys= of save, async_save (zero-stall too) and the Checkpointer: the checkpoint holds
    the renamed keys (tied weights stay one tensor); loads take them back."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    model[1].weight = model[0].weight  # tied
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    state = {"model": model, "opt": opt, "step": 3}
    drop = {"model.0.weight": "w0", "model.0.bias": "b0", "model.1.weight": "w1", "step": "n"}
    unickpt.save(tmp_path / "s", state, keys=drop)
    unickpt.async_save(tmp_path / "a", state, keys=drop).wait()
    unickpt.async_save(tmp_path / "z", state, keys=drop, zero_stall=True).wait()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    for name in ("s", "a", "z"):
        meta = unickpt.tools.inspect_checkpoint(tmp_path / name)
        keys = {t.key for t in meta.tensors} | {o.key for o in meta.objects}
        assert {"w0", "b0", "model.1.bias", "n"} <= keys and "model.0.weight" not in keys
        fresh = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        fresh[1].weight = fresh[0].weight
        back = {"model": fresh, "step": 0}
        inverse = {v: k for k, v in drop.items()}
        unickpt.load(tmp_path / name, back, keys=inverse, strict=False)
        for k, v in fresh.state_dict().items():
            assert torch.equal(v, expected[k]), (name, k)
        assert back["step"] == 3
    with unickpt.Checkpointer(tmp_path / "root", keys=lambda k: "x." + k) as ckpt:
        ckpt.save(7, state)
        ckpt.wait()
        saved = unickpt.tools.inspect_checkpoint(ckpt.path(7)).tensors
        assert {t.key for t in saved} >= {
            "x.model.0.weight",
            "x.opt.state.0.weight.momentum_buffer",
        }
        fresh = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        fresh[1].weight = fresh[0].weight
        fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
        fresh(torch.randn(2, 4)).sum().backward()
        fresh_opt.step()
        back = {"model": fresh, "opt": fresh_opt, "step": 0}
        assert ckpt.load_latest(back) == 7
        assert back["step"] == 3 and torch.equal(fresh[0].weight, model[0].weight)
        momentum = opt.state[model[0].weight]["momentum_buffer"]
        assert torch.equal(fresh_opt.state[fresh[0].weight]["momentum_buffer"], momentum)
    with pytest.raises(CheckpointError, match="keys= and a memory tier"):
        unickpt.Checkpointer(tmp_path / "m", keys={}, memory=unickpt.MemoryTier())
