"""Checkpoints: config.yaml (_target_) + model.safetensors round trip, no pickle, clear errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from wmrl.kernel.checkpoint import (
    CheckpointError,
    load_checkpoint,
    load_checkpoint_meta,
    load_extra_tensors,
    read_checkpoint_config,
    save_checkpoint,
)
from wmrl.kernel.storage import MissingStatsError, Normalizer, NormStats


def test_round_trip_rebuilds_and_loads_weights(tmp_path):
    torch.manual_seed(0)
    m = nn.Linear(3, 2)
    folder = save_checkpoint(m, tmp_path / "ck", {"in_features": 3, "out_features": 2},
                             extra_tensors={"opt.step": torch.tensor([5.0])}, meta={"step": 5})
    assert sorted(p.name for p in folder.iterdir()) == ["checksums.json", "config.yaml", "extra.safetensors", "meta.json",
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


def _lin(tmp_path, name="last", seed=0):
    torch.manual_seed(seed)
    m = nn.Linear(2, 2)
    return m, save_checkpoint(m, tmp_path / name, {"in_features": 2, "out_features": 2},
                              extra_tensors={"opt.0.exp_avg": torch.ones(3)}, meta={"step": seed})


def test_corrupt_weight_bytes_are_refused_with_the_file_named(tmp_path):
    from wmrl.kernel.checkpoint import verify_checkpoint

    _, f = _lin(tmp_path)
    assert verify_checkpoint(f)
    raw = bytearray((f / "model.safetensors").read_bytes())
    raw[-1] ^= 0xFF                                    # one flipped bit in a weight: still parses
    (f / "model.safetensors").write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"model\.safetensors is corrupt: its sha256 differs"):
        load_checkpoint(f)
    _, f = _lin(tmp_path, "b")
    raw = bytearray((f / "extra.safetensors").read_bytes())
    raw[-1] ^= 0xFF
    (f / "extra.safetensors").write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"extra\.safetensors is corrupt"):
        verify_checkpoint(f)


def test_checkpoint_without_checksums_still_loads(tmp_path, caplog):
    import logging

    from wmrl.kernel.checkpoint import verify_checkpoint

    m, f = _lin(tmp_path)
    (f / "checksums.json").unlink()                   # as written by an older wmrl
    with caplog.at_level(logging.INFO, logger="wmrl.kernel.checkpoint"):
        assert not verify_checkpoint(f)
        assert torch.equal(load_checkpoint(f).weight, m.weight)
    assert any("not verified" in r.getMessage() for r in caplog.records)


def test_a_kill_between_the_two_renames_of_a_swap_resumes_from_the_last_complete(tmp_path, monkeypatch):
    """Without an atomic exchange the old `last` is moved aside before the new one is renamed in; a
    process killed between the two leaves no `last`. The next run must find the newest complete one."""
    import os

    import wmrl.kernel.checkpoint as ck

    a, _ = _lin(tmp_path, seed=1)
    monkeypatch.setattr(ck, "_exchange", lambda x, y: False)          # a file system without RENAME_EXCHANGE
    real_replace = os.replace
    calls = []

    def killed_after_first(src, dst):
        calls.append((src, dst))
        if os.fspath(dst) == os.fspath(tmp_path / "last"):            # the second rename never happens
            raise KeyboardInterrupt("killed")
        return real_replace(src, dst)

    b = nn.Linear(2, 2)
    monkeypatch.setattr(ck.os, "replace", killed_after_first)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(b, tmp_path / "last", {"in_features": 2, "out_features": 2}, meta={"step": 2})
    monkeypatch.setattr(ck.os, "replace", real_replace)
    assert not (tmp_path / "last").exists()                           # the state a kill leaves
    assert ck.checkpoint_exists(tmp_path / "last")                    # what a trainer asks before resuming
    assert load_checkpoint_meta(tmp_path / "last") == {"step": 1}     # the last complete one
    assert torch.equal(load_checkpoint(tmp_path / "last").weight, a.weight)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last"]     # leftovers cleaned


def test_a_finished_temporary_folder_of_a_dead_writer_wins_and_stale_ones_go(tmp_path):
    import shutil

    import wmrl.kernel.checkpoint as ck

    _, f = _lin(tmp_path, seed=1)
    dead = 2 ** 22 + 12345                                            # no such process
    shutil.copytree(f, tmp_path / f".last.tmp-{dead}")                # complete (has checksums.json)
    shutil.rmtree(f)
    half = tmp_path / f".other.tmp-{dead}"
    half.mkdir()
    (half / "config.yaml").write_text("_target_: torch.nn.Linear\n")  # a save killed half-way
    assert ck.recover_checkpoint(tmp_path / "last") == tmp_path / "last"
    assert ck.recover_checkpoint(tmp_path / "other") is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last"]


def test_overwrite_uses_the_atomic_exchange_where_there_is_one(tmp_path, monkeypatch):
    import wmrl.kernel.checkpoint as ck

    seen = []
    real = ck._exchange
    monkeypatch.setattr(ck, "_exchange", lambda x, y: seen.append(real(x, y)) or seen[-1])
    _lin(tmp_path, seed=1)
    m, _ = _lin(tmp_path, seed=2)
    assert seen == [True]                   # Linux: renameat2(RENAME_EXCHANGE), no moment without `last`
    assert torch.equal(load_checkpoint(tmp_path / "last").weight, m.weight)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last"]
