"""worldmodels.dynamics.ProprioDynamics: shapes, the commanded-target prior, learning, bad input;
``wmrl bench dynamics`` end to end on a tiny setting."""

from __future__ import annotations

import json

import pytest
import torch

from wmrl.kernel.types import PANDA_EE_YAW, PANDA_OSC_POSE
from worldmodels.dynamics import ProprioDynamics


def _state(b):
    s = torch.zeros(b, 9)
    s[:, :3] = torch.tensor([0.45, 0.0, 0.1])
    s[:, 3] = 1.0
    s[:, 7], s[:, 8] = 0.02, -0.02
    return s


def test_rollout_shapes_and_the_commanded_target_prior():
    torch.manual_seed(0)
    m = ProprioDynamics(PANDA_EE_YAW, ensemble=3, hidden=32)
    s0 = _state(2)
    a = torch.zeros(2, 5, 5)
    a[..., :3] = s0[:, None, :3] + torch.tensor([0.02, 0.0, 0.0])
    out = m.rollout(s0, a)
    assert out.shape == (3, 2, 5, 9) and m.disagreement(out).shape == (2, 5)
    # untrained, the residual is small: the arm is near the commanded target after one step
    assert (out[:, :, 0, :3] - a[None, :, 0, :3]).abs().max() < 0.01
    far = a.clone()
    far[..., 0] += 0.5  # clipped to the 5 cm box around the arm
    assert (m.commanded(s0[:, :3], far[:, 0]) - s0[:, :3])[:, 0].allclose(torch.full((2,), 0.05))
    d = ProprioDynamics(PANDA_OSC_POSE, ensemble=1, hidden=8)
    assert d.commanded(s0[:, :3], torch.ones(2, 7)).allclose(s0[:, :3] + 0.05)
    assert d.disagreement(d.rollout(s0, torch.zeros(2, 3, 7))).abs().max() == 0


def test_the_unrolled_loss_trains_the_ensemble():
    torch.manual_seed(0)
    m = ProprioDynamics(PANDA_EE_YAW, ensemble=2, hidden=32)
    # a "real" arm that reaches only 60 % of the way to each target: the prior alone is wrong
    s = _state(16)
    s[:, 0] += torch.rand(16) * 0.05
    states, acts = [s.clone(), s.clone()], []
    for _ in range(6):
        a = torch.cat([s[:, :3] + 0.03 * torch.randn(16, 3), torch.zeros(16, 1), -torch.ones(16, 1)], -1)
        s = s.clone()
        s[:, :3] = s[:, :3] + 0.6 * (a[:, :3] - s[:, :3])
        acts.append(a)
        states.append(s)
    batch = {"proprio": torch.stack(states, 1), "actions": torch.stack(acts, 1), "mask": torch.ones(2, 16)}
    opt = torch.optim.Adam(m.parameters(), lr=3e-3)
    first = m.loss(batch)[0].item()
    for _ in range(150):
        loss, metrics = m.loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.2 * first and metrics["end_pos_err_cm"] < 0.5


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="state_dim"):
        ProprioDynamics(PANDA_EE_YAW, state_dim=7)
    with pytest.raises(ValueError, match="ensemble"):
        ProprioDynamics(PANDA_EE_YAW, ensemble=0)
    with pytest.raises(ValueError, match="mode"):
        ProprioDynamics({**PANDA_EE_YAW.to_dict(), "mode": "velocity"})


def test_bench_dynamics_reports_every_horizon_and_the_gate(tmp_path):
    from wmrl.run.bench_dynamics import run
    from wmrl.run.common import RunContext
    from wmrl.run.stages import compose_stage_config

    cfg = compose_stage_config("bench_dynamics", {"episodes_per_task": 2, "holdout_every": 2, "max_chunks": 3,
                                                  "batch_size": 8, "model": {"ensemble": 2, "hidden": 16},
                                                  "train": {"steps": 5, "warmup": 1, "progress": False}},
                               groups=["suite=tiny"])
    report = run(cfg, RunContext(cfg, out_dir=tmp_path))
    assert report["control"] == "ee_target" and report["episodes"] == {"train": 2, "held_out": 2}
    h1 = report["horizons"][1]
    assert h1["model"]["count"] > 0 and set(h1) == {"model", "copy", "commanded", "disagreement", "linear"}
    assert h1["linear"]["count"] == h1["model"]["count"] and h1["linear"]["mean_cm"] >= 0
    assert isinstance(report["gate2"]["passes"], bool) and (tmp_path / "paths.png").is_file()
    json.dumps(report)


def test_a_quaternion_sign_flip_changes_neither_the_input_nor_the_loss():
    """robosuite's ``eef_quat`` flips between q and -q (one rotation) when the gripper points down;
    the model's input (rot6) and loss must not see the flip (it dominated the loss before)."""
    from worldmodels.dynamics import rot6

    q = torch.nn.functional.normalize(torch.randn(6, 4), dim=-1)
    assert torch.allclose(rot6(q), rot6(-q))
    w, x, y, z = q[0]
    r = torch.tensor([[1 - 2 * (y * y + z * z), 2 * (x * y - w * z)], [2 * (x * y + w * z), 1 - 2 * (x * x + z * z)],
                      [2 * (x * z - w * y), 2 * (y * z + w * x)]])
    assert torch.allclose(rot6(q[:1])[0], r.T.reshape(-1), atol=1e-6)   # columns 1 and 2 of R(q)
    torch.manual_seed(0)
    m = ProprioDynamics(PANDA_EE_YAW, ensemble=2, hidden=16)
    s = _state(4).unsqueeze(1).repeat(1, 5, 1)
    s[..., 3:7] = torch.tensor([0.045, 0.706, 0.706, 0.045])
    a = torch.cat([s[:, 1:4, :3] + 0.01, torch.zeros(4, 3, 1), -torch.ones(4, 3, 1)], -1)
    batch = {"proprio": s, "actions": a}
    flipped = {"proprio": s.clone(), "actions": a}
    flipped["proprio"][:, 2:, 3:7] *= -1   # the real arm's quaternion flips mid-window
    assert m.loss(batch)[0].item() == pytest.approx(m.loss(flipped)[0].item(), rel=1e-6)


def test_targets_outside_the_workspace_are_clipped_as_the_arm_control_clips_them():
    m = ProprioDynamics(PANDA_EE_YAW, ensemble=1, hidden=8)
    pos = torch.tensor([[0.45, 0.0, -0.08]])
    below = torch.tensor([[0.45, 0.0, -0.2, 0.0, 1.0]])   # under the table: z is clipped to workspace_low
    assert m.commanded(pos, below)[0, 2].item() == pytest.approx(PANDA_EE_YAW.low[2])
    custom = ProprioDynamics(PANDA_EE_YAW, ensemble=1, hidden=8, workspace_low=[0.3, -0.2, -0.05],
                             workspace_high=[0.6, 0.2, 0.3])
    assert custom.commanded(pos, below)[0, 2].item() == pytest.approx(-0.05)
    with pytest.raises(ValueError, match="workspace_low < workspace_high"):
        ProprioDynamics(PANDA_EE_YAW, workspace_low=[0.6, 0, 0], workspace_high=[0.3, 1, 1])


def test_a_world_model_with_dynamics_trains_both_parts_and_carries_their_uncertainty(tmp_path):
    """``ChunkFlowWorldModel(dynamics=...)``: one trainer step trains the frames and the ensemble (on
    its own unrolled proprio paths); imagine() gives the ensemble's proprio, the step before it and
    the members' disagreement; an old-style model (dynamics=None) is unchanged by all this."""
    from omegaconf import OmegaConf

    from worldmodels.data import EpisodeFrames
    from worldmodels.synthetic import make_episodes
    from worldmodels.train import train_world_model
    from worldmodels.video_wm import ChunkFlowWorldModel, WMState

    cfg = OmegaConf.to_container(OmegaConf.load("configs/worldmodel/tiny.yaml"))
    cfg.pop("_target_")
    cfg["dynamics"] = {"action_space": PANDA_OSC_POSE.to_dict(), "ensemble": 3, "hidden": 16}
    torch.manual_seed(0)
    wm = ChunkFlowWorldModel(**cfg)
    assert not hasattr(wm, "proprio_head") and wm.dynamics.k == 3
    frames = EpisodeFrames(make_episodes(4, length=24, size=32, seed=3))
    before = {k: v.clone() for k, v in wm.dynamics.state_dict().items()}
    rep = train_world_model(wm, cfg, frames, tmp_path, steps=4, batch_size=4, warmup=1, eval_every=1000,
                            checkpoint_every=0, progress=False, tensorboard=False,
                            dynamics={"batch_size": 8, "unroll_chunks": 2})
    assert rep["steps"] == 4
    assert any(not torch.equal(before[k], v) for k, v in wm.dynamics.state_dict().items())   # the ensemble learned
    wm.eval()
    w = frames.windows([0, 1], [3, 5], 4)
    state = WMState(w.frames.float() / 127.5 - 1, w.proprio, ["t", "t"], prev_proprio=w.prev_proprio)
    new, obs = wm.imagine(state, w.actions)
    assert new.uncertainty.shape == (2,) and (new.uncertainty >= 0).all() and new.prev_proprio.shape == (2, 9)
    assert torch.allclose(obs.proprio, new.proprio) and torch.allclose(new.proprio[:, 3:7].norm(dim=-1), torch.ones(2))
    with pytest.raises(ValueError, match="next_proprio"):
        wm.condition(w.proprio, w.actions)
    with pytest.raises(ValueError, match="D_a"):
        ChunkFlowWorldModel(**{**cfg, "action_dim": 5})


def test_world_model_action_space_comes_from_the_store(tmp_path):
    from wmrl.run.data import fill_action_space

    class Store:
        action_space, action_dim = PANDA_EE_YAW, 5

    cfg = {"action_dim": None, "action_low": None, "action_high": None, "dynamics": {"action_space": None}}
    fill_action_space(cfg, Store)
    assert cfg["action_dim"] == 5 and cfg["action_low"] == list(PANDA_EE_YAW.low)
    assert cfg["dynamics"]["action_space"]["mode"] == "absolute"
    with pytest.raises(ValueError, match="action_dim=7 differs from the store's 5"):
        fill_action_space({"action_dim": 7}, Store)


def test_the_linear_baseline_recovers_a_linear_arm_exactly():
    """On an arm that is exactly ``p' = p + 0.6 (tgt - p) + 0.2 (p - p_prev)``, the least-squares
    baseline predicts every horizon to numerical precision."""
    from types import SimpleNamespace

    from wmrl.run.bench_dynamics import linear_baseline

    m = ProprioDynamics(PANDA_EE_YAW, ensemble=1, hidden=8)
    gen = torch.Generator().manual_seed(0)

    def episode(T=40):
        p = _state(1).repeat(T, 1)
        a = torch.zeros(T, 5)
        for t in range(1, T - 1):
            a[t, :3] = p[t, :3] + 0.01 * torch.randn(3, generator=gen)   # inside the 5 cm box
            p[t + 1, :3] = p[t, :3] + 0.6 * (a[t, :3] - p[t, :3]) + 0.2 * (p[t, :3] - p[t - 1, :3])
        return SimpleNamespace(proprio=p.numpy(), actions=a.numpy())

    out = linear_baseline(m, [episode() for _ in range(3)], [episode()], chunk=4, max_chunks=3)
    assert out[1]["count"] > 0 and max(out[h]["mean_cm"] for h in (1, 2, 3)) < 1e-3


def test_closing_gap_error_looks_only_at_chunks_that_close_the_gripper():
    from omegaconf import OmegaConf

    from worldmodels.data import EpisodeFrames
    from worldmodels.evaluate import closing_gap_error
    from worldmodels.synthetic import make_episodes
    from worldmodels.video_wm import ChunkFlowWorldModel

    cfg = OmegaConf.to_container(OmegaConf.load("configs/worldmodel/tiny.yaml"))
    cfg.pop("_target_")
    wm = ChunkFlowWorldModel(**{**cfg, "stochastic": False}).eval()
    eps = make_episodes(2, length=20, size=32, seed=4)
    for e in eps:
        e.actions[:, -1] = -1.0
        e.actions[10:, -1] = 1.0            # the gripper closes at step 10: 4 windows (t = 7..10) contain it
    data = EpisodeFrames(eps)
    wm.set_norm_stats(torch.from_numpy(data.proprio), torch.from_numpy(data.proprio) * 0.1)
    out = closing_gap_error(wm, data)
    assert out["n"] == 2 * 4 and out["mae_m"] >= 0 and out["mae_copy_m"] >= 0
    for e in eps:
        e.actions[:, -1] = -1.0
    assert closing_gap_error(wm, EpisodeFrames(eps))["n"] == 0


def test_the_gripper_command_is_integrated_from_the_actions_and_carried_between_chunks():
    """``gripper_speed``: the hidden command integrates sign(gripper action) by the speed, clipped to
    [-1, 1] (robosuite's Panda gripper); its finger targets invert ``command_at_rest``; a rollout
    split in two chunks with the command carried equals the rollout in one piece."""
    m = ProprioDynamics(PANDA_EE_YAW, ensemble=2, hidden=8, gripper_speed=0.2)
    a = torch.zeros(1, 12, 5)
    a[0, :, -1] = torch.tensor([1.0] * 7 + [-0.3] * 5)
    c = m.commands(torch.tensor([0.0]), a)[0]
    assert torch.allclose(c, torch.tensor([0, .2, .4, .6, .8, 1, 1, 1, .8, .6, .4, .2, 0.0]), atol=1e-6)
    s = _state(1)
    s[:, 7:9] = m.finger_targets(torch.tensor([0.3]))
    assert torch.allclose(m.command_at_rest(s), torch.tensor([0.3]))
    s0 = _state(1)
    s0[:, :3] += 0.01
    whole, c_end = m.rollout(s0, a, return_command=True)
    first, c_mid = m.rollout(s0, a[:, :6], return_command=True)
    second = m.rollout(first[0, :, -1], a[:, 6:], first[0, :, -2], command0=c_mid)   # member 0 carried on
    assert torch.allclose(whole[0, :, 6:], second[0], atol=1e-5) and torch.allclose(c_end, c[-1:])
    assert m.rollout(s0, a, return_command=True)[1] is not None
    assert ProprioDynamics(PANDA_EE_YAW, ensemble=1, hidden=8).rollout(s0, a, return_command=True)[1] is None


def test_horizon_metrics_calibrate_the_halt_threshold_on_held_out_disagreement():
    from omegaconf import OmegaConf

    from worldmodels.data import EpisodeFrames
    from worldmodels.evaluate import horizon_metrics
    from worldmodels.synthetic import make_episodes
    from worldmodels.video_wm import ChunkFlowWorldModel

    cfg = OmegaConf.to_container(OmegaConf.load("configs/worldmodel/tiny.yaml"))
    cfg.pop("_target_")
    torch.manual_seed(0)
    wm = ChunkFlowWorldModel(**{**cfg, "dynamics": {"action_space": PANDA_OSC_POSE.to_dict(), "ensemble": 3, "hidden": 16}}).eval()
    with torch.no_grad():   # members that disagree
        for layer in wm.dynamics.layers:
            layer.weight.normal_(0, 0.5)
    data = EpisodeFrames(make_episodes(3, length=20, size=32, seed=2))
    wm.set_norm_stats(torch.from_numpy(data.proprio), torch.from_numpy(data.proprio) * 0.1 + 0.01)
    hm = horizon_metrics(wm, data, max_chunks=3, start_stride=4)
    assert len(hm["uncertainty_q99"]) == 3 and hm["halt_uncertainty_tau"] > 0
    assert max(hm["uncertainty_q99"]) == pytest.approx(hm["halt_uncertainty_tau"], rel=0.5)
    assert all(m <= q for m, q in zip(hm["uncertainty_mean"], hm["uncertainty_q99"]))
    plain = ChunkFlowWorldModel(**cfg).eval()
    plain.set_norm_stats(torch.from_numpy(data.proprio), torch.from_numpy(data.proprio) * 0.1 + 0.01)
    assert "halt_uncertainty_tau" not in horizon_metrics(plain, data, max_chunks=2, start_stride=4)
