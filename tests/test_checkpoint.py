"""Checkpoints: config.yaml (_target_) + model.safetensors round trip, no pickle, clear errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from wmrl.checkpoint import (
    CheckpointError,
    load_checkpoint,
    load_checkpoint_meta,
    load_extra_tensors,
    read_checkpoint_config,
    save_checkpoint,
)
from wmrl.storage import MissingStatsError, NormStats, Normalizer


def test_round_trip_rebuilds_and_loads_weights(tmp_path):
    torch.manual_seed(0)
    m = nn.Linear(3, 2)
    folder = save_checkpoint(m, tmp_path / "ck", {"in_features": 3, "out_features": 2},
                             extra_tensors={"opt.step": torch.tensor([5.0])}, meta={"step": 5})
    assert sorted(p.name for p in folder.iterdir()) == ["config.yaml", "extra.safetensors", "meta.json",
                                                        "model.safetensors"]
    cfg = read_checkpoint_config(folder)
    assert cfg["_target_"] == "torch.nn.modules.linear.Linear" and cfg["in_features"] == 3
    m2 = load_checkpoint(folder)
    assert type(m2) is nn.Linear
    x = torch.randn(4, 3)
    assert torch.equal(m(x), m2(x))
    assert load_extra_tensors(folder)["opt.step"].item() == 5.0
    assert load_checkpoint_meta(folder) == {"step": 5}
    # no pickle: the weights file is safetensors (8-byte header length + JSON header)
    raw = (folder / "model.safetensors").read_bytes()
    assert raw[8:9] == b"{" and b"\x80\x04" not in raw[:2]


def test_normalisation_stats_travel_as_buffers(tmp_path):
    st = NormStats.from_data({"actions": np.random.default_rng(0).standard_normal((20, 7))})
    norm = Normalizer({"actions": 7}, mode="quantile", stats=st)
    save_checkpoint(norm, tmp_path / "n", {"dims": {"actions": 7}, "mode": "quantile"})
    back = load_checkpoint(tmp_path / "n")
    x = torch.randn(5, 7)
    assert torch.equal(back.normalize("actions", x), norm.normalize("actions", x))
    # a checkpoint saved before stats were set still raises on use
    save_checkpoint(Normalizer({"actions": 7}), tmp_path / "empty", {"dims": {"actions": 7}})
    with pytest.raises(MissingStatsError):
        load_checkpoint(tmp_path / "empty").normalize("actions", x)


def test_overwrite_replaces_atomically(tmp_path):
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    save_checkpoint(a, tmp_path / "last", {"in_features": 2, "out_features": 2})
    save_checkpoint(b, tmp_path / "last", {"in_features": 2, "out_features": 2})
    assert torch.equal(load_checkpoint(tmp_path / "last").weight, b.weight)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last"]  # no temp folders left


def test_bad_checkpoints_give_clear_errors(tmp_path):
    m = nn.Linear(3, 2)
    with pytest.raises(CheckpointError, match="no checkpoint folder"):
        load_checkpoint(tmp_path / "missing")
    f = save_checkpoint(m, tmp_path / "ck", {"in_features": 3, "out_features": 2})
    (f / "model.safetensors").write_bytes(b"garbage, not safetensors")
    with pytest.raises(CheckpointError, match="corrupt"):
        load_checkpoint(f)
    f = save_checkpoint(m, tmp_path / "ck", {"in_features": 3, "out_features": 2})
    (f / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors is missing"):
        load_checkpoint(f)
    f = save_checkpoint(m, tmp_path / "ck", {"in_features": 3, "out_features": 2})
    (f / "config.yaml").write_text("in_features: 3\nout_features: 2\n")
    with pytest.raises(CheckpointError, match="_target_"):
        load_checkpoint(f)
    (f / "config.yaml").write_text("_target_: torch.nn.Linear\nin_features: [3\n")
    with pytest.raises(CheckpointError, match="YAML"):
        load_checkpoint(f)
    (f / "config.yaml").write_text("_target_: torch.nn.Linear\nin_features: 4\nout_features: 2\n")
    with pytest.raises(CheckpointError, match="do not fit"):
        load_checkpoint(f)
    (f / "config.yaml").write_text("_target_: no.such.Class\n")
    with pytest.raises(CheckpointError, match="cannot rebuild"):
        load_checkpoint(f)
    with pytest.raises(CheckpointError, match="YAML-serialisable"):
        save_checkpoint(m, tmp_path / "x", {"in_features": object()})
    with pytest.raises(CheckpointError, match="nn.Module"):
        save_checkpoint(object(), tmp_path / "x", {})


def test_non_contiguous_parameters_round_trip(tmp_path):
    m = nn.Linear(4, 3)
    with torch.no_grad():
        m.weight = nn.Parameter(torch.randn(4, 3).t())  # a transposed (non-contiguous) view
    assert not m.weight.is_contiguous()
    save_checkpoint(m, tmp_path / "c", {"in_features": 4, "out_features": 3})
    assert torch.equal(load_checkpoint(tmp_path / "c").weight, m.weight)
