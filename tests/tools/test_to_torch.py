"""unickpt -> torch.save file, read back with torch.load(weights_only=True)."""

from __future__ import annotations

from pathlib import Path

import torch

import unickpt
from unickpt.tools import export_torch

from .helpers import assert_bitwise, make_model, make_tied_model, reader_tensors, save_sample


def test_nested_dict_weights_only(tmp_path: Path) -> None:
    save_sample(tmp_path / "c")
    report = export_torch(tmp_path / "c", tmp_path / "c.pt", block_bytes=1000)
    loaded = torch.load(tmp_path / "c.pt", weights_only=True)
    assert loaded["step"] == 12
    assert loaded["train"]["name"] == "run-a"
    assert loaded["train"]["betas"] == (0.9, 0.95)
    assert loaded["train"]["history"] == [1.5, float("inf")]
    for key, t in reader_tensors(tmp_path / "c").items():
        head, _, rest = key.partition(".")
        assert_bitwise(loaded[head][rest], t, key)
    assert report.left_out == ()
    assert report.tensors == len(reader_tensors(tmp_path / "c"))


def test_only_model_is_a_state_dict(tmp_path: Path) -> None:
    state = save_sample(tmp_path / "c")
    export_torch(tmp_path / "c", tmp_path / "model.pt", only="model")
    fresh = make_model(seed=5)
    fresh.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    for key, t in state["model"].state_dict().items():
        assert_bitwise(fresh.state_dict()[key], t, key)


def test_tensors_inside_values_and_pickled_values(tmp_path: Path) -> None:
    rng = torch.get_rng_state()
    unickpt.save(
        tmp_path / "c",
        {"rng": (rng, 7), "opaque": complex(1, 2), "w": torch.ones(3)},
        allow_pickle=True,
    )
    report = export_torch(tmp_path / "c", tmp_path / "c.pt")
    loaded = torch.load(tmp_path / "c.pt", weights_only=True)
    assert_bitwise(loaded["rng"][0], rng)
    assert loaded["rng"][1] == 7
    assert "opaque" not in loaded
    assert [x.split(":")[0] for x in report.left_out] == ["opaque"]


def test_tied_weights_share_one_tensor(tmp_path: Path) -> None:
    model = make_tied_model()
    unickpt.save(tmp_path / "c", {"model": model})
    export_torch(tmp_path / "c", tmp_path / "model.pt", only="model")
    loaded = torch.load(tmp_path / "model.pt", weights_only=True)
    assert sorted(loaded) == ["head.bias", "head.weight", "wte.weight"]
    assert loaded["head.weight"].data_ptr() == loaded["wte.weight"].data_ptr()
    assert_bitwise(loaded["head.weight"], model["wte"].weight.detach(), "head.weight")
    fresh = make_tied_model(seed=1, tied=False)
    fresh.load_state_dict(loaded)
    assert_bitwise(fresh["head"].weight.detach(), model["head"].weight.detach(), "head")
