"""GRPO for chunking policies on any :class:`~wmrl.kernel.interfaces.ChunkEnv` (SimEnv or ImaginationEnv).

The RL math is a set of small pure functions with shape docstrings (in the style of CleanRL's
``ppo_continuous_action.py`` and RLinf's ``algorithms/advantages.py``); the training loop
(:func:`grpo_iteration`) is a short linear story:

1. :func:`collect_groups`: ``G`` rollouts from every start, one action chunk per policy call,
   recording the SDE sampler's chain and its log-prob (``PolicySample``), per-slot ``alive`` masks
   and chunk rewards.
2. :func:`group_advantages`: group-relative advantages (GRPO, Shao et al. 2024, DeepSeekMath) of the
   per-rollout rewards, ``(r - mean_g) / max(std_g, std_floor)``; groups whose rewards are all
   equal carry no signal, get exactly zero advantage and are left out of the loss denominator.
3. :func:`grpo_update`: epochs of PPO-style clipped surrogate (Schulman et al. 2017) on the chunk
   log-probs, recomputed with gradient, with an optional KL penalty to a frozen reference policy
   (k3 estimator, Schulman 2020 "Approximating KL divergence"), as in Flow-GRPO (Liu et al. 2025).
   With ``ratio="fpo"`` the ratio is FPO's instead (McAllister et al. 2025, "Flow Matching Policy
   Gradients"): ``exp(L_old - L_new)`` of the sampled chunk's conditional flow-matching loss at fixed
   ``(t, eps)`` draws, so the update is an advantage-signed, clipped flow-matching step on the
   executed chunks and needs no per-denoising-step Gaussian densities.

World-model reward mitigations (WMRL-style, both switchable, both reported):

* :class:`OnlineDebiaser`: the bias of imagined rewards / success, estimated per task from a few
  real-sim rollouts of the current policy from the same starts, is subtracted from imagined rewards.
* :func:`inverse_variance_rewards`: several imagined replays (stochastic world model seeds or an
  ensemble of imagination envs) of every rollout's action chunks; the reward becomes their mean
  and each group is weighted by the inverse variance of its reward estimates.

Shape legend: see :mod:`wmrl.kernel.types` (``B`` slots, ``G`` group size, ``N`` chunks per rollout).
"""

from __future__ import annotations

import copy
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from wmrl.kernel.checkpoint import optimizer_from_tensors, optimizer_to_tensors
from wmrl.kernel.interfaces import ChunkEnv, Policy
from wmrl.kernel.types import Obs, PolicySample, Rollout, Start

log = logging.getLogger("wmrl.grpo")

# --------------------------------------------------------------------------------------------
# Pure math
# --------------------------------------------------------------------------------------------


def _check_finite(name: str, x: torch.Tensor) -> None:
    if not torch.isfinite(x).all():
        bad = (~torch.isfinite(x)).nonzero()[:5].tolist()
        raise ValueError(f"{name} holds NaN or inf (first positions {bad}); check the environment's rewards")


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor | None = None,
    std_floor: float = 1e-2,
    scale_by_std: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantages (GRPO, Shao et al. 2024).

    Args:
        rewards: either ``(n_groups, G)`` (row = the ``G`` rollouts of one start) or flat ``(B,)``
            together with ``group_ids``. Any float dtype; computed in float64.
        group_ids: ``int64 (B,)`` group of each flat reward (any integer labels, any order;
            entries with a negative id are ignored and get zero advantage). Must be ``None`` for
            2-D ``rewards``.
        std_floor: lower bound on the per-group standard deviation (population std) used as the
            divisor, so that near-constant float32 groups cannot blow up. ``> 0``.
        scale_by_std: ``False`` gives Dr. GRPO's mean-only baseline ``r - mean_g``.

    Returns:
        ``(advantages, valid)``: ``float32`` of the shape of ``rewards``; ``bool`` of the same shape,
        ``False`` for members of groups whose rewards are all exactly equal (their advantage is
        exactly ``0``) and for ignored entries. With ``scale_by_std`` every ``|advantage|`` is at most
        ``sqrt(G - 1)``.

    Raises:
        ValueError: wrong shapes, a group of size 1 given as 2-D, NaN/inf rewards, ``std_floor <= 0``.
    """
    if std_floor <= 0:
        raise ValueError(f"std_floor must be > 0, got {std_floor}")
    r = torch.as_tensor(rewards)
    _check_finite("rewards", r)
    if r.ndim == 2:
        if group_ids is not None:
            raise ValueError("give either rewards (n_groups, G) or flat rewards (B,) with group_ids, not both")
        n, g = r.shape
        if n == 0 or g == 0:
            raise ValueError(f"rewards (n_groups, G) must be non-empty, got {tuple(r.shape)}")
        flat = r.reshape(-1)
        ids = torch.arange(n).repeat_interleave(g)
        adv, valid = group_advantages(flat, ids, std_floor=std_floor, scale_by_std=scale_by_std)
        return adv.reshape(n, g), valid.reshape(n, g)
    if r.ndim != 1:
        raise ValueError(f"rewards must be (n_groups, G) or (B,), got shape {tuple(r.shape)}")
    if group_ids is None:
        raise ValueError("flat rewards (B,) need group_ids (B,); or pass rewards as (n_groups, G)")
    ids = torch.as_tensor(group_ids)
    if ids.shape != r.shape:
        raise ValueError(f"group_ids shape {tuple(ids.shape)} must equal rewards shape {tuple(r.shape)}")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be integers, got {ids.dtype}")
    r64 = r.to(torch.float64)
    adv = torch.zeros_like(r64)
    valid = torch.zeros(r.shape, dtype=torch.bool)
    for gid in torch.unique(ids).tolist():
        if gid < 0:
            continue
        m = ids == gid
        x = r64[m]
        if x.numel() < 2 or bool(x.max() == x.min()):  # no signal: exactly zero, left out
            continue
        centred = x - x.mean()
        if scale_by_std:
            std = math.sqrt(float((centred**2).mean()))
            centred = centred / max(std, std_floor)
        adv[m] = centred
        valid[m] = True
    return adv.to(torch.float32), valid


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over entries where ``mask`` is True (``0`` when the mask is empty).

    Args: ``x`` float ``(...)``; ``mask`` bool of the same shape. Returns a scalar tensor."""
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp_min(1.0)


def clipped_surrogate_loss(
    new_log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None = None,
    clip_eps: float = 0.2,
    weights: torch.Tensor | None = None,
    max_log_ratio: float = 20.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate on chunk log-probs (Schulman et al. 2017), one ratio per chunk.

    Args:
        new_log_prob: ``float32 (B, N)`` or ``(M,)`` log-prob of each chunk's sampled chain under the
            current parameters (with grad).
        old_log_prob: same shape, log-prob at sampling time (no grad).
        advantages: same shape, or ``(B,)`` broadcast over the chunks of each rollout.
        mask: ``bool`` same shape as ``new_log_prob``: True where the chunk counts (slot alive, group
            valid). Masked-out entries are not in the denominator.
        clip_eps: ratio clip ``[1 - eps, 1 + eps]``.
        weights: optional non-negative per-entry weights (same shape / broadcast like advantages),
            e.g. inverse-variance group weights.
        max_log_ratio: the log-ratio is clamped to ``[-max, max]`` before ``exp`` so a stale chain
            cannot produce inf.

    Returns:
        ``(loss, stats)``: scalar loss to minimise; stats ``approx_kl`` (``E[(r-1) - log r]``),
        ``clip_frac``, ``ratio_mean``, ``ratio_max``.
    """
    if new_log_prob.shape != old_log_prob.shape:
        raise ValueError(f"new_log_prob {tuple(new_log_prob.shape)} and old_log_prob {tuple(old_log_prob.shape)} differ")
    adv = advantages
    if adv.shape != new_log_prob.shape:
        if new_log_prob.ndim == 2 and adv.shape == new_log_prob.shape[:1]:
            adv = adv[:, None].expand_as(new_log_prob)
        else:
            raise ValueError(f"advantages shape {tuple(advantages.shape)} does not fit log-probs {tuple(new_log_prob.shape)}")
    if mask is None:
        mask = torch.ones_like(new_log_prob, dtype=torch.bool)
    if mask.shape != new_log_prob.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} must equal log-prob shape {tuple(new_log_prob.shape)}")
    log_ratio = (new_log_prob - old_log_prob.detach()).clamp(-max_log_ratio, max_log_ratio)
    log_ratio = torch.where(mask, log_ratio, torch.zeros_like(log_ratio))
    ratio = log_ratio.exp()
    pg1 = ratio * adv
    pg2 = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * adv
    per = -torch.minimum(pg1, pg2)
    if weights is not None:
        w = weights
        if w.shape != per.shape:
            w = w[:, None].expand_as(per) if per.ndim == 2 and w.shape == per.shape[:1] else w
        per = per * w
    loss = masked_mean(per, mask)
    with torch.no_grad():
        approx_kl = masked_mean((ratio - 1.0) - log_ratio, mask)
        clip_frac = masked_mean(((ratio - 1.0).abs() > clip_eps).float(), mask)
        sel = ratio[mask]
    stats = {
        "approx_kl": float(approx_kl),
        "clip_frac": float(clip_frac),
        "ratio_mean": float(sel.mean()) if sel.numel() else 1.0,
        "ratio_max": float(sel.max()) if sel.numel() else 1.0,
    }
    return loss, stats


def kl_to_reference(new_log_prob: torch.Tensor, ref_log_prob: torch.Tensor, mask: torch.Tensor | None = None,
                    max_log_ratio: float = 20.0) -> torch.Tensor:
    """k3 estimator of ``KL(pi || pi_ref)`` on samples of ``pi`` (Schulman 2020; as in GRPO).

    ``exp(ref - new) - (ref - new) - 1`` per chunk, masked mean. Shapes: like
    :func:`clipped_surrogate_loss`. Always ``>= 0``; ``0`` when the policies agree."""
    d = (ref_log_prob.detach() - new_log_prob).clamp(-max_log_ratio, max_log_ratio)
    k3 = d.exp() - d - 1.0
    if mask is None:
        return k3.mean()
    return masked_mean(k3, mask)


def describe(x: torch.Tensor, prefix: str) -> dict[str, float]:
    """Mean / std / min / max of a tensor, as ``{prefix_mean: ...}`` floats (empty-safe)."""
    x = x.detach().float().reshape(-1)
    if x.numel() == 0:
        return {f"{prefix}_mean": 0.0, f"{prefix}_std": 0.0, f"{prefix}_min": 0.0, f"{prefix}_max": 0.0}
    return {f"{prefix}_mean": float(x.mean()), f"{prefix}_std": float(x.std(unbiased=False)),
            f"{prefix}_min": float(x.min()), f"{prefix}_max": float(x.max())}


# --------------------------------------------------------------------------------------------
# Rollout collection
# --------------------------------------------------------------------------------------------


def cat_samples(items: Sequence[PolicySample]) -> PolicySample:
    """Concatenate ``PolicySample`` batches along ``B``."""
    keys = items[0].extras.keys()
    return PolicySample(torch.cat([s.actions for s in items]), torch.cat([s.log_prob for s in items]),
                        {k: torch.cat([s.extras[k] for s in items]) for k in keys})


def expand_starts(starts: Sequence[Start], group_size: int) -> tuple[list[Start], torch.Tensor]:
    """Repeat every start ``G`` times (consecutively). Returns the starts and ``int64 (len*G,)`` group ids."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    out = [s for s in starts for _ in range(group_size)]
    return out, torch.arange(len(starts)).repeat_interleave(group_size)


@torch.no_grad()
def rollout_batch(env: ChunkEnv, policy: Policy, starts: Sequence[Start], group_ids: torch.Tensor,
                  max_chunks: int, generator: torch.Generator | None = None,
                  actions_fn: Callable[[int, Obs], PolicySample] | None = None,
                  chunk_limits: torch.Tensor | None = None) -> Rollout:
    """One batch of chunk-level rollouts, ``len(starts) == env.num_envs``.

    A slot is alive from the reset until (and including) the chunk in which it terminates or is
    truncated; later chunks (after the env's auto-reset) are masked out. Stops when no slot is
    alive or after ``max_chunks`` chunks (then the slot counts as unsuccessful unless it succeeded).

    Args:
        env: any ChunkEnv with ``num_envs == len(starts)``.
        policy: samples ``PolicySample`` (actions ``(B, H, D_a)``, log_prob ``(B,)``, extras).
        group_ids: ``int64 (B,)``; ``-1`` marks padding slots (never alive).
        actions_fn: optional ``(n, obs) -> PolicySample`` replacing the policy (open-loop replay).
        chunk_limits: optional ``int64 (B,)``: slot ``b`` stops after ``chunk_limits[b]`` chunks even
            if its episode goes on (replaying recorded rollouts of different lengths).

    Returns:
        ``Rollout`` with ``rewards (B, N)``, ``alive (B, N)``, ``success (B,)``, ``group_ids (B,)``.
    """
    if len(starts) != env.num_envs:
        raise ValueError(f"rollout_batch needs len(starts) == env.num_envs ({len(starts)} != {env.num_envs})")
    b = len(starts)
    obs = env.reset(list(starts))
    alive = group_ids >= 0
    success = torch.zeros(b, dtype=torch.bool)
    obs_list, samples, rewards, alive_list = [], [], [], []
    for n in range(max_chunks):
        if chunk_limits is not None:
            alive &= chunk_limits > n
        if not alive.any():
            break
        sample = actions_fn(n, obs) if actions_fn is not None else policy.sample(obs, generator=generator)
        if sample.actions.shape[0] != b:
            raise ValueError(f"policy returned {sample.actions.shape[0]} chunks for a batch of {b}")
        res = env.step(sample.actions)
        r = torch.as_tensor(res.reward, dtype=torch.float32).reshape(b)
        obs_list.append(obs)
        samples.append(PolicySample(sample.actions.detach(), sample.log_prob.detach().float(),
                                    {k: v.detach() for k, v in sample.extras.items()}))
        alive_list.append(alive.clone())
        rewards.append(torch.where(alive, r, torch.zeros_like(r)))
        success |= alive & torch.as_tensor(res.success, dtype=torch.bool).reshape(b)
        alive = alive & ~torch.as_tensor(res.done, dtype=torch.bool).reshape(b)
        obs = res.obs
    if not rewards:
        raise ValueError("no chunk was executed: max_chunks must be >= 1 and at least one slot must be real")
    return Rollout(obs=obs_list, samples=samples, rewards=torch.stack(rewards, 1), alive=torch.stack(alive_list, 1),
                   success=success, group_ids=group_ids.clone())


def collect_groups(env: ChunkEnv, policy: Policy, starts: Sequence[Start], group_size: int, max_chunks: int,
                   generator: torch.Generator | None = None, progress: bool = False) -> list[Rollout]:
    """``G`` rollouts from every start, in batches of ``env.num_envs`` (the last batch is padded
    with inactive slots of group id ``-1``). Group ``i`` is ``starts[i]``.

    Returns: list of ``Rollout`` batches (their ``group_ids`` are global)."""
    all_starts, ids = expand_starts(starts, group_size)
    b = env.num_envs
    out = []
    rng = range(0, len(all_starts), b)
    if progress:
        from tqdm import tqdm

        rng = tqdm(rng, desc="rollouts", leave=False)
    for i in rng:
        st, gi = all_starts[i:i + b], ids[i:i + b]
        pad = b - len(st)
        if pad:
            st = st + [st[-1]] * pad
            gi = torch.cat([gi, torch.full((pad,), -1, dtype=torch.long)])
        out.append(rollout_batch(env, policy, st, gi, max_chunks, generator=generator))
    return out


def rollout_returns(rollouts: Sequence[Rollout], reward_mode: str = "return", success_bonus: float = 1.0
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-rollout scalar rewards of real slots.

    Args:
        reward_mode: ``"return"`` (sum of chunk rewards), ``"success"`` (1 / 0), or
            ``"return+success"`` (return plus ``success_bonus`` on success).

    Returns: ``(rewards float32 (M,), success bool (M,), group_ids int64 (M,))`` over real slots,
    in the order of ``rollouts``."""
    if reward_mode not in ("return", "success", "return+success"):
        raise ValueError(f"reward_mode must be 'return', 'success' or 'return+success', got {reward_mode!r}")
    rs, ss, gs = [], [], []
    for ro in rollouts:
        real = ro.group_ids >= 0
        ret = (ro.rewards * ro.alive).sum(1)
        suc = ro.success.float()
        r = {"return": ret, "success": suc, "return+success": ret + success_bonus * suc}[reward_mode]
        rs.append(r[real]); ss.append(ro.success[real]); gs.append(ro.group_ids[real])
    return torch.cat(rs).float(), torch.cat(ss), torch.cat(gs)


@dataclass
class TransitionBatch:
    """Flat chunk transitions for the update: ``M`` (slot, chunk) pairs of alive slots of valid groups.

    Attributes: ``obs`` (batch ``M``), ``samples`` (batch ``M``), ``advantages float32 (M,)``,
    ``weights float32 (M,)``."""

    obs: Obs
    samples: PolicySample
    advantages: torch.Tensor
    weights: torch.Tensor

    def __len__(self) -> int:
        return int(self.advantages.shape[0])

    def index(self, idx: torch.Tensor) -> "TransitionBatch":
        return TransitionBatch(self.obs.index(idx), self.samples.index(idx), self.advantages[idx], self.weights[idx])


def build_transitions(rollouts: Sequence[Rollout], slot_adv: torch.Tensor, slot_valid: torch.Tensor,
                      slot_weight: torch.Tensor | None = None) -> TransitionBatch | None:
    """Flatten rollouts into the transitions that enter the loss.

    Args:
        slot_adv, slot_valid, slot_weight: ``(M,)`` per real slot, in the order of
            :func:`rollout_returns`. Only alive chunks of valid slots are kept.

    Returns: a ``TransitionBatch`` or ``None`` when nothing carries signal."""
    obs_parts, sample_parts, adv_parts, w_parts = [], [], [], []
    k = 0
    for ro in rollouts:
        real = (ro.group_ids >= 0).nonzero().flatten()
        m = real.numel()
        a = torch.zeros(ro.group_ids.shape[0]); v = torch.zeros(ro.group_ids.shape[0], dtype=torch.bool)
        w = torch.ones(ro.group_ids.shape[0])
        a[real] = slot_adv[k:k + m]; v[real] = slot_valid[k:k + m]
        if slot_weight is not None:
            w[real] = slot_weight[k:k + m]
        k += m
        for n, (o, s) in enumerate(zip(ro.obs, ro.samples)):
            sel = (ro.alive[:, n] & v).nonzero().flatten()
            if sel.numel() == 0:
                continue
            obs_parts.append(o.index(sel)); sample_parts.append(s.index(sel))
            adv_parts.append(a[sel]); w_parts.append(w[sel])
    if not obs_parts:
        return None
    return TransitionBatch(Obs.cat(obs_parts), cat_samples(sample_parts), torch.cat(adv_parts), torch.cat(w_parts))


# --------------------------------------------------------------------------------------------
# Update
# --------------------------------------------------------------------------------------------


@dataclass
class GRPOConfig:
    """Hyper-parameters of one GRPO iteration (defaults follow Flow-GRPO / PPO practice).

    Attributes:
        group_size: ``G`` rollouts per start.
        max_chunks: chunk limit per rollout (``N``).
        epochs: update epochs over the collected chunks.
        minibatch_size: transitions per gradient step.
        clip_eps: PPO ratio clip.
        kl_coef: weight of the k3 KL to the frozen reference policy (0 disables it).
        max_grad_norm: gradient-norm clip.
        std_floor: floor on the group reward std.
        scale_by_std: ``False`` uses the mean-only (Dr. GRPO) baseline.
        reward_mode: see :func:`rollout_returns`.
        success_bonus: success bonus for ``reward_mode="return+success"``.
        ratio: ``"per_step"``: one importance ratio per denoising transition of the chain, each
            clipped (Flow-GRPO, Liu et al. 2025); ``"chain"``: one ratio for the whole chain's
            log-prob (its product over the steps, clipped far more often); ``"fpo"``: FPO's ratio
            ``exp(L_old - L_new)`` of the chunk's flow-matching loss (the policy needs
            ``flow_matching_loss``; ``kl_coef`` must be 0).
        fpo_samples: ``(t, eps)`` draws per chunk for the FPO loss estimate (drawn once per update,
            shared by the old and new parameters). ``t`` is uniform on ``[0.001, 1)``.
    """

    group_size: int = 8
    max_chunks: int = 10
    epochs: int = 2
    minibatch_size: int = 64
    clip_eps: float = 0.2
    kl_coef: float = 0.0
    max_grad_norm: float = 1.0
    std_floor: float = 1e-2
    scale_by_std: bool = True
    reward_mode: str = "return"
    success_bonus: float = 1.0
    ratio: str = "per_step"
    fpo_samples: int = 4

    def __post_init__(self):
        if self.ratio not in ("per_step", "chain", "fpo"):
            raise ValueError(f"GRPOConfig.ratio must be 'per_step', 'chain' or 'fpo', got {self.ratio!r}")
        if self.ratio == "fpo" and self.kl_coef > 0:
            raise ValueError("GRPOConfig: ratio='fpo' has no log-probs for the KL to the reference; set kl_coef=0")
        if int(self.fpo_samples) < 1:
            raise ValueError(f"GRPOConfig.fpo_samples must be >= 1, got {self.fpo_samples}")


def _old_log_probs(batch: TransitionBatch, likelihood: Callable[[TransitionBatch, torch.Tensor], torch.Tensor],
                   recompute: bool, chunk: int) -> torch.Tensor:
    """Log-likelihoods of the recorded chunks at the sampling parameters (no grad): the recorded chain
    log-prob, or (``recompute``: per-step ratios, FPO) ``likelihood(minibatch, idx)`` evaluated in
    minibatches of ``chunk`` before the first update (identical parameters, so every ratio starts at
    exactly 1)."""
    if not recompute:
        return batch.samples.log_prob
    parts = []
    with torch.no_grad():
        for i in range(0, len(batch), chunk):
            idx = torch.arange(i, min(i + chunk, len(batch)))
            parts.append(likelihood(batch.index(idx), idx).detach())
    return torch.cat(parts)


def _fpo_draws(batch: TransitionBatch, n: int, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """FPO's Monte-Carlo draws for every transition: ``t float32 (M, n)`` uniform on ``[0.001, 1)`` and
    ``eps float32 (M, n, H, D_a)`` standard normal, shaped after the recorded chains."""
    chain = batch.samples.extras.get("chain")
    if chain is None:
        raise ValueError("ratio='fpo' needs the sampled chains (extras['chain']): sample with policies.samplers.SDESampler")
    m, shape = chain.shape[0], tuple(chain.shape[2:])
    t = 0.001 + 0.999 * torch.rand(m, n, generator=generator)
    eps = torch.randn(m, n, *shape, generator=generator)
    return t, eps


def check_policy(policy: Policy, cfg: GRPOConfig) -> None:
    """Raise ``ValueError`` when ``policy`` cannot give the likelihood ``cfg.ratio`` needs (``"fpo"``:
    a ``flow_matching_loss``), so that a run fails before its first rollout."""
    if cfg.ratio == "fpo" and getattr(policy, "flow_matching_loss", None) is None:
        raise ValueError(f"ratio='fpo' needs a flow-matching policy with flow_matching_loss(obs, sample, t, eps); "
                         f"{type(policy).__name__} has none (use ratio=per_step or chain)")


def _fpo_log_likelihood(policy: Policy, obs: Obs, samples: PolicySample, t: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """``-L_cfm`` ``float32 (B,)``: FPO's stand-in for the chunk log-likelihood (its differences are
    log-ratio estimates)."""
    return -policy.flow_matching_loss(obs, samples, t, eps)  # type: ignore[attr-defined]


def grpo_update(policy: Policy, optimizer: torch.optim.Optimizer, batch: TransitionBatch, cfg: GRPOConfig,
                ref_policy: Policy | None = None, generator: torch.Generator | None = None) -> dict[str, float]:
    """PPO-style epochs over ``batch``; returns mean diagnostics (loss, approx_kl, clip_frac, kl_ref,
    grad_norm, ratio stats). ``policy`` must be a ``torch.nn.Module`` whose ``log_prob`` (or, for
    ``cfg.ratio == "fpo"``, ``flow_matching_loss``) is differentiable."""
    check_policy(policy, cfg)
    params = [p for p in policy.parameters() if p.requires_grad]  # type: ignore[attr-defined]
    m = len(batch)
    per_step = cfg.ratio == "per_step"
    if cfg.ratio == "fpo":
        fpo_t, fpo_eps = _fpo_draws(batch, int(cfg.fpo_samples), generator)

        def likelihood(mb: TransitionBatch, idx: torch.Tensor) -> torch.Tensor:
            return _fpo_log_likelihood(policy, mb.obs, mb.samples, fpo_t[idx], fpo_eps[idx])
    else:
        def likelihood(mb: TransitionBatch, idx: torch.Tensor) -> torch.Tensor:
            return policy.log_prob(mb.obs, mb.samples, per_step=per_step)
    old_all = _old_log_probs(batch, likelihood, per_step or cfg.ratio == "fpo", cfg.minibatch_size)
    stats: dict[str, list[float]] = {}
    for _ in range(cfg.epochs):
        perm = torch.randperm(m, generator=generator)
        for i in range(0, m, cfg.minibatch_size):
            idx = perm[i:i + cfg.minibatch_size]
            mb = batch.index(idx)
            new_lp = likelihood(mb, idx)
            loss, st = clipped_surrogate_loss(new_lp, old_all[idx], mb.advantages, clip_eps=cfg.clip_eps,
                                              weights=mb.weights)
            if cfg.kl_coef > 0 and ref_policy is not None:
                with torch.no_grad():
                    ref_lp = ref_policy.log_prob(mb.obs, mb.samples, per_step=per_step)
                kl = kl_to_reference(new_lp, ref_lp)
                loss = loss + cfg.kl_coef * kl
                st["kl_ref"] = float(kl.detach())
            if not torch.isfinite(loss):
                raise FloatingPointError("GRPO loss is NaN/inf: the policy's log_prob is not finite for a recorded chain")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            optimizer.step()
            st["loss"] = float(loss.detach())
            st["grad_norm"] = float(gn)
            for k, v in st.items():
                stats.setdefault(k, []).append(v)
    return {k: float(np.mean(v)) for k, v in stats.items()}


def make_reference(policy: Policy) -> Policy:
    """A frozen deep copy of ``policy`` (the KL reference)."""
    ref = copy.deepcopy(policy)
    for p in ref.parameters():  # type: ignore[attr-defined]
        p.requires_grad_(False)
    return ref


# --------------------------------------------------------------------------------------------
# World-model reward mitigations
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def inverse_variance_rewards(rollouts: Sequence[Rollout], replay_envs: Sequence[ChunkEnv], starts_of: Callable[[Rollout], list[Start]],
                             reward_mode: str, success_bonus: float, base_rewards: torch.Tensor,
                             var_floor: float = 1e-3) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Inverse-variance denoising of imagined rewards (WMRL-style).

    Every rollout's recorded action chunks are replayed open-loop from its start in each env of
    ``replay_envs`` (several seeds of a stochastic world model, or an ensemble), for at most as many
    chunks as the rollout ran (a replay may end earlier on its own success), giving ``S + 1``
    reward estimates per rollout (with the original). The reward becomes their mean; each group's
    weight is ``1 / (var_floor + mean member variance)``, normalised to mean 1 over groups.

    Args:
        rollouts: collected batches; ``starts_of(rollout)`` gives the starts its slots were reset to.
        base_rewards: ``float32 (M,)`` rewards of the original rollouts (:func:`rollout_returns`).

    Returns: ``(rewards (M,), weights (M,), stats)``."""
    samples_per = [base_rewards]
    for env in replay_envs:
        rs = []
        for ro in rollouts:
            acts = [s for s in ro.samples]

            def fn(n, obs, acts=acts):
                return acts[n] if n < len(acts) else acts[-1]

            rep = rollout_batch(env, None, starts_of(ro), ro.group_ids, max_chunks=len(acts), actions_fn=fn,  # type: ignore[arg-type]
                                chunk_limits=ro.alive.sum(1))   # each replay stops where its rollout ended
            rs.append(rep)
        r, _, _ = rollout_returns(rs, reward_mode, success_bonus)
        samples_per.append(r)
    est = torch.stack(samples_per, 0)  # (S+1, M)
    mean = est.mean(0)
    var = est.var(0, unbiased=False)
    _, _, gids = rollout_returns(rollouts, reward_mode, success_bonus)
    w = torch.ones_like(mean)
    for g in torch.unique(gids).tolist():
        m = gids == g
        w[m] = 1.0 / (var_floor + float(var[m].mean()))
    w = w / w.mean().clamp_min(1e-12)
    return mean, w, {"denoise_var_mean": float(var.mean()), "denoise_weight_min": float(w.min()),
                     "denoise_weight_max": float(w.max())}


class OnlineDebiaser:
    """Online debiasing of imagined rewards from a few real-sim rollouts (WMRL-style).

    ``update(tasks, imagined, real)`` takes per-rollout rewards of the *current* policy from the same
    starts in imagination and in the real sim and updates a per-task bias estimate
    ``b_task = EMA(mean(imagined) - mean(real))``; ``correct(tasks, rewards)`` subtracts it.

    Note: a per-task constant cancels inside a group-relative advantage; the correction matters for
    the reported imagined reward / success and whenever the advantage mixes groups (e.g.
    ``scale_by_std=False`` with a global baseline). ``success_bias`` tracks imagined minus real
    success in the same way.
    """

    def __init__(self, momentum: float = 0.5):
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        self.momentum = momentum
        self.bias: dict[str, float] = {}
        self.success_bias: dict[str, float] = {}

    def _ema(self, store: dict[str, float], key: str, value: float) -> None:
        store[key] = value if key not in store else self.momentum * store[key] + (1 - self.momentum) * value

    def update(self, tasks: Sequence[str], imagined: torch.Tensor, real: torch.Tensor,
               imagined_success: torch.Tensor | None = None, real_success: torch.Tensor | None = None,
               real_tasks: Sequence[str] | None = None) -> dict[str, float]:
        """Update the estimates. ``imagined (M,)`` with ``tasks`` (M task names); ``real (M_r,)`` with
        ``real_tasks`` (defaults to ``tasks``). Returns the new biases as ``{"bias/<task>": b}``."""
        real_tasks = list(tasks) if real_tasks is None else list(real_tasks)
        if len(tasks) != imagined.shape[0] or len(real_tasks) != real.shape[0]:
            raise ValueError("OnlineDebiaser.update: one task name per reward is needed")
        out = {}
        for t in sorted(set(tasks) & set(real_tasks)):
            mi = torch.tensor([x == t for x in tasks]); mr = torch.tensor([x == t for x in real_tasks])
            self._ema(self.bias, t, float(imagined[mi].float().mean() - real[mr].float().mean()))
            out[f"bias/{t}"] = self.bias[t]
            if imagined_success is not None and real_success is not None:
                self._ema(self.success_bias, t, float(imagined_success[mi].float().mean() - real_success[mr].float().mean()))
                out[f"success_bias/{t}"] = self.success_bias[t]
        return out

    def correct(self, tasks: Sequence[str], rewards: torch.Tensor) -> torch.Tensor:
        """``rewards (M,)`` minus the bias of each reward's task (0 for tasks not yet estimated)."""
        b = torch.tensor([self.bias.get(t, 0.0) for t in tasks], dtype=rewards.dtype)
        return rewards - b

    def state_dict(self) -> dict:
        return {"momentum": self.momentum, "bias": dict(self.bias), "success_bias": dict(self.success_bias)}

    def load_state_dict(self, d: dict) -> None:
        self.momentum = float(d.get("momentum", self.momentum))
        self.bias = {k: float(v) for k, v in d.get("bias", {}).items()}
        self.success_bias = {k: float(v) for k, v in d.get("success_bias", {}).items()}


# --------------------------------------------------------------------------------------------
# One iteration: collect -> advantages -> update
# --------------------------------------------------------------------------------------------


@dataclass
class IterationResult:
    stats: dict[str, float] = field(default_factory=dict)
    rollouts: list[Rollout] = field(default_factory=list)


def grpo_iteration(env: ChunkEnv, policy: Policy, optimizer: torch.optim.Optimizer, starts: Sequence[Start],
                   cfg: GRPOConfig, ref_policy: Policy | None = None, generator: torch.Generator | None = None,
                   debiaser: OnlineDebiaser | None = None,
                   real_rollout_fn: Callable[[list[Start]], tuple[torch.Tensor, torch.Tensor]] | None = None,
                   debias_starts: int = 0, replay_envs: Sequence[ChunkEnv] = (),
                   progress: bool = False) -> IterationResult:
    """One GRPO iteration: collect ``G`` rollouts per start on ``env``, apply the optional
    world-model mitigations, compute group-relative advantages and run :func:`grpo_update`.

    Args:
        debiaser, real_rollout_fn, debias_starts: online debiasing. When all are given,
            ``real_rollout_fn(starts[:debias_starts])`` runs the current policy in the real sim from
            those starts and returns ``(rewards (M_r,), success (M_r,))`` in order of the starts
            given (any number of rollouts per start, same reward definition); the imagined rollouts
            of the same starts update the debiaser before it corrects this iteration's rewards.
        replay_envs: inverse-variance denoising (see :func:`inverse_variance_rewards`).

    Returns diagnostics: ``reward_*``, ``success_rate`` (as the env reports it), ``adv_*``,
    ``valid_group_frac``, ``n_transitions``, the mitigation statistics and the update statistics.
    """
    if hasattr(policy, "eval"):
        policy.eval()  # type: ignore[attr-defined]  # no dropout: ratio is exactly 1 at unchanged params
    rollouts = collect_groups(env, policy, starts, cfg.group_size, cfg.max_chunks, generator=generator, progress=progress)
    rewards, success, gids = rollout_returns(rollouts, cfg.reward_mode, cfg.success_bonus)
    stats: dict[str, float] = {"success_rate": float(success.float().mean()), **describe(rewards, "reward")}
    tasks = [starts[int(g)].task_name for g in gids]
    weights = None
    if replay_envs:
        b = env.num_envs
        all_starts, _ = expand_starts(starts, cfg.group_size)
        batches = []
        for i in range(0, len(all_starts), b):
            st = list(all_starts[i:i + b])
            batches.append(st + [st[-1]] * (b - len(st)))
        lookup = {id(ro): batches[j] for j, ro in enumerate(rollouts)}
        rewards, weights, st = inverse_variance_rewards(rollouts, replay_envs, lambda ro: lookup[id(ro)],
                                                        cfg.reward_mode, cfg.success_bonus, rewards)
        stats.update(st)
    if debiaser is not None:
        if real_rollout_fn is not None and debias_starts > 0:
            sub = list(starts[:debias_starts])
            real_r, real_s = real_rollout_fn(sub)
            m = gids < len(sub)
            stats.update(debiaser.update([tasks[i] for i in m.nonzero().flatten().tolist()], rewards[m], real_r.float(),
                                         imagined_success=success[m], real_success=real_s,
                                         real_tasks=_tasks_for(sub, int(real_r.shape[0]))))
            stats["debias_real_success"] = float(real_s.float().mean())
            stats["debias_imagined_success"] = float(success[m].float().mean())
        rewards = debiaser.correct(tasks, rewards)
        stats.update(describe(rewards, "reward_debiased"))
    adv, valid = group_advantages(rewards, gids, std_floor=cfg.std_floor, scale_by_std=cfg.scale_by_std)
    stats.update(describe(adv[valid], "adv"))
    n_groups = len(torch.unique(gids))
    stats["valid_group_frac"] = float(len(torch.unique(gids[valid]))) / max(n_groups, 1)
    batch = build_transitions(rollouts, adv, valid, weights)
    stats["n_transitions"] = float(0 if batch is None else len(batch))
    if batch is not None:
        stats.update(grpo_update(policy, optimizer, batch, cfg, ref_policy=ref_policy, generator=generator))
    return IterationResult(stats=stats, rollouts=rollouts)


def _tasks_for(starts: Sequence[Start], m: int) -> list[str]:
    """Task names of ``m`` real rollouts spread evenly over ``starts`` (``m`` a multiple of len)."""
    if m % len(starts):
        raise ValueError(f"real_rollout_fn returned {m} rewards for {len(starts)} starts (need a multiple)")
    k = m // len(starts)
    return [s.task_name for s in starts for _ in range(k)]


def real_rollout_fn_for(env: ChunkEnv, policy: Policy, cfg: GRPOConfig, rollouts_per_start: int = 1,
                        generator: torch.Generator | None = None) -> Callable[[list[Start]], tuple[torch.Tensor, torch.Tensor]]:
    """A ``real_rollout_fn`` for :func:`grpo_iteration` that runs ``policy`` on ``env`` (the real sim)."""

    def fn(starts: list[Start]) -> tuple[torch.Tensor, torch.Tensor]:
        ros = collect_groups(env, policy, starts, rollouts_per_start, cfg.max_chunks, generator=generator)
        r, s, _ = rollout_returns(ros, cfg.reward_mode, cfg.success_bonus)
        return r, s

    return fn


# --------------------------------------------------------------------------------------------
# Optimizer state <-> named tensors (safetensors; no pickle)
# --------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------
# The training loop: iterations, periodic real evaluation, checkpoints, resume
# --------------------------------------------------------------------------------------------


def train_grpo(policy: Policy, policy_config: dict, env: ChunkEnv, optimizer: torch.optim.Optimizer,
               starts_fn: Callable[[int], list[Start]], cfg: GRPOConfig, iterations: int, out_dir,
               ref_policy: Policy | None = None,
               evaluate_fn: Callable[[Policy, int], dict] | None = None, eval_every: int = 0,
               checkpoint_every: int = 1, resume: bool = True, seed: int = 0,
               debiaser: OnlineDebiaser | None = None,
               real_rollout_fn: Callable[[list[Start]], tuple[torch.Tensor, torch.Tensor]] | None = None,
               debias_starts: int = 0, debias_every: int = 1, replay_envs: Sequence[ChunkEnv] = (),
               refresh_fn: Callable[[Policy, int], dict] | None = None, refresh_every: int = 0,
               writer=None, progress: bool = True, rng_streams: Mapping[str, Any] | None = None) -> dict:
    """GRPO post-training: ``iterations`` times :func:`grpo_iteration` on ``starts_fn(iteration)``.

    Checkpoints go to ``out_dir/checkpoints/step_<n>`` and ``.../last`` (policy weights, optimizer
    state and RNG state in safetensors, history in ``meta.json``); with ``resume`` the loop continues
    from ``last`` and reproduces the run that was not interrupted. ``evaluate_fn(policy, n)`` (real-sim
    evaluation on held-out init states, returning at least ``{"success": float}``) runs before the
    first iteration, every ``eval_every`` iterations and after the last one.
    ``refresh_fn(policy, n)`` (world model in the loop, e.g. :class:`wmrl.refresh.WorldModelRefresher`)
    runs after iteration ``n`` whenever ``n % refresh_every == 0`` and ``n < iterations``, before the
    checkpoint of ``n`` is written; its returned scalars join that iteration's history entry. It
    must restore its own state on resume (the refresher reloads its last round).
    ``rng_streams``: the generators the environments and rollout functions draw from between
    iterations (``wmrl.kernel.interfaces.RandomStreams``; e.g. the imagination env's sampling generator),
    saved with every checkpoint and restored with the loop's own and the process-wide ones
    (``wmrl.kernel.rng``), so a resumed run is bitwise the uninterrupted one.

    Returns ``{"history": [per-iteration stats], "evals": [{"iteration", ...}], "iterations",
    "checkpoint", "resumed_from"}``.
    """
    from pathlib import Path

    from wmrl.kernel.checkpoint import (
        checkpoint_exists,
        load_checkpoint_meta,
        load_extra_tensors,
        save_checkpoint,
        verify_checkpoint,
    )
    from wmrl.kernel.rng import capture_rng, restore_rng

    out_dir = Path(out_dir)
    ck_dir = out_dir / "checkpoints"
    gen = torch.Generator().manual_seed(seed)
    history: list[dict] = []
    evals: list[dict] = []
    start_it = 0
    resumed_from = None
    last = ck_dir / "last"
    if resume and checkpoint_exists(last):
        from safetensors.torch import load_model

        verify_checkpoint(last)
        load_model(policy, str(last / "model.safetensors"))  # type: ignore[arg-type]
        meta = load_checkpoint_meta(last)
        extra = load_extra_tensors(last)
        optimizer_from_tensors(optimizer, extra, meta["optimizer"])
        gen.set_state(extra["rng/torch"])
        if "rng" in meta:
            missing = restore_rng(extra, meta["rng"], rng_streams)
            if missing:
                log.warning("%s has no saved state for the RNG stream(s) %s: they continue from their seeds", last, missing)
        else:
            log.warning("%s was written by an older wmrl without the environments' RNG states: the resumed run "
                        "is not bitwise the uninterrupted one", last)
        history, evals = meta["history"], meta["evals"]
        start_it = int(meta["iteration"])
        if debiaser is not None and "debiaser" in meta:
            debiaser.load_state_dict(meta["debiaser"])
        resumed_from = str(last)

    def _eval(n: int) -> None:
        if evaluate_fn is None or any(e["iteration"] == n for e in evals):
            return
        e = dict(evaluate_fn(policy, n))
        e["iteration"] = n
        evals.append(e)
        if writer is not None and "success" in e:
            writer.add_scalar("eval/real_success", e["success"], n)

    def _save(n: int) -> None:
        tensors, ometa = optimizer_to_tensors(optimizer)
        tensors["rng/torch"] = gen.get_state()
        rng_tensors, rng_meta = capture_rng(rng_streams)
        tensors.update(rng_tensors)
        meta = {"iteration": n, "history": history, "evals": evals, "optimizer": ometa, "rng": rng_meta}
        if debiaser is not None:
            meta["debiaser"] = debiaser.state_dict()
        save_checkpoint(policy, last, policy_config, extra_tensors=tensors, meta=meta)  # type: ignore[arg-type]
        if checkpoint_every and n % checkpoint_every == 0:
            save_checkpoint(policy, ck_dir / f"step_{n}", policy_config)  # type: ignore[arg-type]

    if start_it == 0:   # a resumed run has the evaluations of its iterations in the checkpoint
        _eval(0)
    its = range(start_it, iterations)
    if progress:
        from tqdm import tqdm

        its = tqdm(its, desc="GRPO", initial=start_it, total=iterations)
    for it in its:
        t0 = time.time()
        do_debias = debiaser is not None and real_rollout_fn is not None and debias_every > 0 and it % debias_every == 0
        res = grpo_iteration(env, policy, optimizer, starts_fn(it), cfg, ref_policy=ref_policy, generator=gen,
                             debiaser=debiaser, real_rollout_fn=real_rollout_fn if do_debias else None,
                             debias_starts=debias_starts, replay_envs=replay_envs)
        st = {"iteration": it + 1, "wall_s": time.time() - t0, **res.stats}
        history.append(st)
        if writer is not None:
            for k, v in st.items():
                if k != "iteration":
                    writer.add_scalar(f"grpo/{k}", v, it + 1)
        if progress:
            its.set_postfix(reward=f"{st['reward_mean']:.3f}", succ=f"{st['success_rate']:.2f}")  # type: ignore[union-attr]
        if refresh_fn is not None and refresh_every > 0 and (it + 1) % refresh_every == 0 and it + 1 < iterations:
            st.update(refresh_fn(policy, it + 1))
            if writer is not None:
                for k, v in st.items():
                    if k.startswith("refresh/"):
                        writer.add_scalar(k, v, it + 1)
        if eval_every and (it + 1) % eval_every == 0:
            _eval(it + 1)
        if it + 1 == iterations:
            _eval(it + 1)
        _save(it + 1)
    if start_it >= iterations and not (last / "model.safetensors").is_file():
        _save(start_it)
    return {"history": history, "evals": evals, "iterations": iterations, "checkpoint": str(last),
            "resumed_from": resumed_from}


# --------------------------------------------------------------------------------------------
# Start providers and a plain success evaluator (composition roots pass them in)
# --------------------------------------------------------------------------------------------


class InitStateStarts:
    """Starts at a task's init states, ``per_task`` per iteration, drawn reproducibly from
    ``iteration`` and ``seed``.

    Args:
        tasks: task name -> instruction.
        n_init: number of init states of ``split`` per task (indices ``0..n_init-1``).
        per_task: starts per task per iteration.
        split: ``"train"`` (for training) or ``"eval"``.
    """

    def __init__(self, tasks: dict, n_init: int, per_task: int, split: str = "train", seed: int = 0):
        if not tasks:
            raise ValueError("InitStateStarts needs at least one task")
        if per_task < 1 or n_init < 1:
            raise ValueError(f"per_task and n_init must be >= 1, got {per_task}, {n_init}")
        self.tasks, self.n_init, self.per_task, self.split, self.seed = dict(tasks), int(n_init), int(per_task), split, int(seed)

    def __call__(self, iteration: int) -> list[Start]:
        rng = np.random.default_rng([self.seed, int(iteration)])
        out = []
        for name, instr in self.tasks.items():
            idx = rng.choice(self.n_init, size=self.per_task, replace=self.per_task > self.n_init)
            out += [Start(task_name=name, instruction=instr, init_index=int(i), split=self.split) for i in idx]  # type: ignore[arg-type]
        return out


def all_starts(tasks: dict, n: int, split: str = "eval") -> list[Start]:
    """Every init state ``0..n-1`` of ``split`` for each task (held-out evaluation starts)."""
    return [Start(task_name=t, instruction=i, init_index=k, split=split) for t, i in tasks.items() for k in range(n)]  # type: ignore[arg-type]


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval (95 % by default) of a binomial proportion; ``(0, 1)`` when ``n == 0``."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    den = 1 + z * z / n
    c = (p + z * z / (2 * n)) / den
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, c - h), min(1.0, c + h)


@torch.no_grad()
def evaluate_success(env: ChunkEnv, policy: Policy, starts: Sequence[Start], max_chunks: int, seed: int = 0,
                     progress: bool = False) -> dict:
    """Success of ``policy`` on ``env`` from every start once (batches of ``env.num_envs``; results do
    not depend on the batch size for a deterministic policy and env).

    Returns ``{"success": mean, "n": M, "ci95": [lo, hi], "per_task": {task: {"success", "n",
    "ci95"}}, "episodes": [{"task", "init_index", "success"}]}``."""
    gen = torch.Generator().manual_seed(seed)
    ros = collect_groups(env, policy, starts, 1, max_chunks, generator=gen, progress=progress)
    _, succ, gids = rollout_returns(ros, "success")
    rows = [{"task": starts[int(g)].task_name, "init_index": starts[int(g)].init_index, "success": bool(s)}
            for g, s in zip(gids, succ)]
    per_task = {}
    for t in dict.fromkeys(r["task"] for r in rows):
        k = [r["success"] for r in rows if r["task"] == t]
        per_task[t] = {"success": float(np.mean(k)), "n": len(k), "ci95": list(wilson_interval(int(sum(k)), len(k)))}
    return {"success": float(succ.float().mean()), "n": int(succ.numel()),
            "ci95": list(wilson_interval(int(succ.sum()), int(succ.numel()))), "per_task": per_task, "episodes": rows}
