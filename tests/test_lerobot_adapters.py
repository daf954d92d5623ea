"""LeRobot SmolVLA / pi0 / pi0.5 behind the Policy protocol, offline with tiny random backbones:
they sample, give finite exact log-probs through the SDE sampler (ratio 1 at unchanged params,
gradients into the action expert), the ODE sampler is seeded, and the library is left unpatched."""

import sys

import numpy as np
import pytest
import torch

from policies import lerobot_adapters as L
from policies import lerobot_tiny as T
from policies.samplers import EulerODESampler, SDESampler
from wmrl.kernel.interfaces import Policy
from wmrl.kernel.storage import NormStats
from wmrl.kernel.types import AGENTVIEW, EYE_IN_HAND, Obs


def _stats():
    rng = np.random.default_rng(0)
    return NormStats.from_data({"proprio": rng.standard_normal((200, 9)), "actions": rng.uniform(-1, 1, (200, 7))})


def _obs(b=2):
    g = torch.Generator().manual_seed(0)
    return Obs({c: torch.randint(0, 256, (b, 3, 64, 64), dtype=torch.uint8, generator=g) for c in (AGENTVIEW, EYE_IN_HAND)},
               torch.randn(b, 9, generator=g), ["lift the red cube", "lift the green cube"][:b] + ["x"] * max(0, b - 2))


@pytest.fixture(scope="module", params=["smolvla", "pi0", "pi05"])
def adapter(request, tmp_path_factory):
    torch.manual_seed(0)
    if request.param == "smolvla":
        pol = T.tiny_smolvla(tmp_path_factory.mktemp("smolvlm"), sampler=SDESampler(4, 0.5))
    else:
        pol = getattr(T, f"tiny_{request.param}")(sampler=SDESampler(4, 0.5))
    return pol.set_norm_stats(_stats()).eval()


def test_adapter_sde_log_prob_exact_finite_and_differentiable(adapter):
    assert isinstance(adapter, Policy)
    adapter.sampler = SDESampler(4, 0.5)
    obs = _obs()
    s = adapter.sample(obs, torch.Generator().manual_seed(1))
    cfg = adapter.lerobot_policy.config
    assert s.actions.shape == (2, 8, 7) and float(s.actions.abs().max()) <= 1.0
    assert s.extras["chain"].shape == (2, 5, cfg.chunk_size, cfg.max_action_dim)
    assert torch.isfinite(s.log_prob).all()
    adapter.zero_grad()
    lp = adapter.log_prob(obs, s)
    assert torch.allclose(lp, s.log_prob, atol=1e-5, rtol=0)
    assert torch.equal(torch.exp(lp - s.log_prob), torch.ones(2))
    lp.sum().backward()
    proj = adapter.lerobot_policy.model.action_out_proj.weight.grad
    assert proj is not None and float(proj.abs().sum()) > 0
    # the log-prob depends on the network: perturb the action expert's output projection
    with torch.no_grad():
        adapter.lerobot_policy.model.action_out_proj.bias.add_(0.05)
    try:
        assert not torch.allclose(adapter.log_prob(obs, s), s.log_prob, atol=1e-3)
    finally:
        with torch.no_grad():
            adapter.lerobot_policy.model.action_out_proj.bias.sub_(0.05)
    # LeRobot's module is left as it was (euler_integrate restored after each capture)
    mod = sys.modules[type(adapter.lerobot_policy.model).__module__]
    from lerobot.policies.common.flow_matching import euler_integrate

    assert mod.euler_integrate is euler_integrate


def test_adapter_ode_seeded_and_instruction_matters(adapter):
    adapter.sampler = EulerODESampler(4)
    obs = _obs()
    a = adapter.sample(obs, torch.Generator().manual_seed(3))
    b = adapter.sample(obs, torch.Generator().manual_seed(3))
    c = adapter.sample(obs, torch.Generator().manual_seed(4))
    assert torch.equal(a.actions, b.actions) and not torch.equal(a.actions, c.actions)
    assert torch.equal(a.log_prob, torch.zeros(2))
    with pytest.raises(ValueError, match="stochastic sampler"):
        adapter.log_prob(obs, a)
    batch = adapter.lerobot_batch(obs)
    toks = batch["observation.language.tokens"]
    assert not torch.equal(toks[0], toks[1])  # the two instructions reach the model as different tokens


def test_adapter_input_errors(tmp_path):
    pol = T.tiny_pi0(cameras=[AGENTVIEW])
    obs = _obs(1)
    with pytest.raises(Exception, match="statistics"):
        pol.sample(obs)
    pol.set_norm_stats(_stats())
    with pytest.raises(ValueError, match="no camera"):
        pol.sample(Obs({EYE_IN_HAND: obs.images[EYE_IN_HAND]}, obs.proprio, obs.task))
    with pytest.raises(ValueError, match="not an image feature"):
        L.LeRobotFlowPolicy(pol.lerobot_policy, pol.tokenizer, {AGENTVIEW: "observation.images.front"})
