"""LatentNoisePolicy (DSRL latent-noise steering): starts as the BC policy, exact Gaussian log-probs of
the latent noise, only the noise head trains, GRPO moves the mean noise towards positive advantages,
checkpoint round trip, clear errors."""

import pytest
import torch
from test_policy import obs, stats, tiny_policy

from policies.samplers import EulerODESampler, SDESampler
from policies.steering import LatentNoisePolicy, LatentNoiseSampler
from wmrl import rl as grpo
from wmrl.kernel.checkpoint import load_checkpoint, save_checkpoint
from wmrl.kernel.interfaces import Policy


def base_policy():
    torch.manual_seed(0)
    p = tiny_policy(sampler=EulerODESampler(4, noise_scale=0.0)).set_norm_stats(stats())
    with torch.no_grad():  # leave the zero-initialised symmetric point so actions depend on the noise
        for q in p.parameters():
            q.add_(0.3 * torch.randn_like(q))
    return p.eval()


def test_starts_as_the_bc_policy_and_only_the_noise_head_trains():
    base = base_policy()
    o = obs(b=4)
    want = base.sample(o).actions
    p = LatentNoisePolicy(base, hidden=16, sampler=LatentNoiseSampler(0.0, 4))
    assert isinstance(p, Policy)
    s = p.sample(o)
    assert s.actions.shape == (4, 4, 7) and s.actions.dtype == torch.float32
    assert torch.allclose(s.actions, want, atol=1e-6)  # zero-initialised head: w = 0, the BC eval chunk
    assert torch.equal(s.extras["latent_noise"], torch.zeros(4, 4, 7))
    trainable = {n for n, q in p.named_parameters() if q.requires_grad}
    assert trainable and all(n.startswith("noise_head.") for n in trainable)
    p.sampler = LatentNoiseSampler(0.7, 4)
    a = p.sample(o, torch.Generator().manual_seed(0))
    b = p.sample(o, torch.Generator().manual_seed(0))
    c = p.sample(o, torch.Generator().manual_seed(1))
    assert torch.equal(a.actions, b.actions) and not torch.equal(a.actions, c.actions)
    assert float(a.actions.abs().max()) <= 1.0


def test_log_prob_is_the_exact_gaussian_density_of_the_latent_noise():
    p = LatentNoisePolicy(base_policy(), hidden=16, sampler=LatentNoiseSampler(0.5, 4))
    with torch.no_grad():
        for q in p.noise_head.parameters():
            q.add_(0.2 * torch.randn_like(q))
    o = obs(b=3)
    s = p.sample(o, torch.Generator().manual_seed(2))
    mean = p.mean_noise(s.extras["cond"])
    assert 0 < float(mean.detach().abs().max()) < p.bound
    lp = p.log_prob(o, s)
    d = 4 * 7
    z = (s.extras["latent_noise"] - mean) / 0.5
    manual = -0.5 * z.pow(2).flatten(1).sum(1) - d * torch.log(torch.tensor(0.5)) - 0.5 * d * torch.log(torch.tensor(2 * torch.pi))
    assert torch.allclose(lp, manual.float(), atol=1e-4)
    assert torch.allclose(lp.detach(), s.log_prob, atol=1e-5)
    # recomputing the conditioning from the observation gives the same density
    no_cond = type(s)(s.actions, s.log_prob, {k: v for k, v in s.extras.items() if k != "cond"})
    assert torch.allclose(p.log_prob(o, no_cond), lp, atol=1e-5)
    assert p.log_prob(o, s, per_step=True).shape == (3, 1)
    lp.sum().backward()
    assert p.noise_head[0].weight.grad is not None and p.noise_head[0].weight.grad.abs().sum() > 0


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_grpo_update_moves_the_mean_noise_towards_positive_advantages(sign):
    torch.manual_seed(0)
    p = LatentNoisePolicy(base_policy(), hidden=16, sampler=LatentNoiseSampler(0.5, 4))
    o = obs(b=32, seed=1)
    s = p.sample(o, torch.Generator().manual_seed(3))
    adv = sign * torch.sign(s.extras["latent_noise"][:, 0, 0])  # reward noise with a positive first coordinate
    batch = grpo.TransitionBatch(o, s, adv, torch.ones(32))
    opt = torch.optim.Adam([q for q in p.parameters() if q.requires_grad], lr=1e-2)
    cfg = grpo.GRPOConfig(group_size=4, epochs=4, minibatch_size=16, ratio="chain", clip_eps=0.2)
    before = p.mean_noise(s.extras["cond"])[:, 0, 0].mean().item()
    st = grpo.grpo_update(p, opt, batch, cfg)
    after = p.mean_noise(s.extras["cond"])[:, 0, 0].mean().item()
    assert sign * (after - before) > 0.05, (before, after)
    assert st["approx_kl"] >= 0


def test_checkpoint_round_trip_keeps_the_steering_and_evaluates_deterministically(tmp_path):
    p = LatentNoisePolicy(base_policy(), hidden=16, bound=1.2, sampler=LatentNoiseSampler(0.5, 4))
    with torch.no_grad():
        for q in p.noise_head.parameters():
            q.add_(0.2 * torch.randn_like(q))
    save_checkpoint(p, tmp_path / "ck", p.checkpoint_config())
    q = load_checkpoint(tmp_path / "ck").eval()
    assert isinstance(q, LatentNoisePolicy) and q.sampler.std == 0.0 and q.sampler.num_steps == 4 and q.bound == 1.2
    p.sampler = LatentNoiseSampler(0.0, 4)
    o = obs(b=2)
    assert torch.allclose(q.sample(o).actions, p.sample(o).actions, atol=1e-6)
    assert not torch.allclose(q.sample(o).actions, p.base.sample(o).actions, atol=1e-4)  # the steering is kept


def test_bad_configurations_raise_clear_errors():
    p = LatentNoisePolicy(base_policy(), hidden=16)
    o = obs(b=2)
    s = p.sample(o)
    with pytest.raises(ValueError, match="std > 0"):
        p.log_prob(o, s)
    p.sampler = LatentNoiseSampler(0.5, 4)
    with pytest.raises(ValueError, match="latent std"):
        p.log_prob(o, s)
    with pytest.raises(ValueError, match="not drawn by a LatentNoisePolicy"):
        p.log_prob(o, type(s)(s.actions, s.log_prob, {}))
    p.sampler = SDESampler(4, 0.5)
    with pytest.raises(ValueError, match="LatentNoiseSampler"):
        p.sample(o)
    with pytest.raises(ValueError, match="std must be >= 0"):
        LatentNoiseSampler(-1.0)
    with pytest.raises(ValueError, match="steers a flow policy"):
        LatentNoisePolicy(torch.nn.Linear(2, 2))


def test_post_train_wraps_the_checkpoint_policy_only_when_steering_is_enabled():
    from omegaconf import OmegaConf

    from wmrl.run.builders import steered_policy

    base = base_policy()
    same, cfg, rl = steered_policy(base, {"x": 1}, OmegaConf.create({"enabled": False, "std": 0.5}))
    assert same is base and cfg == {"x": 1} and rl is None
    steer = OmegaConf.create({"enabled": True, "std": 0.4, "hidden": 8, "bound": 1.0, "num_steps": 4})
    p, cfg, rl = steered_policy(base, {"x": 1}, steer)
    assert isinstance(p, LatentNoisePolicy) and p.base is base and p.bound == 1.0
    assert isinstance(rl, LatentNoiseSampler) and rl.std == 0.4 and rl.num_steps == 4
    assert cfg["_target_"] == "policies.steering.LatentNoisePolicy" and cfg["sampler"]["std"] == 0.0
    again, _, _ = steered_policy(p, cfg, steer)  # resuming from a steered checkpoint does not wrap twice
    assert again is p


def test_post_train_steering_mistakes_are_refused_with_the_fix():
    from omegaconf import OmegaConf

    from wmrl.run.builders import steered_policy

    steer = OmegaConf.create({"enabled": True, "std": 0.5, "hidden": 8, "bound": 1.0, "num_steps": 4})
    p, cfg, _ = steered_policy(base_policy(), {}, steer)
    with pytest.raises(ValueError, match="set steer.enabled=true"):
        steered_policy(p, cfg, OmegaConf.create({"enabled": False}))
    with pytest.raises(ValueError, match="steer.std must be > 0"):
        steered_policy(base_policy(), {}, OmegaConf.merge(steer, {"std": 0.0}))
    with pytest.raises(ValueError, match="noise head has"):
        steered_policy(p, cfg, OmegaConf.merge(steer, {"hidden": 16}))
    p.sampler = SDESampler(4, 0.5)
    with pytest.raises(ValueError, match="steer.enabled=true"):
        p.sample(obs(b=1))
    with pytest.raises(ValueError, match="use ratio=per_step or chain"):  # checked before any rollout
        grpo.check_policy(p, grpo.GRPOConfig(ratio="fpo"))
    grpo.check_policy(p, grpo.GRPOConfig(ratio="chain"))


def test_the_bounded_residual_starts_at_zero_stays_within_its_bound_and_has_an_exact_density(tmp_path):
    base = base_policy()
    o = obs(b=4)
    want = LatentNoisePolicy(base, hidden=16, sampler=LatentNoiseSampler(0.0, 4)).sample(o).actions
    p = LatentNoisePolicy(base, hidden=16, sampler=LatentNoiseSampler(0.0, 4), residual_bound=0.1)
    assert p.residual_dims == 6  # all but the gripper
    s = p.sample(o)
    assert torch.allclose(s.actions, want, atol=1e-6)  # zero-initialised residual head: the steered chunk
    with torch.no_grad():  # a head driven far out: tanh keeps the residual inside the bound
        p.residual_head[-1].bias.fill_(50.0)
    lifted = p.sample(o).actions
    # (clipped to the action space after the residual, so measure where the base chunk is inside it)
    inside = want[..., :6].abs() < 0.9
    assert torch.allclose((lifted - want)[..., :6][inside], torch.full_like(want[..., :6][inside], 0.1), atol=1e-5)
    assert torch.equal(lifted[..., 6], want[..., 6])  # the gripper has no residual
    p.sampler = LatentNoiseSampler(0.5, 4, residual_std=0.3)
    plain = LatentNoisePolicy(base, hidden=16, sampler=LatentNoiseSampler(0.5, 4))  # the same w from the same seed
    with torch.no_grad():
        p.residual_head[-1].bias.fill_(0.5)
    for seed in range(5):
        s = p.sample(o, torch.Generator().manual_seed(seed))
        ref = plain.sample(o, torch.Generator().manual_seed(seed)).actions
        assert ((s.actions - ref)[..., :6].abs() <= 0.1 + 1e-6).all() and (s.actions - ref).abs().max() > 0.01
        lp = p.log_prob(o, s)
        assert torch.allclose(lp, s.log_prob, atol=1e-5)
    trainable = {n.split(".")[0] for n, q in p.named_parameters() if q.requires_grad}
    assert trainable == {"noise_head", "residual_head"}
    save_checkpoint(p, tmp_path / "ck", p.checkpoint_config())
    q = load_checkpoint(tmp_path / "ck")
    assert q.residual_bound == 0.1 and torch.equal(q.residual_head[-1].bias, p.residual_head[-1].bias)
    with pytest.raises(ValueError, match="residual_bound"):
        LatentNoisePolicy(base, residual_bound=-1.0)
