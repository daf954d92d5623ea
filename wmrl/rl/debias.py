"""World-model reward mitigations (WMRL-style, both switchable, both reported).

* :class:`OnlineDebiaser`: the bias of imagined rewards / success, estimated per task from a few
  real-sim rollouts of the current policy from the same starts (:func:`real_rollout_fn_for`), is
  subtracted from imagined rewards.
* :func:`inverse_variance_rewards`: several imagined replays (stochastic world model seeds or an
  ensemble of imagination envs) of every rollout's action chunks; the reward becomes their mean
  and each group is weighted by the inverse variance of its reward estimates.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from wmrl.kernel.interfaces import ChunkEnv, Policy
from wmrl.kernel.types import Rollout, Start
from wmrl.rl.rollout import collect_groups, replay_open_loop, rollout_returns


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
        for ro in rollouts:   # each replay stops where its rollout ended
            chunks = torch.stack([s.actions for s in ro.samples], 1)
            rs.append(replay_open_loop(env, starts_of(ro), ro.group_ids, chunks, ro.alive.sum(1)))
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


def tasks_for(starts: Sequence[Start], m: int) -> list[str]:
    """Task names of ``m`` real rollouts spread evenly over ``starts`` (``m`` a multiple of len)."""
    if m % len(starts):
        raise ValueError(f"real_rollout_fn returned {m} rewards for {len(starts)} starts (need a multiple)")
    k = m // len(starts)
    return [s.task_name for s in starts for _ in range(k)]


def real_rollout_fn_for(env: ChunkEnv, policy: Policy, cfg, rollouts_per_start: int = 1,
                        generator: torch.Generator | None = None) -> Callable[[list[Start]], tuple[torch.Tensor, torch.Tensor]]:
    """A ``real_rollout_fn`` for :func:`wmrl.rl.loop.grpo_iteration` that runs ``policy`` on ``env`` (the
    real sim) with ``cfg``'s (a ``GRPOConfig``) horizon and reward definition."""

    def fn(starts: list[Start]) -> tuple[torch.Tensor, torch.Tensor]:
        ros = collect_groups(env, policy, starts, rollouts_per_start, cfg.max_chunks, generator=generator)
        r, s, _ = rollout_returns(ros, cfg.reward_mode, cfg.success_bonus)
        return r, s

    return fn
