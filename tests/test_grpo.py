"""GRPO math, rollout collection and update on a fake ChunkEnv."""

import copy
import math

import pytest
import torch
from grpo_fakes import GaussianChunkPolicy, ToyReachEnv, toy_grpo_setup, toy_starts

from wmrl import rl as grpo
from wmrl.kernel.interfaces import ChunkEnv, Policy


def test_grouped_and_interleaved_give_same_advantages():
    r = torch.tensor([[1.0, 1, 1, 1], [0, 0, 0, 1]])
    adv2, valid2 = grpo.group_advantages(r)
    flat = torch.tensor([1.0, 0, 1, 0, 1, 0, 1, 1])
    ids = torch.tensor([0, 1, 0, 1, 0, 1, 0, 1])
    adv1, valid1 = grpo.group_advantages(flat, ids)
    assert torch.equal(adv1[ids == 0], adv2[0]) and torch.equal(adv1[ids == 1], adv2[1])
    assert torch.equal(valid1[ids == 1], valid2[1])
    # group 1: mean 0.25, population std sqrt(3)/4
    s = math.sqrt(3) / 4
    assert torch.allclose(adv2[1], torch.tensor([-0.25 / s] * 3 + [0.75 / s]))
    assert adv2[0].eq(0).all() and not valid2[0].any() and valid2[1].all()


def test_all_equal_group_is_exactly_zero_and_left_out():
    for v in [0.35, 0.1, 1e6, -3.3]:
        r = torch.full((2, 8), v, dtype=torch.float32)
        r[1, 0] = v + 1
        adv, valid = grpo.group_advantages(r)
        assert torch.all(adv[0] == 0.0)  # exact zero
        assert not valid[0].any() and valid[1].all()


def test_near_constant_float32_group_stays_bounded():
    r = torch.tensor([[0.35] * 7 + [0.95]], dtype=torch.float32)
    adv, valid = grpo.group_advantages(r)
    assert torch.isfinite(adv).all() and valid.all()
    assert adv.abs().max() <= math.sqrt(7) + 1e-5
    assert adv[0, -1] > 0 and (adv[0, :-1] < 0).all()
    # a tiny float32 difference does not blow up: floor on the std
    tiny = torch.tensor([[0.35] * 7 + [0.35 + 3e-8]], dtype=torch.float32)
    tiny[0, -1] = torch.nextafter(torch.tensor(0.35), torch.tensor(1.0))
    adv, valid = grpo.group_advantages(tiny, std_floor=1e-2)
    assert adv.abs().max() < 1e-4


@pytest.mark.parametrize("seed", range(20))
def test_random_groups_never_nan(seed):
    g = torch.Generator().manual_seed(seed)
    n, G = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(2, 9, (1,), generator=g))
    kind = seed % 4
    if kind == 0:
        r = torch.randn(n, G, generator=g)
    elif kind == 1:
        r = torch.randint(0, 2, (n, G), generator=g).float()
    elif kind == 2:
        r = torch.full((n, G), float(torch.randn(1, generator=g))) + 1e-7 * torch.randint(0, 2, (n, G), generator=g)
    else:
        r = torch.randn(n, G, generator=g) * 1e4
    r = r.float()
    adv, valid = grpo.group_advantages(r)
    assert torch.isfinite(adv).all()
    assert adv.abs().max() <= math.sqrt(G - 1) + 1e-4
    same = r.max(1).values == r.min(1).values
    assert torch.all(adv[same] == 0) and not valid[same].any()
    # interleaved order gives the same advantages
    perm = torch.randperm(n * G, generator=g)
    ids = torch.arange(n).repeat_interleave(G)
    adv_f, _ = grpo.group_advantages(r.reshape(-1)[perm], ids[perm])
    assert torch.allclose(adv_f, adv.reshape(-1)[perm])
    # the loss stays finite for arbitrary log-probs
    lp_new = torch.randn(n * G, generator=g) * 50
    lp_old = torch.randn(n * G, generator=g) * 50
    loss, st = grpo.clipped_surrogate_loss(lp_new, lp_old, adv.reshape(-1), valid.reshape(-1))
    assert torch.isfinite(loss) and all(math.isfinite(v) for v in st.values())


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="group_ids"):
        grpo.group_advantages(torch.ones(4))
    with pytest.raises(ValueError, match="shape"):
        grpo.group_advantages(torch.ones(4), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="NaN"):
        grpo.group_advantages(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="integers"):
        grpo.group_advantages(torch.ones(2), torch.zeros(2))
    with pytest.raises(ValueError):
        grpo.group_advantages(torch.ones(2, 2, 2))
    with pytest.raises(ValueError, match="std_floor"):
        grpo.group_advantages(torch.ones(2, 2), std_floor=0)


def test_surrogate_masks_and_clips():
    adv = torch.tensor([1.0, -1.0])
    old = torch.zeros(2, 3)
    new = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    loss, st = grpo.clipped_surrogate_loss(new, old, adv, mask)
    # ratio 1: loss = -mean(adv over masked) = -(1 + 1 - 1) / 3
    assert torch.isclose(loss, torch.tensor(-1 / 3))
    assert st["approx_kl"] == 0 and st["clip_frac"] == 0
    loss.backward()
    assert new.grad[0, 2] == 0 and new.grad[1, 1] == 0 and new.grad[0, 0] < 0 and new.grad[1, 0] > 0
    # beyond the clip range with a positive advantage there is no gradient
    new2 = torch.full((1, 1), 0.5, requires_grad=True)
    loss2, st2 = grpo.clipped_surrogate_loss(new2, torch.zeros(1, 1), torch.ones(1), clip_eps=0.2)
    loss2.backward()
    assert new2.grad.abs().sum() == 0 and st2["clip_frac"] == 1.0
    assert torch.isclose(loss2, torch.tensor(-1.2))


def test_kl_reference_is_zero_when_equal_and_positive_otherwise():
    lp = torch.randn(5)
    assert grpo.kl_to_reference(lp, lp).abs() < 1e-7
    assert grpo.kl_to_reference(lp, lp + 0.3) > 0


def test_fakes_follow_protocols():
    assert isinstance(ToyReachEnv(2), ChunkEnv) and isinstance(GaussianChunkPolicy(), Policy)


def test_rollout_alive_mask_and_rewards():
    torch.manual_seed(0)
    env = ToyReachEnv(num_envs=6, max_steps=8)
    pol = GaussianChunkPolicy()
    starts = toy_starts(2)
    ros = grpo.collect_groups(env, pol, starts, group_size=4, max_chunks=5, generator=torch.Generator().manual_seed(0))
    assert len(ros) == 3  # 16 slots in batches of 6, the last padded with 2 inactive slots
    last = ros[-1]
    assert (last.group_ids[-2:] == -1).all() and not last.alive[-2:].any()
    for ro in ros:
        # max_steps 8 with chunks of 4: every slot is done after at most 2 chunks
        assert ro.alive.shape[1] <= 3 and not ro.alive[:, 2:].any()
        # once dead, stays dead
        assert torch.all(ro.alive[:, 1:] <= ro.alive[:, :-1])
        assert torch.all(ro.rewards[~ro.alive] == 0)
    r, s, g = grpo.rollout_returns(ros)
    assert r.shape == (16,) and g.tolist() == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    r2, _, _ = grpo.rollout_returns(ros, "return+success", success_bonus=2.0)
    assert torch.allclose(r2, r + 2.0 * s.float())


def test_rollout_chunk_limits_stop_slots_early():
    env = ToyReachEnv(num_envs=3, max_steps=40)
    pol = GaussianChunkPolicy()
    starts = toy_starts(1) + toy_starts(1)[:1]
    ro = grpo.rollout_batch(env, pol, starts, torch.tensor([0, 1, 2]), max_chunks=6,
                            generator=torch.Generator().manual_seed(0), chunk_limits=torch.tensor([1, 3, 6]))
    assert ro.alive.sum(1).tolist() == [1, 3, 6]
    assert torch.all(ro.rewards[~ro.alive] == 0)


def test_recomputed_log_prob_matches_and_ratio_is_one():
    env = ToyReachEnv(num_envs=8)
    pol = GaussianChunkPolicy()
    ros = grpo.collect_groups(env, pol, toy_starts(1), group_size=4, max_chunks=3)
    r, s, g = grpo.rollout_returns(ros)
    adv = torch.ones_like(r)
    batch = grpo.build_transitions(ros, adv, torch.ones_like(r, dtype=torch.bool))
    assert batch is not None and len(batch) == int(sum(ro.alive.sum() for ro in ros))
    lp = pol.log_prob(batch.obs, batch.samples)
    assert torch.allclose(lp, batch.samples.log_prob, atol=1e-5)


def test_grpo_improves_toy_task():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    env = ToyReachEnv(num_envs=16, max_steps=16)
    pol = GaussianChunkPolicy(init_std=0.5)
    opt = torch.optim.Adam(pol.parameters(), lr=0.03)
    cfg = grpo.GRPOConfig(group_size=8, max_chunks=4, epochs=2, minibatch_size=64, kl_coef=0.01,
                          reward_mode="return+success")
    ref = grpo.make_reference(pol)
    starts = toy_starts(2, tasks=("reach_a", "reach_b", "reach_c"))
    first = grpo.grpo_iteration(env, pol, opt, starts, cfg, ref_policy=ref, generator=gen).stats
    for _ in range(14):
        last = grpo.grpo_iteration(env, pol, opt, starts, cfg, ref_policy=ref, generator=gen).stats
    for k in ("approx_kl", "clip_frac", "kl_ref", "grad_norm", "reward_mean", "adv_std", "valid_group_frac"):
        assert math.isfinite(last[k]), k
    assert last["reward_mean"] > first["reward_mean"] + 0.3
    assert last["success_rate"] > first["success_rate"] + 0.2
    # per task: the overall rate is the mean of the three tasks' (equal group counts), mixed groups counted
    per = [last[f"success_rate/{t}"] for t in ("reach_a", "reach_b", "reach_c")]
    assert last["success_rate"] == pytest.approx(sum(per) / 3)
    mixed = sum(last[f"valid_groups/{t}"] for t in ("reach_a", "reach_b", "reach_c"))
    assert mixed == pytest.approx(last["valid_group_frac"] * len(starts))


def test_online_debiaser_estimates_and_subtracts_bias():
    d = grpo.OnlineDebiaser(momentum=0.0)
    tasks = ["a"] * 4 + ["b"] * 4
    imag = torch.tensor([1.0, 1.2, 0.8, 1.0, 0.0, 0.1, -0.1, 0.0])
    real = torch.tensor([0.5, 0.5, 0.0, 0.0])
    out = d.update(tasks, imag, real, real_tasks=["a", "a", "b", "b"])
    assert out["bias/a"] == pytest.approx(0.5) and out["bias/b"] == pytest.approx(0.0)
    corr = d.correct(tasks + ["c"], torch.cat([imag, torch.tensor([3.0])]))
    assert corr[:4].mean() == pytest.approx(0.5) and corr[-1] == 3.0
    d2 = grpo.OnlineDebiaser(); d2.load_state_dict(d.state_dict())
    assert d2.bias == d.bias


def test_inverse_variance_downweights_noisy_groups():
    torch.manual_seed(0)
    pol = GaussianChunkPolicy()
    env = ToyReachEnv(num_envs=8, reward_noise=0.0)
    starts = toy_starts(1)  # 2 groups of 4 in one batch
    ros = grpo.collect_groups(env, pol, starts, 4, 3)
    base, _, g = grpo.rollout_returns(ros)

    class NoisyOnGroup1(ToyReachEnv):
        def step(self, actions):
            res = super().step(actions)
            res.reward[4:] += torch.randn(4, generator=self.gen) * 2.0
            return res

    replays = [NoisyOnGroup1(num_envs=8, seed=s) for s in range(4)]
    all_starts, _ = grpo.expand_starts(starts, 4)
    mean, w, st = grpo.inverse_variance_rewards(ros, replays, lambda ro: all_starts, "return", 1.0, base)
    assert w[:4].mean() > 5 * w[4:].mean()
    assert torch.allclose(w.mean(), torch.tensor(1.0))
    assert torch.allclose(mean[:4], base[:4], atol=1e-5)  # noise-free group keeps its reward


def test_inverse_variance_replays_stop_where_each_rollout_ended():
    """Slots of group 0 are truncated after one chunk, group 1 runs three: a noise-free replay in an
    env without those limits must score exactly the chunks each rollout ran (not the extra ones)."""
    torch.manual_seed(0)
    pol = GaussianChunkPolicy()

    class ShortForGroup0(ToyReachEnv):
        def step(self, actions):
            res = super().step(actions)
            res.truncated[:4] |= ~res.terminated[:4]
            return res

    env = ShortForGroup0(num_envs=8, reward_noise=0.0, tol=0.0)
    starts = toy_starts(1)
    ros = grpo.collect_groups(env, pol, starts, 4, 3)
    assert ros[0].alive[:4].sum(1).eq(1).all() and ros[0].alive[4:].sum(1).eq(3).all()
    base, _, _ = grpo.rollout_returns(ros)
    all_starts, _ = grpo.expand_starts(starts, 4)
    replays = [ToyReachEnv(num_envs=8, reward_noise=0.0, tol=0.0) for _ in range(2)]
    mean, w, st = grpo.inverse_variance_rewards(ros, replays, lambda ro: all_starts, "return", 1.0, base)
    assert torch.allclose(mean, base, atol=1e-5) and st["denoise_var_mean"] < 1e-9


def _train(tmp, iterations, resume=True):
    pol, setup = toy_grpo_setup()
    evals = []

    def evaluate(p, n):
        evals.append(n)
        return {"success": float(n)}

    out = grpo.train_grpo(setup, grpo.LoopConfig(iterations, tmp, seed=3, resume=resume, progress=False),
                          grpo.GRPOHooks(evaluation=grpo.EvalHook(evaluate, every=2)))
    return pol, out, evals


def test_train_grpo_resumes_exactly(tmp_path):
    pol_full, out_full, ev_full = _train(tmp_path / "a", 4)
    assert ev_full == [0, 2, 4] and [h["iteration"] for h in out_full["history"]] == [1, 2, 3, 4]
    assert (tmp_path / "a" / "checkpoints" / "step_4" / "model.safetensors").is_file()
    _train(tmp_path / "b", 2)
    pol_res, out_res, ev_res = _train(tmp_path / "b", 4)
    assert out_res["resumed_from"] is not None and ev_res == [4]  # evals 0 and 2 come from the checkpoint
    for a, b in zip(pol_full.parameters(), pol_res.parameters()):
        assert torch.equal(a, b)
    assert [h["reward_mean"] for h in out_full["history"]] == [h["reward_mean"] for h in out_res["history"]]
    assert [e["iteration"] for e in out_res["evals"]] == [0, 2, 4]
    # loading the checkpoint rebuilds the policy
    from wmrl.kernel.checkpoint import load_checkpoint

    p = load_checkpoint(tmp_path / "b" / "checkpoints" / "last")
    assert torch.equal(p.net.weight, pol_res.net.weight)


def test_debiasing_in_iteration_reports_bias():
    torch.manual_seed(0)
    pol = GaussianChunkPolicy()
    imag = ToyReachEnv(num_envs=8, reward_bias=0.5)   # imagined rewards biased by +0.5 per chunk
    real = ToyReachEnv(num_envs=8)
    cfg = grpo.GRPOConfig(group_size=4, max_chunks=2, epochs=1)
    d = grpo.OnlineDebiaser(momentum=0.0)
    fn = grpo.real_rollout_fn_for(real, pol, cfg, rollouts_per_start=4)
    opt = torch.optim.SGD(pol.parameters(), lr=0.0)
    res = grpo.grpo_iteration(imag, pol, opt, toy_starts(1), cfg, debiaser=d, real_rollout_fn=fn, debias_starts=2,
                              generator=torch.Generator().manual_seed(0))
    # two chunks of +0.5 on alive slots: the bias is between 0.5 and 1.0 per rollout
    assert 0.45 < d.bias["reach_a"] <= 1.05 and "bias/reach_a" in res.stats
    assert res.stats["reward_debiased_mean"] < res.stats["reward_mean"] - 0.4


def _fpo_batch(adv):
    from test_policy import obs, stats, tiny_policy

    from policies.samplers import SDESampler

    torch.manual_seed(0)
    p = tiny_policy().set_norm_stats(stats()).eval()
    with torch.no_grad():  # leave the zero-initialised FiLM / output symmetric point
        for q in p.parameters():
            q.add_(0.1 * torch.randn_like(q))
    p.sampler = SDESampler(num_steps=4, noise_level=0.5, init_scale=0.0, noise_steps=2)
    o = obs(b=len(adv), seed=1)
    s = p.sample(o, torch.Generator().manual_seed(2))
    a = torch.tensor(adv, dtype=torch.float32)
    return p, grpo.TransitionBatch(o, s, a, torch.ones_like(a))


def test_fpo_ratio_starts_at_one_and_moves_chunks_by_advantage_sign():
    """ratio='fpo' (FPO, McAllister et al. 2025): at unchanged parameters every ratio is exactly 1;
    an update lowers the flow-matching loss of positive-advantage chunks and raises that of
    negative-advantage chunks (relative to the other)."""
    p, batch = _fpo_batch([1.0, 1.0, -1.0, -1.0])
    cfg = grpo.GRPOConfig(ratio="fpo", fpo_samples=3, epochs=1, minibatch_size=4, max_grad_norm=1e9)
    frozen = grpo.grpo_update(p, torch.optim.SGD(p.parameters(), lr=0.0), batch, cfg,
                              generator=torch.Generator().manual_seed(0))
    assert frozen["ratio_mean"] == 1.0 and frozen["ratio_max"] == 1.0 and frozen["clip_frac"] == 0.0

    t = 0.001 + 0.999 * torch.rand(4, 16, generator=torch.Generator().manual_seed(5))
    eps = torch.randn(4, 16, 4, 7, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        before = p.flow_matching_loss(batch.obs, batch.samples, t, eps)
    opt = torch.optim.Adam(p.parameters(), lr=3e-3)
    cfg = grpo.GRPOConfig(ratio="fpo", fpo_samples=8, epochs=5, minibatch_size=4, clip_eps=10.0)
    st = grpo.grpo_update(p, opt, batch, cfg, generator=torch.Generator().manual_seed(0))
    assert math.isfinite(st["loss"]) and st["approx_kl"] > 0
    with torch.no_grad():
        change = p.flow_matching_loss(batch.obs, batch.samples, t, eps) - before
    assert float(change[:2].mean()) < float(change[2:].mean()) - 1e-3


def test_fpo_errors_name_what_to_change():
    with pytest.raises(ValueError, match="kl_coef"):
        grpo.GRPOConfig(ratio="fpo", kl_coef=0.1)
    with pytest.raises(ValueError, match="ratio"):
        grpo.GRPOConfig(ratio="fpo2")
    env = ToyReachEnv(num_envs=4)
    pol = GaussianChunkPolicy()
    ros = grpo.collect_groups(env, pol, toy_starts(1), group_size=4, max_chunks=2)
    r, _, _ = grpo.rollout_returns(ros)
    batch = grpo.build_transitions(ros, torch.ones_like(r), torch.ones_like(r, dtype=torch.bool))
    batch.samples.extras["chain"] = torch.zeros(len(batch), 3, 4, 3)
    with pytest.raises(ValueError, match="flow_matching_loss"):
        grpo.grpo_update(pol, torch.optim.SGD(pol.parameters(), lr=0.1), batch, grpo.GRPOConfig(ratio="fpo"))


def test_masked_mean_keeps_true_entries_and_broadcasts_a_prefix_mask():
    x = torch.tensor([[1.0, float("nan")], [3.0, 5.0]])
    keep = torch.tensor([[True, False], [True, True]])
    assert grpo.masked_mean(x, keep).item() == 3.0                       # NaN dropped, (1 + 3 + 5) / 3
    y = torch.arange(12.0).reshape(2, 3, 2)                              # (B, H, D) with a (B, H) mask
    assert grpo.masked_mean(y, torch.tensor([[True, False, False], [False, False, False]])).item() == 0.5
    assert grpo.masked_mean(y, torch.zeros(2, 3, dtype=torch.bool)).item() == 0.0


def test_each_hook_runs_on_its_own_every(tmp_path):
    pol, setup = toy_grpo_setup()
    refreshed = []
    hooks = grpo.GRPOHooks(denoise=grpo.DenoiseHook([ToyReachEnv(num_envs=8, max_steps=12)], every=2),
                           refresh=grpo.RefreshHook(lambda p, n: refreshed.append(n) or {"refresh/x": 1.0}, every=2),
                           checkpoint=grpo.CheckpointHook(every=3))
    out = grpo.train_grpo(setup, grpo.LoopConfig(5, tmp_path, seed=1, progress=False), hooks)
    assert [("denoise_var_mean" in h) for h in out["history"]] == [True, False, True, False, True]  # iterations 0, 2, 4
    assert refreshed == [2, 4] and "refresh/x" in out["history"][1]      # none after the last iteration
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["last", "step_3"]


def test_anchor_holds_the_policy_on_groups_without_signal():
    """``anchor_coef``: the chunks of groups whose rollouts all got the same return carry no advantage;
    with the anchor their KL to the reference enters every step. A policy pushed away from the
    reference, updated on a batch of zero advantages (so only the anchor moves it), comes back
    towards the reference; without the anchor it stays."""
    from wmrl.rl.update import TransitionBatch

    torch.manual_seed(0)
    env = ToyReachEnv(num_envs=8)
    pol = GaussianChunkPolicy()
    ref = grpo.make_reference(pol)
    with torch.no_grad():
        for p in pol.parameters():
            p.add_(0.3 * torch.randn_like(p))
    ros = grpo.collect_groups(env, pol, toy_starts(1), group_size=4, max_chunks=3,
                              generator=torch.Generator().manual_seed(1))
    r, _, _ = grpo.rollout_returns(ros)
    batch = grpo.build_transitions(ros, torch.zeros_like(r), torch.ones_like(r, dtype=torch.bool))
    assert isinstance(batch, TransitionBatch) and len(batch) > 0

    def kl(p):
        with torch.no_grad():
            return float(grpo.kl_to_reference(p.log_prob(batch.obs, batch.samples), ref.log_prob(batch.obs, batch.samples)))

    out = {}
    for coef in (0.0, 1.0):
        p = copy.deepcopy(pol)
        opt = torch.optim.Adam(p.parameters(), lr=0.02)
        cfg = grpo.GRPOConfig(epochs=20, minibatch_size=16, anchor_coef=coef)
        before = kl(p)
        st = grpo.grpo_update(p, opt, batch, cfg, ref_policy=ref, generator=torch.Generator().manual_seed(0), anchor=batch)
        out[coef] = (before, kl(p), st)
    assert out[0.0][1] == pytest.approx(out[0.0][0], rel=1e-4)       # zero advantage, no anchor: nothing moves
    assert out[1.0][1] < 0.5 * out[1.0][0] and "kl_anchor" in out[1.0][2]
    with pytest.raises(ValueError, match="anchor_coef"):
        grpo.GRPOConfig(anchor_coef=0.1, ratio="fpo")
    with pytest.raises(ValueError, match="anchor_coef"):
        grpo.GRPOConfig(anchor_coef=-1.0)
