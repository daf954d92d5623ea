"""Samplers of policies.samplers: exact chain log-probs of the SDE sampler, reproducibility of the ODE
sampler, and that both sample the right distribution for a velocity field known in closed form."""

import math

import pytest
import torch
from torch import nn

from policies.samplers import EulerODESampler, SDESampler, gaussian_log_prob, time_grid


class TinyVelocity(nn.Module):
    def __init__(self, d=3, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(d + 1, 16), nn.Tanh(), nn.Linear(16, d))

    def forward(self, x, t):
        b, h, d = x.shape
        inp = torch.cat([x, t[:, None, None].expand(b, h, 1)], -1)
        return self.net(inp)


def gaussian_data_velocity(m: float, s: float):
    """Exact velocity of the path x_t = (1-t) x0 + t eps for x0 ~ N(m, s^2) (per dimension)."""
    def v(x, t):
        t = t[:, None, None]
        var = (1 - t) ** 2 * s**2 + t**2
        x0_hat = m + (1 - t) * s**2 / var * (x - (1 - t) * m)
        eps_hat = (x - (1 - t) * x0_hat) / t
        return eps_hat - x0_hat
    return v


def test_sde_log_prob_recomputed_equals_sampling_and_ratio_is_one():
    net = TinyVelocity()
    sampler = SDESampler(num_steps=6, noise_level=0.7)
    out = sampler.sample(net, (5, 4, 3), generator=torch.Generator().manual_seed(1))
    assert out.chain.shape == (5, 7, 4, 3)
    assert torch.equal(out.chain[:, -1], out.x0)
    lp = sampler.log_prob(net, out.chain)
    assert lp.dtype == torch.float32 and lp.shape == (5,)
    assert torch.allclose(lp, out.log_prob, atol=1e-5, rtol=0)
    ratio = torch.exp(lp - out.log_prob)
    assert torch.equal(ratio, torch.ones(5))
    # differentiable in the parameters
    lp.sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in net.parameters())
    # and it changes when the parameters change
    with torch.no_grad():
        net.net[2].bias.add_(0.1)
    assert not torch.allclose(sampler.log_prob(net, out.chain), out.log_prob, atol=1e-3)


def test_sde_per_step_log_probs_sum_to_the_chain_and_ratios_are_one():
    net = TinyVelocity(seed=3)
    sampler = SDESampler(num_steps=5, noise_level=0.6)
    out = sampler.sample(net, (4, 2, 3), generator=torch.Generator().manual_seed(2))
    steps = sampler.log_prob(net, out.chain, per_step=True)
    assert steps.shape == (4, 5) and steps.dtype == torch.float32
    prior = gaussian_log_prob(out.chain[:, 0], torch.zeros_like(out.chain[:, 0]), 1.0)
    assert torch.allclose(steps.double().sum(1) + prior, out.log_prob.double(), atol=1e-4)
    assert torch.equal(torch.exp(sampler.log_prob(net, out.chain, per_step=True) - steps), torch.ones(4, 5))
    with torch.no_grad():
        net.net[2].bias.add_(0.1)
    moved = sampler.log_prob(net, out.chain, per_step=True)
    assert not torch.allclose(moved, steps, atol=1e-3)


def test_sde_init_scale_zero_starts_at_the_prior_mean_with_exact_log_probs():
    net = TinyVelocity(seed=5)
    sampler = SDESampler(num_steps=4, noise_level=0.5, init_scale=0.0)
    out = sampler.sample(net, (6, 2, 3), generator=torch.Generator().manual_seed(0))
    assert torch.equal(out.chain[:, 0], torch.zeros(6, 2, 3))
    assert torch.isfinite(out.log_prob).all()
    lp = sampler.log_prob(net, out.chain)
    assert torch.equal(torch.exp(lp - out.log_prob), torch.ones(6))
    torch.testing.assert_close(lp.double(), sampler.log_prob(net, out.chain, per_step=True).double().sum(1), atol=1e-4, rtol=0)
    assert out.x0.std() > 0.05  # the transitions still explore
    with pytest.raises(ValueError, match="init_scale"):
        SDESampler(init_scale=-1.0)


def test_sde_log_prob_matches_independent_gaussian_density():
    """One-step chain, zero velocity: mean = x - h * sigma^2/(2t) * x, std = sigma sqrt(h)."""
    sampler = SDESampler(num_steps=2, noise_level=0.5)
    zero = lambda x, t: torch.zeros_like(x)  # noqa: E731
    out = sampler.sample(zero, (4, 2, 3), generator=torch.Generator().manual_seed(0))
    ts = time_grid(2)
    expected = torch.distributions.Normal(0.0, 1.0).log_prob(out.chain[:, 0].double()).flatten(1).sum(1)
    for k in range(2):
        t, h = float(ts[k]), float(ts[k] - ts[k + 1])
        sig = 0.5 * math.sqrt(t / (1 - (float(ts[1]) if t >= 1 else t)))
        x = out.chain[:, k].double()
        mean = x - h * sig**2 / (2 * t) * x
        expected += torch.distributions.Normal(mean, sig * math.sqrt(h)).log_prob(out.chain[:, k + 1].double()).flatten(1).sum(1)
    assert torch.allclose(out.log_prob.double(), expected, atol=1e-4)


def test_sde_sampler_keeps_the_flow_marginals():
    """With the exact velocity of N(m, s^2) data, the SDE (drift correction of Flow-GRPO) must still
    end at N(m, s^2); a wrong sign of the correction term would blow the spread up or shrink it."""
    m, s = 0.7, 0.3
    v = gaussian_data_velocity(m, s)
    out = SDESampler(num_steps=100, noise_level=0.7).sample(v, (4000, 1, 2), generator=torch.Generator().manual_seed(0))
    x = out.x0.flatten()
    assert abs(float(x.mean()) - m) < 0.02
    assert abs(float(x.std()) - s) < 0.03
    ode = EulerODESampler(num_steps=100).sample(v, (4000, 1, 2), generator=torch.Generator().manual_seed(0))
    assert abs(float(ode.x0.std()) - s) < 0.03


def test_ode_sampler_reproducible_with_seed_and_exact_for_point_mass():
    net = TinyVelocity()
    ode = EulerODESampler(num_steps=5)
    a = ode.sample(net, (3, 4, 3), generator=torch.Generator().manual_seed(7)).x0
    b = ode.sample(net, (3, 4, 3), generator=torch.Generator().manual_seed(7)).x0
    c = ode.sample(net, (3, 4, 3), generator=torch.Generator().manual_seed(8)).x0
    assert torch.equal(a, b) and not torch.equal(a, c)
    target = torch.tensor([0.2, -0.4, 0.9])
    point = lambda x, t: (x - target) / t[:, None, None]  # noqa: E731  exact velocity of a point mass
    out = ode.sample(point, (2, 4, 3), generator=torch.Generator().manual_seed(0))
    assert torch.allclose(out.x0, target.expand(2, 4, 3), atol=1e-5)
    with pytest.raises(ValueError, match="no log-probability"):
        ode.log_prob(net, torch.zeros(2, 6, 4, 3))


def test_sampler_argument_errors():
    with pytest.raises(ValueError, match="noise_level"):
        SDESampler(4, noise_level=0.0)
    with pytest.raises(ValueError, match="num_steps"):
        EulerODESampler(0)
    with pytest.raises(ValueError, match="K\\+1"):
        SDESampler(4).log_prob(TinyVelocity(), torch.zeros(2, 3, 4, 3))


def test_gaussian_log_prob_against_torch():
    x, mu = torch.randn(3, 5), torch.randn(3, 5)
    ref = torch.distributions.Normal(mu.double(), 0.3).log_prob(x.double()).sum(1)
    assert torch.allclose(gaussian_log_prob(x, mu, 0.3), ref, atol=1e-9)


def test_ode_noise_scale_zero_is_deterministic_and_ignores_generator():
    net = TinyVelocity()
    ode = EulerODESampler(num_steps=4, noise_scale=0.0)
    a = ode.sample(net, (2, 4, 3), generator=torch.Generator().manual_seed(0)).x0
    b = ode.sample(net, (2, 4, 3), generator=torch.Generator().manual_seed(1)).x0
    assert torch.equal(a, b) and torch.equal(a[0], a[1])
    with pytest.raises(ValueError, match="noise_scale"):
        EulerODESampler(4, noise_scale=-1.0)


def test_sde_noise_steps_explore_early_then_follow_the_ode():
    """noise_steps=m: the first m transitions are stochastic, the rest are exactly the Euler ODE steps
    from the last stochastic state; log_prob covers only the m stochastic transitions."""
    net = TinyVelocity(seed=4)
    sampler = SDESampler(num_steps=5, noise_level=0.6, init_scale=0.0, noise_steps=2)
    out = sampler.sample(net, (6, 2, 3), generator=torch.Generator().manual_seed(3))
    chain = out.chain
    assert chain.shape == (6, 6, 2, 3)
    ts = time_grid(5)
    with torch.no_grad():
        x = chain[:, 2]
        for k in range(2, 5):  # the deterministic tail
            x = x + (ts[k + 1] - ts[k]) * net(x, ts[k].expand(6))
            assert torch.allclose(chain[:, k + 1], x, atol=1e-6)
    assert out.x0.std(0).mean() > 0.01  # still explores
    steps = sampler.log_prob(net, chain, per_step=True)
    assert steps.shape == (6, 2)
    full = SDESampler(num_steps=5, noise_level=0.6, init_scale=0.0).log_prob(net, chain, per_step=True)
    torch.testing.assert_close(steps, full[:, :2])  # the same first two transition densities
    assert torch.equal(torch.exp(sampler.log_prob(net, chain) - out.log_prob), torch.ones(6))
    torch.testing.assert_close(out.log_prob.double(), steps.double().sum(1), atol=1e-4, rtol=0)
    for bad in (0, 6):
        with pytest.raises(ValueError, match="noise_steps"):
            SDESampler(num_steps=5, noise_steps=bad)


def test_policy_log_prob_refuses_a_chain_from_another_stochastic_window():
    from policies.samplers import check_sample_extras, sample_extras

    s2 = SDESampler(num_steps=4, noise_level=0.5, noise_steps=2)
    out = s2.sample(TinyVelocity(), (3, 2, 3), generator=torch.Generator().manual_seed(0))
    extras = sample_extras(s2, out, 3, "cpu")
    assert extras["noise_steps"].tolist() == [2, 2, 2]
    check_sample_extras(s2, extras)
    with pytest.raises(ValueError, match="stochastic steps"):
        check_sample_extras(SDESampler(num_steps=4, noise_level=0.5), extras)
    with pytest.raises(ValueError, match="noise_level"):
        check_sample_extras(SDESampler(num_steps=4, noise_level=0.3, noise_steps=2), extras)


# ----------------------------------------------------------------------------- real-time chunking (policies.rtc)

def two_mode_velocity(level: float = 0.8, h: int = 16, d: int = 3):
    """Exact velocity ``E[eps - a | x_s]`` of the path ``x_s = (1 - s) a + s eps`` for data = two
    constant chunks ``+level`` / ``-level`` (equal weight)."""
    modes = torch.stack([torch.full((h, d), level), torch.full((h, d), -level)])

    def v(x, s):
        ss = s.view(-1, 1, 1).clamp_min(1e-3)
        d2 = ((x.unsqueeze(1) - (1 - s.view(-1, 1, 1, 1)) * modes[None]) ** 2).sum((2, 3))
        w = torch.softmax(-d2 / (2 * ss.view(-1, 1) ** 2), dim=1)
        return (x - (w.view(-1, 2, 1, 1) * modes[None]).sum(1)) / ss

    return v


def paper_rtc(v_tau, noise, prefix, delay, num_steps=10, beta=5.0):
    """Black et al. 2025, Algorithm 1, in the paper's time ``tau`` (``tau = 0`` noise, ``1``
    actions; ``v_tau`` points to ``a - eps``), written independently of ``policies.rtc``."""
    from policies.rtc import prefix_weights

    x = noise.clone()
    b, h, _ = x.shape
    p = prefix.shape[0]
    y = torch.zeros_like(x)
    y[:, :p] = prefix
    w = prefix_weights(h, p, delay).view(1, h, 1)
    dt = 1.0 / num_steps
    for k in range(num_steps):
        tau = k * dt
        xg = x.detach().requires_grad_(True)
        v = v_tau(xg, torch.full((b,), tau))
        a_hat = xg + (1.0 - tau) * v
        (g,) = torch.autograd.grad(a_hat, xg, grad_outputs=(y - a_hat) * w)
        r2 = (1 - tau) ** 2 / (tau ** 2 + (1 - tau) ** 2)
        gw = beta if tau <= 0 else min(beta, (1 - tau) / (tau * r2))
        x = x.detach() + dt * (v.detach() + gw * g)
    x[:, :delay] = prefix[:delay]
    return x


def test_rtc_in_the_policy_convention_equals_the_papers_algorithm():
    """``rtc_sample`` integrates ``s`` from 1 to 0 with the policy's velocity; the paper's Algorithm 1
    with ``v_tau(x, tau) = -v(x, 1 - tau)`` gives the same chunk, bit for bit."""
    from policies.rtc import rtc_sample

    v = two_mode_velocity()
    noise = torch.randn(8, 16, 3, generator=torch.Generator().manual_seed(0))
    prefix = torch.full((8, 3), 0.8)
    ours = rtc_sample(v, noise, prefix, delay=3)
    theirs = paper_rtc(lambda x, tau: -v(x, 1.0 - tau), noise, prefix, delay=3)
    assert torch.equal(ours, theirs)


def test_prefix_weights_shape():
    from policies.rtc import prefix_weights

    w = prefix_weights(16, 8, 3)
    assert w.shape == (16,) and torch.all(w[:3] == 1) and torch.all(w[8:] == 0)
    assert torch.all(w[3:8] > 0) and torch.all(w[3:8] < 1) and torch.all(torch.diff(w[3:8]) < 0)


def test_rtc_continues_the_committed_prefix():
    from policies.rtc import rtc_sample

    v = two_mode_velocity(h=16, d=7)
    noise = torch.randn(100, 16, 7, generator=torch.Generator().manual_seed(0))
    plain = rtc_sample(v, noise, None, 0)
    prefix = torch.full((8, 7), 0.8)
    guided = rtc_sample(v, noise, prefix, delay=3)
    frac_plain = (plain.mean((1, 2)) > 0).float().mean().item()
    frac_guided = (guided[:, 3:].mean((1, 2)) > 0).float().mean().item()
    assert 0.3 < frac_plain < 0.7  # the policy alone picks either mode
    assert frac_guided > 0.9  # guided by the prefix it continues the committed mode
    torch.testing.assert_close(guided[:, :3], prefix[:3].expand(100, -1, -1))
    # no prefix: the Euler ODE sampler's chunk (the same flow, the same convention)
    torch.testing.assert_close(plain, EulerODESampler(10).sample(v, noise.shape, noise=noise).x0, atol=1e-5, rtol=1e-4)


def test_rtc_guidance_weight_zero_is_plain_sampling():
    from policies.rtc import rtc_sample

    v = two_mode_velocity()
    noise = torch.randn(4, 16, 3, generator=torch.Generator().manual_seed(1))
    plain = rtc_sample(v, noise, None, 0)
    assert torch.equal(rtc_sample(v, noise, torch.full((8, 3), 0.8), delay=0, beta=0.0), plain)
    assert torch.equal(rtc_sample(v, noise, torch.zeros(0, 3), delay=0), plain)
