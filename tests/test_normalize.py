"""NormStats / Normalizer: finite for zero-variance dims both ways (real lift actions), round trips,
serialisation, and a clear error when statistics are missing."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from wmrl.kernel.storage import MissingStatsError, Normalizer, NormStats

LIFT = "robosuite_demos/rs1.4.1_lift_panda/demo.hdf5"


@pytest.fixture(scope="module")
def lift_actions(shared_data):
    h5py = pytest.importorskip("h5py")
    with h5py.File(shared_data / LIFT, "r") as f:
        keys = sorted(f["data"].keys(), key=lambda k: int(k.split("_")[1]))
        return np.concatenate([f["data"][k]["actions"][:] for k in keys]).astype(np.float32)


@pytest.mark.parametrize("mode", ["mean_std", "quantile"])
def test_lift_rotation_dims_3_4_normalise_finite_both_ways(lift_actions, mode):
    a = lift_actions
    assert a.shape == (482 + 510 + 392, 7)
    assert np.all(a[:, 3:5] == 0)  # the real data's zero-variance dims
    st = NormStats.from_data({"actions": a})
    assert np.all(st.stats["actions"]["std"][3:5] == 0)
    y = st.normalize("actions", a, mode=mode)
    assert np.isfinite(y).all()
    assert np.all(y[:, 3:5] == 0)
    back = st.unnormalize("actions", y, mode=mode)
    assert np.isfinite(back).all()
    np.testing.assert_allclose(back, a, atol=1e-5)
    # arbitrary model outputs (e.g. noise from a sampler) also map back to finite values
    z = np.random.default_rng(0).standard_normal((100, 7)).astype(np.float32) * 3
    assert np.isfinite(st.unnormalize("actions", z, mode=mode)).all()
    # torch path and the Normalizer module agree
    yt = st.normalize("actions", torch.from_numpy(a), mode=mode)
    np.testing.assert_allclose(yt.numpy(), y, atol=1e-6)
    norm = Normalizer({"actions": 7}, mode=mode, stats=st)
    yn = norm.normalize("actions", torch.from_numpy(a))
    assert torch.isfinite(yn).all()
    np.testing.assert_allclose(yn.numpy(), y, atol=1e-6)
    np.testing.assert_allclose(norm.unnormalize("actions", yn).numpy(), a, atol=1e-5)


def test_quantile_maps_q01_q99_to_pm1_and_mean_std_to_unit():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5000, 3)) * [1, 10, 0.1] + [0, 5, -2]
    st = NormStats.from_data({"proprio": x})
    q = st.stats["proprio"]
    np.testing.assert_allclose(st.normalize("proprio", q["q01"][None], mode="quantile"), -1, atol=1e-5)
    np.testing.assert_allclose(st.normalize("proprio", q["q99"][None], mode="quantile"), 1, atol=1e-5)
    y = st.normalize("proprio", x)
    np.testing.assert_allclose(y.mean(0), 0, atol=1e-4)
    np.testing.assert_allclose(y.std(0), 1, atol=1e-4)


def test_serialisation_round_trips():
    x = np.random.default_rng(1).standard_normal((50, 4)).astype(np.float32)
    x[:, 2] = 0.5
    st = NormStats.from_data({"proprio": x, "actions": x[:, :3]})
    d = json.loads(json.dumps(st.to_dict()))
    st2 = NormStats.from_dict(d)
    st3 = NormStats.from_tensors(st.to_tensors(prefix="norm."), prefix="norm.")
    for other in (st2, st3):
        assert other.keys == st.keys
        for k in st.keys:
            for n, v in st.stats[k].items():
                np.testing.assert_array_equal(other.stats[k][n], v)
    assert st2.count == {"proprio": 50, "actions": 50}


def test_missing_statistics_raise():
    st = NormStats.from_data({"actions": np.zeros((4, 7))})
    with pytest.raises(MissingStatsError, match="'proprio'"):
        st.normalize("proprio", np.zeros((2, 9)))
    assert issubclass(MissingStatsError, ValueError)
    norm = Normalizer({"actions": 7, "proprio": 9})
    with pytest.raises(MissingStatsError, match="set_stats"):
        norm.normalize("actions", torch.zeros(2, 7))
    with pytest.raises(MissingStatsError, match="lacks"):
        NormStats.from_dict({"actions": {"mean": [0.0], "std": [1.0]}})
    with pytest.raises(MissingStatsError):
        NormStats.from_tensors({"other.x": torch.zeros(3)}, prefix="norm.")
    with pytest.raises(ValueError, match="dim"):
        st.normalize("actions", np.zeros((2, 6)))
    with pytest.raises(ValueError, match="non-finite"):
        NormStats.from_data({"actions": np.array([[0.0], [np.nan]])})


def test_normalizer_buffers_travel_in_state_dict():
    st = NormStats.from_data({"actions": np.random.default_rng(2).standard_normal((30, 7))})
    a = Normalizer({"actions": 7}, stats=st)
    b = Normalizer({"actions": 7})
    b.load_state_dict(a.state_dict())
    x = torch.randn(3, 7)
    assert torch.equal(a.normalize("actions", x), b.normalize("actions", x))


@pytest.mark.parametrize("mode", ["mean_std", "quantile"])
def test_near_constant_dims_do_not_blow_up(mode):
    rng = np.random.default_rng(3)
    x = np.zeros((200, 3), np.float32)
    x[:, 0] = rng.standard_normal(200)
    x[:, 1] = 0.25 + 1e-7 * rng.standard_normal(200)  # float jitter around a constant
    x[:, 2] = -3.0
    st = NormStats.from_data({"proprio": x})
    y = st.normalize("proprio", x, mode=mode)
    assert np.abs(y[:, 1:]).max() < 1e-3  # treated as constant: maps to ~0, not to +-1e3
    np.testing.assert_allclose(st.unnormalize("proprio", y, mode=mode), x, atol=1e-5)
    np.testing.assert_allclose(st.unnormalize("proprio", np.ones((1, 3)), mode=mode)[0, 1:], [1.25, -2.0], atol=1e-5)
