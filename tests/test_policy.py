"""FlowVLAPolicy: Policy protocol, exact SDE log-probs through the real network, seeded ODE sampling,
normalisation and action-space handling, BC training (instruction following on a toy store),
checkpoint round trip and resume."""

import os

import numpy as np
import pytest
import torch

from policies.action_space import ActionConverter, action_space_for, clip_to_space
from policies.flow_vla import FlowVLAPolicy
from policies.samplers import EulerODESampler, SDESampler
from policies.train import save_policy, train_bc
from wmrl.kernel.checkpoint import load_checkpoint
from wmrl.kernel.interfaces import Policy
from wmrl.kernel.storage import (
    EpisodeStore,
    MissingStatsError,
    NormStats,
    WindowDataset,
)
from wmrl.kernel.types import PANDA_OSC_POSE, ActionSpace, Episode, Obs

CAM = "agentview"
INSTR_A, INSTR_B = "lift the red cube", "lift the green cube"


def tiny_policy(**kw) -> FlowVLAPolicy:
    args = dict(cameras=[CAM], image_size=[16, 16], state_dim=9, action_dim=7, chunk_size=4,
                encoder={"kind": "conv", "channels": [8, 16], "out_dim": 16}, lang_dim=16, proprio_dim=8,
                cond_dim=32, head_width=32, head_depth=1, time_dim=16, train_noise_samples=4, aug_shift=1)
    args.update(kw)
    return FlowVLAPolicy(**args)


def stats(scale=1.0) -> NormStats:
    rng = np.random.default_rng(0)
    return NormStats.from_data({"proprio": rng.standard_normal((500, 9)),
                                "actions": np.clip(scale * rng.standard_normal((500, 7)), -1, 1)})


def obs(b=3, seed=0, task=INSTR_A) -> Obs:
    g = torch.Generator().manual_seed(seed)
    return Obs({CAM: torch.randint(0, 256, (b, 3, 16, 16), generator=g, dtype=torch.uint8)},
               torch.randn(b, 9, generator=g), [task] * b)


def test_protocol_shapes_bounds_and_seeded_ode():
    p = tiny_policy().set_norm_stats(stats(scale=3.0)).eval()
    assert isinstance(p, Policy)
    o = obs()
    s1 = p.sample(o, torch.Generator().manual_seed(0))
    s2 = p.sample(o, torch.Generator().manual_seed(0))
    s3 = p.sample(o, torch.Generator().manual_seed(1))
    assert s1.actions.shape == (3, 4, 7) and s1.actions.dtype == torch.float32
    assert torch.equal(s1.actions, s2.actions) and not torch.equal(s1.actions, s3.actions)
    assert torch.equal(s1.log_prob, torch.zeros(3))
    assert float(s1.actions.abs().max()) <= 1.0  # clipped to the declared action space
    with pytest.raises(ValueError, match="stochastic sampler"):
        p.log_prob(o, s1)


def test_sde_log_prob_exact_through_policy_and_differentiable():
    p = tiny_policy().set_norm_stats(stats()).eval()
    with torch.no_grad():  # FiLM and the output layer start at zero: leave that symmetric point
        for q in p.parameters():
            q.add_(0.1 * torch.randn_like(q))
    p.sampler = SDESampler(num_steps=5, noise_level=0.5)
    o = obs(b=4)
    s = p.sample(o, torch.Generator().manual_seed(3))
    assert s.extras["chain"].shape == (4, 6, 4, 7)
    lp = p.log_prob(o, s)
    assert torch.allclose(lp, s.log_prob, atol=1e-5, rtol=0)
    assert torch.equal(torch.exp(lp - s.log_prob), torch.ones(4))
    lp.sum().backward()
    grads = [q.grad for q in p.encoders.parameters() if q.grad is not None]
    assert grads and sum(float(g.abs().sum()) for g in grads) > 0  # reaches the image encoder
    # the log-prob is of the pre-clip normalised chain; final actions are its unnormalised end, clipped
    x0 = p.normalizer.unnormalize("actions", s.extras["chain"][:, -1])
    assert torch.allclose(s.actions, x0.clamp(-1, 1))
    # another instruction is another distribution
    o_b = Obs(o.images, o.proprio, [INSTR_B] * 4)
    with torch.no_grad():
        for q in p.parameters():
            q.add_(0.05 * torch.randn_like(q))
    assert not torch.allclose(p.log_prob(o_b, s), s.log_prob, atol=1e-3)
    p.sampler = SDESampler(num_steps=5, noise_level=0.3)
    with pytest.raises(ValueError, match="noise_level"):
        p.log_prob(o, s)


def test_bad_inputs_raise_clear_errors():
    p = tiny_policy()
    with pytest.raises(MissingStatsError):
        p.sample(obs())
    p.set_norm_stats(stats())
    bad = Obs({"robot0_eye_in_hand": torch.zeros(1, 3, 16, 16, dtype=torch.uint8)}, torch.zeros(1, 9), ["x"])
    with pytest.raises(ValueError, match="no camera 'agentview'"):
        p.sample(bad)
    big = Obs({CAM: torch.zeros(1, 3, 32, 32, dtype=torch.uint8)}, torch.zeros(1, 9), ["x"])
    with pytest.raises(ValueError, match="16, 16"):
        p.sample(big)
    with pytest.raises(ValueError, match="encoder.kind"):
        tiny_policy(encoder={"kind": "vit"})
    with pytest.raises(ValueError, match="action_space.dim"):
        tiny_policy(action_space=ActionSpace(dim=6))


def test_action_space_conventions():
    assert action_space_for("panda") == PANDA_OSC_POSE
    with pytest.raises(KeyError, match="declared ones"):
        action_space_for("ur5")
    flipped = ActionSpace(gripper_open=1.0, gripper_close=-1.0)
    conv = ActionConverter(PANDA_OSC_POSE, flipped)
    a = torch.tensor([[0.1, 0.2, 0.3, 0.0, 0.0, 0.0, -1.0], [0, 0, 0, 0, 0, 0, 1.0]])
    out = conv(a)
    assert torch.equal(out[:, -1], torch.tensor([1.0, -1.0])) and torch.equal(out[:, :6], a[:, :6])
    zero_one = ActionSpace(gripper_open=0.0, gripper_close=1.0, low=-1.0, high=1.0)
    assert torch.allclose(ActionConverter(PANDA_OSC_POSE, zero_one)(a)[:, -1], torch.tensor([0.0, 1.0]))
    assert ActionConverter("panda", PANDA_OSC_POSE.to_dict()).is_identity
    with pytest.raises(ValueError, match="'mode'"):
        ActionConverter(PANDA_OSC_POSE, ActionSpace(mode="absolute"))
    with pytest.raises(ValueError, match="'rotation'"):
        ActionConverter(PANDA_OSC_POSE, ActionSpace(rotation="quat_wxyz"))
    assert float(clip_to_space(torch.full((2, 7), 3.0), PANDA_OSC_POSE).max()) == 1.0


# ----------------------------------------------------------------------------- BC on a toy store

def toy_store(path, n_eps=6, T=12) -> EpisodeStore:
    """Same random scene for both instructions; the expert moves +x for A and -x for B."""
    store = EpisodeStore.create(path, cameras={CAM: (16, 16)}, state_dim=9, action_dim=7, fps=20,
                                action_space=PANDA_OSC_POSE, embodiment="panda", source="synthetic")
    rng = np.random.default_rng(0)
    for i in range(n_eps):
        instr = INSTR_A if i % 2 == 0 else INSTR_B
        sign = 1.0 if instr == INSTR_A else -1.0
        actions = np.zeros((T, 7), np.float32)
        actions[:, 0] = 0.6 * sign
        actions[:, 6] = -1.0
        actions[:, 1] = rng.uniform(-0.1, 0.1, T)
        store.append(Episode(images={CAM: rng.integers(0, 256, (T, 3, 16, 16), dtype=np.uint8)},
                             proprio=rng.standard_normal((T, 9)).astype(np.float32), actions=actions,
                             rewards=np.zeros(T, np.float32), success=True, instruction=instr,
                             task_name="toy_a" if sign > 0 else "toy_b"))
    return store


def test_bc_follows_instruction_checkpoint_roundtrip_and_resume(tmp_path):
    torch.manual_seed(0)
    store = toy_store(tmp_path / "store")
    ds = WindowDataset(store, n_obs=1, horizon=4)
    p = tiny_policy().set_norm_stats(store.stats())
    cfg = dict(steps=150, batch_size=32, lr=3e-3, warmup_steps=10, ckpt_every=100, log_every=10, ema_decay=0.9)
    rep = train_bc(p, ds, cfg, tmp_path / "run", val_dataset=ds)
    assert rep["steps"] == 150 and np.isfinite(rep["final_loss"]) and np.isfinite(rep["val_loss"])
    assert (tmp_path / "run" / "checkpoints" / "step_100").is_dir()
    assert list((tmp_path / "run" / "tb").iterdir())
    loaded = load_checkpoint(tmp_path / "run" / "checkpoints" / "last").eval()
    assert isinstance(loaded, FlowVLAPolicy) and isinstance(loaded.sampler, EulerODESampler)
    # instruction following: same images/proprio, the instruction flips the x motion
    o = obs(b=8, seed=5)
    a = loaded.sample(o, torch.Generator().manual_seed(0)).actions
    b = loaded.sample(Obs(o.images, o.proprio, [INSTR_B] * 8), torch.Generator().manual_seed(0)).actions
    assert float(a[..., 0].mean()) > 0.3 and float(b[..., 0].mean()) < -0.3
    # checkpoint round trip keeps the samples (EMA weights + normalisation buffers)
    save_policy(loaded, tmp_path / "again")
    again = load_checkpoint(tmp_path / "again").eval()
    assert torch.equal(again.sample(o, torch.Generator().manual_seed(0)).actions, a)
    # resume continues from `last`
    rep2 = train_bc(p, ds, {**cfg, "steps": 160}, tmp_path / "run")
    assert rep2["resumed_from"] is not None and rep2["steps"] == 160
    # padded actions (past the episode end) do not enter the loss
    batch = ds.get_batch(np.arange(len(ds)))
    batch["actions"] = torch.where(batch["action_pad"][..., None], torch.full_like(batch["actions"], 1e6),
                                   batch["actions"])
    loss, _ = p.loss(batch, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(loss) and float(loss.detach()) < 100


def test_train_policy_entry_point(tmp_path):
    from hydra import compose, initialize_config_module

    from wmrl.run import train_policy
    from wmrl.run.common import RunContext

    toy_store(tmp_path / "store", n_eps=4, T=10)
    with initialize_config_module("configs", version_base="1.3"):
        cfg = compose("train_policy", overrides=[f"store={tmp_path / 'store'}", "policy=tiny", "steps=6",
                                                 "train.log_every=2", "val_every_nth_episode=2", "num_threads=1"])
    ctx = RunContext(cfg, out_dir=tmp_path / "run")
    rep = train_policy.run(cfg, ctx)
    assert rep["steps"] == 6 and rep["train_episodes"] == 2 and rep["val_episodes"] == 2
    assert rep["tasks"] == ["toy_a", "toy_b"]
    pol = load_checkpoint(tmp_path / "run" / "checkpoints" / "last")
    assert pol.cameras == [CAM] and pol.image_size == [16, 16] and pol.chunk_size == 4
    assert pol.sample(obs(b=2)).actions.shape == (2, 4, 7)
    with initialize_config_module("configs", version_base="1.3"):
        bad = compose("train_policy", overrides=[f"store={tmp_path / 'store'}", "policy=tiny",
                                                 "policy.cameras=[robot0_eye_in_hand]"])
    with pytest.raises(ValueError, match="not in the store"):
        train_policy.run(bad, RunContext(bad, out_dir=tmp_path / "bad"))


def test_bench_policy_reports_figures(tmp_path):
    from hydra import compose, initialize_config_module

    from wmrl.run import bench_policy
    from wmrl.run.common import RunContext

    with initialize_config_module("configs", version_base="1.3"):
        cfg = compose("bench_policy", overrides=["policy=tiny", "inference_runs=2", "train_steps=2", "batch_size=4",
                                                 "image_size=[16,16]", "cameras=[agentview]"])
        cfg.neighbour.steps, cfg.neighbour.cases = 2, ["defaults"]
    rep = bench_policy.run(cfg, RunContext(cfg, out_dir=tmp_path))
    for k in ("ode", "sde"):
        assert rep["inference_ms"][k]["median"] > 0 and rep["inference_ms"][k]["num_steps"] == 4
    assert rep["bc"]["estimated_bc_minutes"] > 0
    for mode, bf16 in (("fp32", False), ("bf16", True)):
        assert rep["bc"][mode]["bf16"] is bf16 and rep["bc"][mode]["samples_per_s"] > 0
    assert rep["bc"]["default"]["bf16"] == (rep["bc"]["precision"]["dtype"] == "bf16")
    assert rep["bc"]["default_over_fp32"] > 0
    if len(os.sched_getaffinity(0)) < 2:   # a one-core machine (or taskset) has no neighbour core
        assert rep["neighbour"] == {"skipped": "one core available"}
        return
    nb = rep["neighbour"]["defaults"]     # fresh processes, one beside a busy core
    assert nb["alone"]["steps_per_s"] > 0 and nb["with_neighbour"]["steps_per_s"] > 0 and nb["ratio"] > 0
    assert nb["alone"]["num_threads"] >= 1 and "num_threads=auto" in nb["alone"]["threads_reason"]


def test_checkpoint_config_keeps_the_sampler(tmp_path):
    from policies.train import policy_checkpoint_config

    p = tiny_policy(sampler=EulerODESampler(3, noise_scale=0.0)).set_norm_stats(stats())
    assert policy_checkpoint_config(p)["sampler"] == {"_target_": "policies.samplers.EulerODESampler",
                                                      "num_steps": 3, "noise_scale": 0.0}
    save_policy(p, tmp_path / "ck")
    q = load_checkpoint(tmp_path / "ck")
    assert q.sampler.noise_scale == 0.0 and q.sampler.num_steps == 3
    p.sampler = SDESampler(5, 0.3)
    assert policy_checkpoint_config(p)["sampler"]["noise_level"] == 0.3
    assert "noise_steps" not in policy_checkpoint_config(p)["sampler"]
    p.sampler = SDESampler(5, 0.3, noise_steps=2)
    save_policy(p, tmp_path / "ck_window")
    assert load_checkpoint(tmp_path / "ck_window").sampler.noise_steps == 2


def test_episodes_per_task_keeps_the_first_n_of_each_task():
    from wmrl.run.train_policy import cap_episodes_per_task

    names = ["a", "b", "a", "a", "b", "c"]
    eps = np.arange(len(names))
    assert cap_episodes_per_task(eps, names, None).tolist() == [0, 1, 2, 3, 4, 5]
    assert cap_episodes_per_task(eps, names, 1).tolist() == [0, 1, 5]
    assert cap_episodes_per_task(eps, names, {"a": 2}).tolist() == [0, 1, 2, 4, 5]
    assert cap_episodes_per_task(eps[[3, 4, 5]], names, {"a": 0, "b": 1}).tolist() == [4, 5]
    with pytest.raises(ValueError, match="does not have"):
        cap_episodes_per_task(eps, names, {"z": 1})
    with pytest.raises(ValueError, match=">= 0"):
        cap_episodes_per_task(eps, names, -1)
