"""GRPO's update: the flat transitions that enter the loss and PPO-style epochs over them.

:func:`grpo_update` runs epochs of the clipped surrogate (Schulman et al. 2017) on the chunk
log-probs, recomputed with gradient, with an optional KL penalty to a frozen reference policy
(:func:`make_reference`), as in Flow-GRPO (Liu et al. 2025). With ``ratio="fpo"`` the ratio is FPO's
instead (McAllister et al. 2025, "Flow Matching Policy Gradients"): ``exp(L_old - L_new)`` of the
sampled chunk's conditional flow-matching loss at fixed ``(t, eps)`` draws, so the update is an
advantage-signed, clipped flow-matching step on the executed chunks and needs no per-denoising-step
Gaussian densities.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from wmrl.kernel.interfaces import FlowPolicy, Policy
from wmrl.kernel.types import Obs, PolicySample, Rollout
from wmrl.rl.losses import clipped_surrogate_loss, kl_to_reference
from wmrl.rl.rollout import cat_samples


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

    def index(self, idx: torch.Tensor) -> TransitionBatch:
        return TransitionBatch(self.obs.index(idx), self.samples.index(idx), self.advantages[idx], self.weights[idx])


def build_transitions(rollouts: Sequence[Rollout], slot_adv: torch.Tensor, slot_valid: torch.Tensor,
                      slot_weight: torch.Tensor | None = None,
                      chunk_adv: Sequence[torch.Tensor] | None = None) -> TransitionBatch | None:
    """Flatten rollouts into the transitions that enter the loss.

    Args:
        slot_adv, slot_valid, slot_weight: ``(M,)`` per real slot, in the order of
            :func:`wmrl.rl.rollout.rollout_returns`. Only alive chunks of valid slots are kept.
        chunk_adv: per rollout ``float32 (B, N)`` advantages of each chunk (GAE,
            :mod:`wmrl.rl.value`), used instead of ``slot_adv``.

    Returns: a ``TransitionBatch`` or ``None`` when nothing carries signal."""
    obs_parts, sample_parts, adv_parts, w_parts = [], [], [], []
    k = 0
    for j, ro in enumerate(rollouts):
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
            adv_parts.append(chunk_adv[j][sel, n] if chunk_adv is not None else a[sel]); w_parts.append(w[sel])
    if not obs_parts:
        return None
    return TransitionBatch(Obs.cat(obs_parts), cat_samples(sample_parts), torch.cat(adv_parts), torch.cat(w_parts))


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
        reward_mode: see :func:`wmrl.rl.rollout.rollout_returns`.
        success_bonus: success bonus for ``reward_mode="return+success"``.
        ratio: ``"per_step"``: one importance ratio per denoising transition of the chain, each
            clipped (Flow-GRPO, Liu et al. 2025); ``"chain"``: one ratio for the whole chain's
            log-prob (its product over the steps, clipped far more often); ``"fpo"``: FPO's ratio
            ``exp(L_old - L_new)`` of the chunk's flow-matching loss (the policy needs
            ``flow_matching_loss``; ``kl_coef`` must be 0).
        fpo_samples: ``(t, eps)`` draws per chunk for the FPO loss estimate (drawn once per update,
            shared by the old and new parameters). ``t`` is uniform on ``[0.001, 1)``.
        advantage: ``"group"``: group-relative advantages of the rollouts' rewards, the same for
            every chunk of a rollout (GRPO); ``"gae"``: per-chunk GAE with a learnt chunk value
            (:mod:`wmrl.rl.value`; the loop needs a ``ValueBaseline``), groups no longer needed.
        gamma, gae_lambda: GAE's discount per chunk and lambda (``advantage="gae"``).
        value_hidden, value_lr, value_epochs, value_minibatch_size, normalize_advantages: the
            value head and its fit (``wmrl.rl.value.ValueBaseline``).
        anchor_coef: weight of the k3 KL to the reference on the chunks of the groups that carry no
            signal (every rollout of the group with the same return: no advantage), a minibatch of
            them beside each update minibatch (0 disables it). GRPO's loss sees only mixed groups, so
            a task whose groups are all failures (or all successes) gets no gradient of its own and
            is moved by the other tasks' updates through the shared weights; the anchor keeps the
            policy near the reference where nothing says it should move (the trust region of PPO's
            KL penalty, Schulman et al. 2017, applied to the states without an advantage).
            ``advantage="group"`` only; not with ``ratio="fpo"``.
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
    advantage: str = "group"
    gamma: float = 1.0
    gae_lambda: float = 0.95
    value_hidden: int = 256
    value_lr: float = 1e-3
    value_epochs: int = 20
    value_minibatch_size: int = 64
    normalize_advantages: bool = True
    anchor_coef: float = 0.0

    def __post_init__(self):
        if self.advantage not in ("group", "gae"):
            raise ValueError(f"GRPOConfig.advantage must be 'group' or 'gae', got {self.advantage!r}")
        if self.anchor_coef < 0:
            raise ValueError(f"GRPOConfig.anchor_coef must be >= 0, got {self.anchor_coef}")
        if self.anchor_coef > 0 and (self.ratio == "fpo" or self.advantage != "group"):
            raise ValueError("GRPOConfig.anchor_coef > 0 needs ratio 'per_step' or 'chain' and advantage 'group' "
                             f"(got ratio={self.ratio!r}, advantage={self.advantage!r})")
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
    if cfg.ratio == "fpo" and not isinstance(policy, FlowPolicy):
        raise ValueError(f"ratio='fpo' needs a flow-matching policy with flow_matching_loss(obs, sample, t, eps); "
                         f"{type(policy).__name__} has none (use ratio=per_step or chain)")


def _fpo_log_likelihood(policy: Policy, obs: Obs, samples: PolicySample, t: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """``-L_cfm`` ``float32 (B,)``: FPO's stand-in for the chunk log-likelihood (its differences are
    log-ratio estimates)."""
    return -policy.flow_matching_loss(obs, samples, t, eps)  # type: ignore[attr-defined]


def _kl_to(ref_policy: Policy, mb: TransitionBatch, new_lp: torch.Tensor, per_step: bool) -> torch.Tensor:
    """The k3 KL of the current policy (its log-probs ``new_lp`` of ``mb``'s chains) to ``ref_policy``."""
    with torch.no_grad():
        ref_lp = ref_policy.log_prob(mb.obs, mb.samples, per_step=per_step)
    return kl_to_reference(new_lp, ref_lp)


def grpo_update(policy: Policy, optimizer: torch.optim.Optimizer, batch: TransitionBatch, cfg: GRPOConfig,
                ref_policy: Policy | None = None, generator: torch.Generator | None = None,
                anchor: TransitionBatch | None = None) -> dict[str, float]:
    """PPO-style epochs over ``batch``; returns mean diagnostics (loss, approx_kl, clip_frac, kl_ref,
    grad_norm, ratio stats; ``kl_anchor`` with an anchor). ``policy`` must be a ``torch.nn.Module``
    whose ``log_prob`` (or, for ``cfg.ratio == "fpo"``, ``flow_matching_loss``) is differentiable.
    ``anchor``: the chunks of the groups without signal; with ``cfg.anchor_coef > 0`` and a
    ``ref_policy`` each gradient step adds ``anchor_coef`` times the KL to the reference on a random
    minibatch of them (``GRPOConfig.anchor_coef``)."""
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
                kl = _kl_to(ref_policy, mb, new_lp, per_step)
                loss = loss + cfg.kl_coef * kl
                st["kl_ref"] = float(kl.detach())
            if cfg.anchor_coef > 0 and ref_policy is not None and anchor is not None and len(anchor):
                ai = torch.randint(len(anchor), (min(cfg.minibatch_size, len(anchor)),), generator=generator)
                amb = anchor.index(ai)
                kl_a = _kl_to(ref_policy, amb, policy.log_prob(amb.obs, amb.samples, per_step=per_step), per_step)
                loss = loss + cfg.anchor_coef * kl_a
                st["kl_anchor"] = float(kl_a.detach())
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
