"""The chunk-level value baseline (issue #21): GAE, chunk rewards, the value fit, GRPO with it."""

import pytest
import torch
from grpo_fakes import GaussianChunkPolicy, ToyReachEnv, toy_grpo_setup, toy_starts

from wmrl import rl as grpo
from wmrl.kernel.types import Rollout
from wmrl.rl.value import ValueBaseline, chunk_rewards, gae, last_alive


def test_gae_matches_a_hand_computed_example():
    r = torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.5, 9.0]])
    v = torch.tensor([[0.2, 0.5, 0.8], [0.1, 0.3, 7.0]])
    alive = torch.tensor([[True, True, True], [True, True, False]])
    adv, ret = gae(r, v, alive, gamma=0.9, lam=0.8)
    # slot 0: d2 = 1 - 0.8 = 0.2; d1 = 0.9 * 0.8 - 0.5 = 0.22; d0 = 0.9 * 0.5 - 0.2 = 0.25; gamma * lam = 0.72
    # slot 1 ends after chunk 1 (its chunk-2 reward and value are ignored): d1 = 0.5 - 0.3, d0 = 1 + 0.27 - 0.1
    want = torch.tensor([[0.25 + 0.72 * (0.22 + 0.72 * 0.2), 0.22 + 0.72 * 0.2, 0.2], [1.17 + 0.72 * 0.2, 0.2, 0.0]])
    assert torch.allclose(adv, want, atol=1e-6)
    assert torch.allclose(ret, torch.where(alive, want + v, torch.zeros(())), atol=1e-6)
    # a branch cut short: the value after its last chunk bootstraps the rest
    adv_b, _ = gae(r, v, alive, gamma=0.9, lam=0.8, bootstrap=torch.tensor([0.0, 2.0]))
    assert torch.allclose(adv_b[1], torch.tensor([1.17 + 0.72 * 2.0, 0.5 + 0.9 * 2.0 - 0.3, 0.0]), atol=1e-6)


def test_a_value_equal_to_the_return_gives_zero_advantage_and_lambda_one_gives_the_return():
    g = torch.Generator().manual_seed(0)
    r = torch.rand(5, 6, generator=g)
    alive = torch.arange(6)[None] < torch.tensor([6, 5, 3, 1, 0])[:, None]
    r_alive = r * alive
    to_go = r_alive.flip(1).cumsum(1).flip(1)  # the return from chunk n on (gamma = 1)
    for lam in (0.0, 0.5, 0.95, 1.0):
        adv, ret = gae(r, to_go, alive, gamma=1.0, lam=lam)
        assert adv.abs().max() < 1e-6 and torch.allclose(ret, to_go * alive, atol=1e-6)
    adv, _ = gae(r, torch.zeros_like(r), alive, gamma=1.0, lam=1.0)
    assert torch.allclose(adv, to_go * alive, atol=1e-6)


def test_gae_refuses_what_it_cannot_use():
    ok = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="prefix"):
        gae(torch.zeros(2, 3), torch.zeros(2, 3), torch.tensor([[True, False, True], [True, True, True]]))
    with pytest.raises(ValueError, match="same"):
        gae(torch.zeros(2, 3), torch.zeros(2, 4), ok)
    with pytest.raises(ValueError, match="gamma"):
        gae(torch.zeros(2, 3), torch.zeros(2, 3), ok, gamma=1.5)
    with pytest.raises(ValueError, match="NaN"):
        gae(torch.full((2, 3), float("nan")), torch.zeros(2, 3), ok)
    assert last_alive(torch.tensor([[True, True, False], [False, False, False]])).tolist() == [1, -1]


@pytest.mark.parametrize("mode", ["return", "success", "return+success"])
def test_chunk_rewards_sum_to_the_rollouts_reward(mode):
    g = torch.Generator().manual_seed(1)
    alive = torch.arange(4)[None] < torch.tensor([4, 2, 1])[:, None]
    ro = Rollout(obs=[], samples=[], rewards=torch.rand(3, 4, generator=g), alive=alive,
                 success=torch.tensor([True, False, True]), group_ids=torch.tensor([0, 0, 1]))
    cr = chunk_rewards(ro, mode, success_bonus=2.0)
    want, _, _ = grpo.rollout_returns([ro], mode, 2.0)
    assert torch.allclose(cr.sum(1), want, atol=1e-6) and (cr[~alive] == 0).all()
    if mode == "success":
        assert cr[0, 3] == 1 and cr[2, 0] == 1 and cr.sum() == 2


def test_the_value_fit_learns_the_returns_and_its_state_round_trips():
    g = torch.Generator().manual_seed(2)
    feats = torch.randn(64, 4, 3, generator=g)
    alive = torch.ones(64, 4, dtype=torch.bool)
    target = feats[..., 0] * 2 + 1  # a value the features determine
    vb = ValueBaseline(feature_dim=3, max_chunks=4, hidden=32, lr=1e-2, epochs=50, minibatch_size=64, seed=0)
    first = vb.fit([feats], [target], [alive])
    second = vb.fit([feats], [target], [alive])
    assert second["value_explained_var"] > 0.9 > first["value_explained_var"]
    t, m = vb.state_tensors()
    other = ValueBaseline(feature_dim=3, max_chunks=4, hidden=32, seed=5)
    other.load_state_tensors(t, m)
    assert torch.equal(other.values(feats), vb.values(feats))
    with pytest.raises(KeyError, match="no value head"):
        other.load_state_tensors({}, m)


def _gae_setup():
    pol, setup = toy_grpo_setup(advantage="gae")
    setup.value = ValueBaseline(feature_dim=6, max_chunks=3, hidden=32, seed=0)
    return pol, setup


def test_grpo_iteration_with_gae_gives_chunks_their_own_advantages():
    pol, setup = _gae_setup()
    env, opt, cfg = setup.env, setup.optimizer, setup.cfg
    res = grpo.grpo_iteration(env, pol, opt, toy_starts(2), cfg, generator=torch.Generator().manual_seed(0),
                              value=setup.value)
    st = res.stats
    assert {"value_loss", "value_explained_var", "adv_std"} <= set(st) and st["n_transitions"] > 0
    assert abs(st["adv_mean"]) < 1e-5 and abs(st["adv_std"] - 1) < 0.05  # standardised over the chunks
    with pytest.raises(ValueError, match="value baseline"):
        grpo.grpo_iteration(env, pol, opt, toy_starts(2), cfg, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="advantage"):
        grpo.GRPOConfig(advantage="td")


def test_grpo_with_gae_improves_the_toy_task():
    torch.manual_seed(0)
    pol = GaussianChunkPolicy(init_std=0.5)
    env = ToyReachEnv(num_envs=16, max_steps=16)
    opt = torch.optim.Adam(pol.parameters(), lr=0.03)
    cfg = grpo.GRPOConfig(group_size=8, max_chunks=4, epochs=2, minibatch_size=64, reward_mode="return+success",
                          advantage="gae")
    vb = ValueBaseline(feature_dim=6, max_chunks=4, hidden=64, seed=0)
    gen = torch.Generator().manual_seed(0)
    starts = toy_starts(2, tasks=("reach_a", "reach_b", "reach_c"))
    first = grpo.grpo_iteration(env, pol, opt, starts, cfg, generator=gen, value=vb).stats
    for _ in range(14):
        last = grpo.grpo_iteration(env, pol, opt, starts, cfg, generator=gen, value=vb).stats
    assert last["reward_mean"] > first["reward_mean"] + 0.3


def _train(tmp, iterations):
    pol, setup = _gae_setup()
    out = grpo.train_grpo(setup, grpo.LoopConfig(iterations, tmp, seed=3, progress=False))
    return pol, setup.value, out


def test_train_grpo_with_a_value_resumes_exactly(tmp_path):
    pol_a, vb_a, out_a = _train(tmp_path / "a", 3)
    _train(tmp_path / "b", 1)
    pol_b, vb_b, out_b = _train(tmp_path / "b", 3)
    assert out_b["resumed_from"] is not None
    for a, b in zip(list(pol_a.parameters()) + list(vb_a.module.parameters()),
                    list(pol_b.parameters()) + list(vb_b.module.parameters())):
        assert torch.equal(a, b)
    assert [h["value_loss"] for h in out_a["history"]] == [h["value_loss"] for h in out_b["history"]]


def test_branch_starts_stop_early_are_marked_cut_and_the_value_bootstraps_them():
    import dataclasses

    from wmrl.rl.value import branch_bootstrap, rollout_features

    torch.manual_seed(0)
    pol = GaussianChunkPolicy(init_std=0.01)  # barely moves: no episode ends within the chunks
    env = ToyReachEnv(num_envs=4, max_steps=40)
    starts = toy_starts(1)
    starts = [dataclasses.replace(starts[0], max_chunks=2), starts[1]]
    (ro,) = grpo.collect_groups(env, pol, starts, group_size=2, max_chunks=5, generator=torch.Generator().manual_seed(0))
    assert ro.alive.sum(1).tolist() == [2, 2, 5, 5]  # the branch's two slots stop after 2 chunks
    assert ro.cut.tolist() == [True, True, False, False] and ro.final_obs is not None
    vb = ValueBaseline(feature_dim=6, max_chunks=5, hidden=16, normalize=False, seed=0)
    with torch.no_grad():
        vb.module.net[-1].bias.fill_(0.7)
    boot = branch_bootstrap(pol, vb.module, ro)
    assert (boot[:2] != 0).all() and (boot[2:] == 0).all()
    v0 = vb.values(rollout_features(pol, ro))  # what advantages() reads, before its fit
    want, _ = gae(torch.zeros(4, 5), v0, ro.alive, vb.gamma, vb.lam, bootstrap=boot)
    (adv,), _ = vb.advantages(pol, [ro], [torch.zeros(4, 5)])
    assert torch.allclose(adv, want) and (adv[:2, 2:] == 0).all()
    assert torch.allclose(adv[:2, 1], boot[:2] - v0[:2, 1])  # the branch's last chunk: 0 + V(after) - V(it)
    with pytest.raises(ValueError, match="gae"):
        from omegaconf import OmegaConf

        from wmrl.run.grpo_job import _starts

        _starts(OmegaConf.create({"starts": {"branch_chunks": 2, "per_task": 0, "store": "x", "keyframes_per_task": 1},
                                  "grpo": {"advantage": "group"}, "seed": 0, "env": {}}), None, None, {}, 0)
