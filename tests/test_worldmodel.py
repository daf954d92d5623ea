"""World model (worldmodels.video_wm), its data windows, training loop, metrics and entry points,
on the toy two-camera episodes of worldmodels.synthetic (32x32, chunk of 4)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from wmrl.kernel.types import PANDA_OSC_POSE, Obs
from worldmodels.data import EpisodeFrames, heldout_episodes, stack_cameras
from worldmodels.evaluate import action_following, horizon_metrics
from worldmodels.synthetic import make_episodes
from worldmodels.train import (
    fit_world_model_stats,
    one_chunk_psnr,
    side_by_side_video,
    train_world_model,
)
from worldmodels.video_wm import ChunkFlowWorldModel, to_unit

TINY = OmegaConf.to_container(OmegaConf.load("configs/worldmodel/tiny.yaml"))


@pytest.fixture(scope="module")
def episodes():
    return make_episodes(10, length=24, size=32, seed=1)


@pytest.fixture(scope="module")
def frames(episodes):
    return EpisodeFrames(episodes)


def tiny_model(**over) -> ChunkFlowWorldModel:
    cfg = {**TINY, **over}
    return instantiate(cfg, _convert_="all")


def obs_of(frames: EpisodeFrames, pairs) -> Obs:
    return Obs.cat([frames.obs_at(e, t) for e, t in pairs])


def test_windows_are_aligned_with_episodes(episodes, frames):
    w = frames.windows(np.array([2, 3]), np.array([5, 0]), 4)
    assert w.frames.shape == (2, 6, 32, 32) and w.actions.shape == (2, 4, 7)
    ep = episodes[2]
    assert torch.equal(w.frames[0, :3], torch.from_numpy(ep.images["agentview"][5]))
    assert torch.equal(w.frames[0, 3:], torch.from_numpy(ep.images["robot0_eye_in_hand"][5]))
    assert torch.equal(w.next_frames[0, :3], torch.from_numpy(ep.images["agentview"][9]))
    assert np.allclose(w.actions[0].numpy(), ep.actions[5:9])
    assert np.allclose(w.next_proprio[1].numpy(), episodes[3].proprio[4])
    with pytest.raises(ValueError, match="past the end"):
        frames.windows(np.array([0]), np.array([21]), 4)
    eps, ts = frames.window_starts(4)
    assert len(eps) == 10 * (24 - 4) and ts.max() == 19


def test_heldout_split_is_deterministic_and_disjoint():
    tr, ho = heldout_episodes(12, 4)
    assert ho == [3, 7, 11] and set(tr).isdisjoint(ho) and len(tr) + len(ho) == 12
    with pytest.raises(ValueError, match="heldout_every"):
        heldout_episodes(3, 1)
    with pytest.raises(ValueError, match="held-out"):
        heldout_episodes(1, 5)


def test_untrained_model_is_copy_last_frame(frames):
    m = tiny_model()
    fit_world_model_stats(m, frames)
    obs = obs_of(frames, [(0, 0), (1, 3)])
    state = m.init(obs)
    new, pred = m.imagine(state, torch.rand(2, 4, 7) * 2 - 1, generator=torch.Generator().manual_seed(0))
    for c in m.cameras:
        assert pred.images[c].dtype == torch.uint8 and pred.images[c].shape == (2, 3, 32, 32)
        assert torch.equal(pred.images[c], obs.images[c])
    assert torch.allclose(pred.proprio, obs.proprio)
    assert pred.task == obs.task
    # the metrics see exactly the copy baseline
    hm = horizon_metrics(m, frames, max_chunks=3, start_stride=8)
    assert hm["horizon"] == [1, 2, 3]
    assert np.allclose(hm["psnr"], hm["psnr_copy"]) and np.allclose(hm["psnr_gain"], 0.0)
    assert np.allclose(hm["position_error"], hm["position_error_copy"]) and np.allclose(hm["proprio_mae"], hm["proprio_mae_copy"])
    assert action_following(m, frames, n=16)["reduction"] == pytest.approx(0.0, abs=1e-9)


def test_horizon_proprio_errors_are_measured_against_the_recorded_future(frames):
    """A model whose proprio head returns the recorded future has zero proprio error; the copy
    baseline's error is the distance to the recorded proprio k chunks later."""
    m = tiny_model()
    fit_world_model_stats(m, frames)
    H = m.chunk_size
    truth = {}
    for e in range(frames.num_episodes):
        for t in range(int(frames.lengths[e])):
            truth[tuple(np.round(frames.proprio[frames.offsets[e] + t], 6))] = (e, t)

    def oracle_delta(fr, cond):     # look the start proprio up in the data, answer its recorded change
        p = cond[:, -m.state_dim:] * m.proprio_std + m.proprio_mean
        out = []
        for row in p:
            e, t = truth[tuple(np.round(row.numpy(), 6))]
            g = frames.offsets[e] + min(t + H, int(frames.lengths[e]) - 1)
            out.append((torch.from_numpy(frames.proprio[g]) - row) / m.delta_std)
        return torch.stack(out)

    m.proprio_delta = oracle_delta
    hm = horizon_metrics(m, frames, max_chunks=3, start_stride=8, position_dims=[0, 1, 2])
    assert np.allclose(hm["position_error"], 0.0, atol=1e-5) and np.allclose(hm["proprio_mae"], 0.0, atol=1e-5)
    assert hm["position_error_copy"][0] > 0 and len(hm["proprio_mae_copy"][0]) == frames.state_dim
    assert "position_error" not in horizon_metrics(m, frames, max_chunks=1, position_dims=None)
    with pytest.raises(ValueError, match="position_dims"):
        horizon_metrics(m, frames, max_chunks=1, position_dims=[0, 99])


def test_bad_inputs_raise_clear_errors(frames):
    m = tiny_model()
    obs = obs_of(frames, [(0, 0)])
    with pytest.raises(RuntimeError, match="set_norm_stats"):
        m.imagine(m.init(obs), torch.zeros(1, 4, 7))
    fit_world_model_stats(m, frames)
    state = m.init(obs)
    with pytest.raises(ValueError, match="H=4"):
        m.imagine(state, torch.zeros(1, 8, 7))
    with pytest.raises(ValueError, match="batch"):
        m.imagine(state, torch.zeros(3, 4, 7))
    with pytest.raises(KeyError, match="robot0_eye_in_hand"):
        m.init(Obs({"agentview": obs.images["agentview"]}, obs.proprio, obs.task))
    with pytest.raises(ValueError, match="divisible"):
        ChunkFlowWorldModel(image_size=30, block_out_channels=(16, 32), norm_num_groups=8)
    with pytest.raises(ValueError, match="one resolution"):
        stack_cameras({"a": torch.zeros(1, 3, 8, 8, dtype=torch.uint8), "b": torch.zeros(1, 3, 4, 4, dtype=torch.uint8)},
                      ["a", "b"])


def test_zero_variance_proprio_gives_finite_predictions(frames):
    m = tiny_model()
    fit_world_model_stats(m, frames)          # proprio dims 2..6 are constant in the toy
    assert torch.isfinite(m.proprio_std).all() and (m.proprio_std > 0).all()
    out = m.loss(*[getattr(frames.sample_windows(8, 4, np.random.default_rng(0)), k)
                   for k in ("frames", "proprio", "actions", "next_frames", "next_proprio")])
    assert torch.isfinite(out["loss"])


@pytest.fixture(scope="module")
def trained(tmp_path_factory, frames):
    """A tiny model trained briefly on 8 toy episodes; 2 held out."""
    tr, ho = heldout_episodes(frames.num_episodes, 5)
    eps = make_episodes(10, length=24, size=32, seed=1)
    train, held = EpisodeFrames([eps[i] for i in tr]), EpisodeFrames([eps[i] for i in ho])
    torch.manual_seed(0)
    m = tiny_model()
    out = tmp_path_factory.mktemp("wm")
    rep = train_world_model(m, TINY, train, out, heldout=held, steps=120, batch_size=16, lr=3e-3, warmup=10,
                            eval_every=60, checkpoint_every=60, video_chunks=3, progress=False, resume=False)
    return m, rep, out, train, held


def test_training_beats_copy_last_frame(trained):
    m, rep, out, train, held = trained
    assert rep["steps"] == 120
    assert rep["heldout_psnr_1chunk"] > rep["heldout_psnr_copy_1chunk"] + 1.0
    assert (out / "checkpoints" / "last" / "model.safetensors").is_file()
    assert (out / "checkpoints" / "step_000060").is_dir()
    assert list((out / "videos").glob("*.mp4")) and list((out / "tb").iterdir())


def test_actions_matter_after_training(trained):
    m, _, _, _, held = trained
    af = action_following(m, held, n=32)
    assert af["mse_true"] < af["mse_mismatched"]


def test_seeded_samples_reproducible_and_diverse(trained):
    m, _, _, _, held = trained
    assert m.stochastic and m.sampling_steps == 2
    state = m.init(obs_of(held, [(0, 2)] * 2))
    a = torch.from_numpy(held.actions[2:6])[None].repeat(2, 1, 1)
    _, o1 = m.imagine(state, a, generator=torch.Generator().manual_seed(7))
    _, o2 = m.imagine(state, a, generator=torch.Generator().manual_seed(7))
    _, o3 = m.imagine(state, a, generator=torch.Generator().manual_seed(8))
    assert torch.equal(o1.images["agentview"], o2.images["agentview"])
    assert not torch.equal(o1.images["agentview"], o3.images["agentview"])
    # deterministic path: the generator is ignored
    m.stochastic = False
    try:
        _, d1 = m.imagine(state, a, generator=torch.Generator().manual_seed(1))
        _, d2 = m.imagine(state, a, generator=torch.Generator().manual_seed(2))
        assert torch.equal(d1.images["agentview"], d2.images["agentview"])
    finally:
        m.stochastic = True


def test_checkpoint_roundtrip_and_resume(trained, tmp_path):
    from wmrl.kernel.checkpoint import load_checkpoint

    m, _, out, train, held = trained
    loaded = load_checkpoint(out / "checkpoints" / "last").eval()
    m.stochastic = loaded.stochastic = False
    try:
        st = m.init(obs_of(held, [(1, 0)]))
        a = torch.from_numpy(held.actions[0:4])[None]
        assert torch.equal(m.imagine(st, a)[1].images["agentview"], loaded.imagine(loaded.init(obs_of(held, [(1, 0)])), a)[1].images["agentview"])
    finally:
        m.stochastic = loaded.stochastic = True
    # resume: a fresh model object picks up at the saved step and continues to the new total
    rep = train_world_model(tiny_model(), TINY, train, out, steps=130, batch_size=8, checkpoint_every=100,
                            progress=False, resume=True, tensorboard=False)
    assert rep["resumed_from"] == 120 and rep["steps"] == 130 and rep["steps_this_run"] == 10


def test_side_by_side_video(trained, tmp_path):
    m, _, _, _, held = trained
    v = side_by_side_video(m, held, 0, 3, tmp_path / "v.mp4")
    assert v.shape == (4, 32, 4 * 32, 3) and v.dtype == np.uint8
    # first frame: real and imagined are the same real frame
    assert np.array_equal(v[0, :, :32], v[0, :, 32:64])
    assert (tmp_path / "v.mp4").stat().st_size > 0


def test_one_chunk_psnr_matches_torchmetrics(trained):
    from worldmodels.evaluate import torchmetrics_psnr

    m, _, _, _, held = trained
    w = held.sample_windows(16, 4, np.random.default_rng(0))
    base01 = (to_unit(w.frames) + 1) / 2
    tgt01 = (to_unit(w.next_frames) + 1) / 2
    _, p_copy = one_chunk_psnr(m, held, n=16, seed=0)
    assert p_copy == pytest.approx(torchmetrics_psnr(base01, tgt01), abs=1e-3)


def _toy_store(path, n=10):
    from wmrl.kernel.storage import EpisodeStore

    store = EpisodeStore.create(path, cameras={"agentview": (32, 32), "robot0_eye_in_hand": (32, 32)},
                                state_dim=9, action_dim=7, fps=20, action_space=PANDA_OSC_POSE, embodiment="toy",
                                source="synthetic")
    for ep in make_episodes(n, length=24, size=32, seed=3):
        store.append(ep)
    return path


def _compose(name, overrides):
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="configs", version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


def test_imagined_frame_bank_rolls_the_model_from_real_frames(frames):
    """An untrained model is copy-last-frame, so every bank frame is the real frame k chunks
    before the step it stands for (k in 1..max_chunks), with that frame's proprio."""
    from worldmodels.train import imagined_frame_bank

    m = tiny_model()
    fit_world_model_stats(m, frames)
    H = m.chunk_size
    imgs, prop, flat = imagined_frame_bank(m, frames, 40, 2, np.random.default_rng(0), batch_size=16, progress=False)
    assert imgs.shape == (40, *frames.images.shape[1:]) and imgs.dtype == np.uint8
    assert prop.shape == (40, frames.state_dim) and flat.dtype == np.int64
    ks = set()
    for i in range(40):
        match = [k for k in (1, 2) if np.array_equal(imgs[i], frames.images[flat[i] - k * H])]
        assert match, f"bank frame {i} is not a real frame 1-2 chunks before its step"
        ks.add(match[0])
        np.testing.assert_allclose(prop[i], frames.proprio[flat[i] - match[0] * H], atol=1e-5)
    assert ks == {1, 2}
    with pytest.raises(ValueError, match="cameras"):
        imagined_frame_bank(tiny_model(cameras=["robot0_eye_in_hand", "agentview"]), frames, 4, 1,
                            np.random.default_rng(0), progress=False)


def test_entry_points_train_and_evaluate(tmp_path):
    from wmrl.run import evaluate_worldmodel, train_critic, train_worldmodel
    from wmrl.run.common import RunContext

    store = _toy_store(tmp_path / "store")
    cfg = _compose("train_worldmodel", ["worldmodel=tiny", f"store={store}", "num_threads=1", "progress=false",
                                        "train.steps=20", "train.batch_size=8", "train.eval_every=10",
                                        "train.checkpoint_every=10", "train.video_chunks=2", "train.max_minutes=null"])
    rep = train_worldmodel.run(cfg, RunContext(cfg, out_dir=tmp_path / "wm"))
    assert rep["steps"] == 20 and rep["train_episodes"] == 8 and rep["heldout_episodes"] == 2
    hh = rep["heldout_horizons"]                       # eval_horizon_chunks: 8 by default, fewer fit the toy episodes
    assert hh["horizon"][0] == 1 and len(hh["position_error_m"]) == len(hh["horizon"]) == len(hh["psnr_gain_db"])
    assert all(np.isfinite(hh["position_error_m"])) and hh["position_error_copy_m"][0] > 0
    ccfg = _compose("train_critic", ["critic=tiny", f"store={store}", "num_threads=1", "progress=false",
                                     "train.steps=20", "train.batch_size=16", "train.success_tail=4",
                                     "train.max_minutes=null"])
    crep = train_critic.run(ccfg, RunContext(ccfg, out_dir=tmp_path / "cr"))
    assert crep["steps"] == 20 and "auroc" in crep["heldout"] and crep["imagined_bank"] == 0
    icfg = _compose("train_critic", ["critic=tiny", f"store={store}", "num_threads=1", "progress=false",
                                     "train.steps=5", "train.batch_size=16", "train.success_tail=4",
                                     "train.max_minutes=null", f"imagined.world_model={tmp_path / 'wm/checkpoints/last'}",
                                     "imagined.bank_size=20", "imagined.max_chunks=2"])
    irep = train_critic.run(icfg, RunContext(icfg, out_dir=tmp_path / "cr_im"))
    assert irep["steps"] == 5 and irep["imagined_bank"] == 20
    ecfg = _compose("evaluate_worldmodel", [f"store={store}", f"world_model={tmp_path / 'wm/checkpoints/last'}",
                                            f"critic_checkpoint={tmp_path / 'cr/checkpoints/last'}", "max_chunks=3",
                                            "num_threads=1"])
    erep = evaluate_worldmodel.run(ecfg, RunContext(ecfg, out_dir=tmp_path / "ev"))
    assert erep["horizons"]["horizon"] == [1, 2, 3]
    assert set(erep["acceptance"]) >= {"psnr_1chunk_gain_db>=3", "action_following_reduction>=0.2"}
    assert {"closing_gap", "grasp_outcome"} <= set(erep) and erep["grasp_outcome"]["n"] >= 0
    # a store without the configured cameras is refused with a message naming them
    bad = _compose("train_worldmodel", ["worldmodel=tiny", f"store={store}", "worldmodel.cameras=[agentview,frontview]"])
    with pytest.raises(ValueError, match="frontview"):
        train_worldmodel.run(bad, RunContext(bad, out_dir=tmp_path / "bad"))


def test_step_schedule_makes_training_reproducible(tmp_path, frames, monkeypatch):
    """With ``lr_follows_budget=False`` the LR follows the steps only: two runs with the same seed give
    bitwise equal weights even when the clock runs differently (here: one run's clock is made to
    jump, which with the time-following schedule changes its LR)."""
    import worldmodels.train as wt

    def run(tag, lr_follows_budget, slow):
        if slow:
            t = iter(range(0, 10 ** 6, 7))   # each clock read 7 s later: 1-minute budget reached in ~9 reads
            monkeypatch.setattr(wt.BudgetClock, "elapsed", lambda self: float(next(t)) * 0.1)
        else:
            monkeypatch.setattr(wt.BudgetClock, "elapsed", lambda self: 0.0)
        torch.manual_seed(0)
        m = tiny_model()
        train_world_model(m, TINY, frames, tmp_path / tag, steps=6, batch_size=4, lr=3e-3, warmup=1,
                          max_minutes=1.0, checkpoint_every=100, eval_every=100, progress=False, resume=False,
                          tensorboard=False, lr_follows_budget=lr_follows_budget)
        return {k: v.clone() for k, v in m.state_dict().items()}

    a, b = run("a", False, False), run("b", False, True)
    assert all(torch.equal(a[k], b[k]) for k in a)
    c, d = run("c", True, False), run("d", True, True)
    assert any(not torch.equal(c[k], d[k]) for k in c)
