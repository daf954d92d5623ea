"""GRPO's math: group-relative advantages, the clipped surrogate, the KL to a reference, summaries.

Small pure functions with shape docstrings (in the style of CleanRL's ``ppo_continuous_action.py``
and RLinf's ``algorithms/advantages.py``):

* :func:`group_advantages`: group-relative advantages (GRPO, Shao et al. 2024, DeepSeekMath) of the
  per-rollout rewards, ``(r - mean_g) / max(std_g, std_floor)``; groups whose rewards are all
  equal carry no signal, get exactly zero advantage and are left out of the loss denominator.
* :func:`clipped_surrogate_loss`: PPO's clipped surrogate (Schulman et al. 2017) on chunk log-probs.
* :func:`kl_to_reference`: k3 estimator of the KL to a frozen reference policy (Schulman 2020,
  "Approximating KL divergence"), as in Flow-GRPO (Liu et al. 2025).

Masks are "True = keep" everywhere (:func:`wmrl.kernel.tensors.masked_mean`, the one masked mean).
Shape legend: see :mod:`wmrl.kernel.types` (``B`` slots, ``G`` group size, ``N`` chunks per rollout).
"""

from __future__ import annotations

import math

import torch

from wmrl.kernel.tensors import masked_mean

__all__ = ["clipped_surrogate_loss", "describe", "group_advantages", "kl_to_reference", "masked_mean"]


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
