"""A chunk-level value baseline for the policy update: per-chunk rewards, GAE and a small value head.

Group-relative advantages (:func:`wmrl.rl.losses.group_advantages`) give every chunk of a rollout
the same trajectory-level advantage; over 13-20 chunks that is a high-variance signal. With
``GRPOConfig.advantage = "gae"`` the update uses instead generalised advantage estimation
(Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage
Estimation"; the form of CleanRL's ``ppo_continuous_action.py`` and RLinf's
``algorithms/advantages.py``) over the chunks, with a learnt value ``V(s_n)`` of each chunk's
observation: a small MLP on the frozen policy's conditioning features (``PolicySample.extras
["cond"]``, ``float32 (B, C)``, which :class:`policies.steering.LatentNoisePolicy` records, or
``policy.encode`` of a ``SteerableFlowPolicy``) and the chunk's index, fitted on the rollouts'
returns after their advantages are computed (PPO's order). Branches (``Start.max_chunks``: 2-3
chunks from a real keyframe, VLA-MBPO) that stop while their episode goes on are bootstrapped by
the value of the observation after their last chunk. A value that equals the return gives
zero advantage; with ``gae_lambda = 1`` and a zero value the advantage of chunk ``n`` is the return
from ``n`` on.

Shapes: ``B`` slots, ``N`` chunks (:class:`wmrl.kernel.types.Rollout`), ``C`` feature size.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from wmrl.kernel.types import Rollout

__all__ = ["ChunkValue", "ValueBaseline", "branch_bootstrap", "chunk_rewards", "gae", "last_alive"]


def last_alive(alive: torch.Tensor) -> torch.Tensor:
    """``int64 (B,)`` index of each slot's last alive chunk (``-1`` for a slot never alive).

    Raises:
        ValueError: ``alive`` not 2-D, or a slot alive again after a dead chunk (episodes are prefixes).
    """
    if alive.ndim != 2:
        raise ValueError(f"alive must be (B, N), got {tuple(alive.shape)}")
    a = alive.bool()
    if (a[:, 1:] & ~a[:, :-1]).any():
        raise ValueError("alive must be a prefix per slot (True ... True False ... False)")
    return a.sum(1).long() - 1


def chunk_rewards(ro: Rollout, reward_mode: str = "return", success_bonus: float = 1.0) -> torch.Tensor:
    """``float32 (B, N)`` per-chunk rewards whose sum over the alive chunks is the slot's scalar
    reward of :func:`wmrl.rl.rollout.rollout_returns` in the same ``reward_mode``: the env's chunk
    rewards (``"return"``), the success indicator on the last alive chunk (``"success"``), or both
    with ``success_bonus`` (``"return+success"``). Dead chunks get 0.

    Raises:
        ValueError: an unknown ``reward_mode``.
    """
    if reward_mode not in ("return", "success", "return+success"):
        raise ValueError(f"reward_mode must be 'return', 'success' or 'return+success', got {reward_mode!r}")
    alive = ro.alive.bool()
    r = torch.zeros(alive.shape, dtype=torch.float32)
    if reward_mode != "success":
        r = r + ro.rewards.float() * alive
    if reward_mode != "return":
        bonus = 1.0 if reward_mode == "success" else float(success_bonus)
        last = last_alive(alive)
        rows = (last >= 0).nonzero().flatten()
        r[rows, last[rows]] += bonus * ro.success[rows].float()
    return r


def gae(rewards: torch.Tensor, values: torch.Tensor, alive: torch.Tensor, gamma: float = 1.0, lam: float = 0.95,
        bootstrap: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over chunks (Schulman et al. 2016).

    ``delta_n = r_n + gamma * V_{n+1} - V_n`` and ``A_n = delta_n + gamma * lam * A_{n+1}``, where
    after a slot's last alive chunk ``V`` is ``bootstrap`` (``0``: the episode ended; a value: a
    branch cut short, whose rest the value estimates) and ``A`` is 0.

    Args:
        rewards: ``float (B, N)`` chunk rewards (dead chunks ignored).
        values: ``float (B, N)`` ``V(s_n)`` of each chunk's observation (dead chunks ignored).
        alive: ``bool (B, N)``, a prefix per slot.
        gamma: discount per chunk, in ``[0, 1]``; lam: GAE's lambda, in ``[0, 1]``.
        bootstrap: ``float (B,)`` value after the last alive chunk (default 0).

    Returns:
        ``(advantages, returns)``, ``float32 (B, N)``; ``returns = advantages + values`` on alive
        chunks (the value's regression target), both 0 on dead chunks.

    Raises:
        ValueError: mismatched shapes, ``gamma`` or ``lam`` outside ``[0, 1]``, non-finite inputs.
    """
    if rewards.shape != values.shape or rewards.shape != alive.shape or rewards.ndim != 2:
        raise ValueError(f"rewards {tuple(rewards.shape)}, values {tuple(values.shape)} and alive "
                         f"{tuple(alive.shape)} must be the same (B, N)")
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gamma and lam must be in [0, 1], got gamma={gamma}, lam={lam}")
    a = alive.bool()
    last_alive(a)
    r = torch.where(a, rewards.double(), torch.zeros((), dtype=torch.float64))
    v = torch.where(a, values.double(), torch.zeros((), dtype=torch.float64))
    if not (torch.isfinite(r).all() and torch.isfinite(v).all()):
        raise ValueError("rewards or values hold NaN or inf")
    B, N = r.shape
    boot = torch.zeros(B, dtype=torch.float64) if bootstrap is None else bootstrap.double().reshape(B)
    adv = torch.zeros(B, N, dtype=torch.float64)
    next_adv = torch.zeros(B, dtype=torch.float64)
    for n in range(N - 1, -1, -1):
        alive_next = a[:, n + 1] if n + 1 < N else torch.zeros(B, dtype=torch.bool)
        nv = torch.where(alive_next, v[:, n + 1] if n + 1 < N else boot, boot)
        na = torch.where(alive_next, next_adv, torch.zeros((), dtype=torch.float64))
        delta = r[:, n] + gamma * nv - v[:, n]
        cur = torch.where(a[:, n], delta + gamma * lam * na, torch.zeros((), dtype=torch.float64))
        adv[:, n] = cur
        next_adv = cur
    ret = torch.where(a, adv + v, torch.zeros((), dtype=torch.float64))
    return adv.float(), ret.float()


class ChunkValue(nn.Module):
    """``V(s_n)``: an MLP on the frozen policy features ``float32 (M, C)`` and the chunk's relative
    index ``n / max_chunks`` (the rollouts have a finite horizon), giving ``float32 (M,)``."""

    def __init__(self, feature_dim: int, hidden: int = 256, max_chunks: int = 10):
        super().__init__()
        if feature_dim < 1 or max_chunks < 1:
            raise ValueError(f"feature_dim and max_chunks must be >= 1, got {feature_dim}, {max_chunks}")
        self.max_chunks = int(max_chunks)
        self.net = nn.Sequential(nn.Linear(feature_dim + 1, hidden), nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU(),
                                 nn.Linear(hidden, 1))

    def forward(self, features: torch.Tensor, chunk_index: torch.Tensor) -> torch.Tensor:
        t = (chunk_index.float() / self.max_chunks).reshape(-1, 1).to(features.device)
        return self.net(torch.cat([features.float(), t], 1)).squeeze(1)


def _encode(policy, obs) -> torch.Tensor:
    enc = getattr(policy, "encode", None) or getattr(getattr(policy, "base", None), "encode", None)
    if enc is None:
        raise ValueError(f"the value baseline needs policy features: samples with extras['cond'] "
                         f"(policies.steering.LatentNoisePolicy) or a policy (or frozen base) with encode(); "
                         f"{type(policy).__name__} has neither (use advantage=group)")
    with torch.no_grad():
        return enc(obs.images, obs.proprio, obs.task).detach().float().cpu()


def rollout_features(policy, ro: Rollout) -> torch.Tensor:
    """``float32 (B, N, C)`` frozen policy features of each chunk's observation (no grad).

    Raises:
        ValueError: the samples carry no ``extras["cond"]`` and the policy has no ``encode``.
    """
    out = []
    for obs, s in zip(ro.obs, ro.samples):
        cond = s.extras.get("cond") if s.extras else None
        out.append(cond.detach().float().cpu() if cond is not None else _encode(policy, obs))
    return torch.stack(out, 1)


def branch_bootstrap(policy, value: ChunkValue, ro: Rollout) -> torch.Tensor:
    """``float32 (B,)``: ``V`` of the observation after the last chunk for the slots a branch cut
    (``Rollout.cut``), at the chunk index after their last alive one; 0 elsewhere."""
    b = ro.alive.shape[0]
    if ro.cut is None or not bool(ro.cut.any()):
        return torch.zeros(b)
    if ro.final_obs is None:
        raise ValueError("a rollout with cut branches needs final_obs to bootstrap them")
    f = _encode(policy, ro.final_obs)
    with torch.no_grad():
        v = value(f, last_alive(ro.alive).clamp_min(0) + 1)
    return torch.where(ro.cut.bool(), v, torch.zeros(()))


class ValueBaseline:
    """The value head, its optimiser and its fit: :meth:`advantages` turns rollouts into per-chunk
    GAE advantages with the current value, then fits the value on the returns.

    Args:
        feature_dim: ``C``; max_chunks: ``N`` of the rollouts.
        gamma, lam: see :func:`gae`. lr: Adam's learning rate. epochs, minibatch_size: the fit.
        normalize: advantages standardised over the batch's alive chunks (PPO's practice).
        seed: the fit's minibatch order generator (saved with :meth:`state_tensors`).
    """

    def __init__(self, feature_dim: int, max_chunks: int, hidden: int = 256, gamma: float = 1.0, lam: float = 0.95,
                 lr: float = 1e-3, epochs: int = 4, minibatch_size: int = 256, normalize: bool = True, seed: int = 0):
        with torch.random.fork_rng(devices=[]):  # the head's init from the seed, the process RNG untouched
            torch.manual_seed(int(seed))
            self.module = ChunkValue(feature_dim, hidden, max_chunks)
        self.opt = torch.optim.Adam(self.module.parameters(), lr=lr)
        self.gamma, self.lam = float(gamma), float(lam)
        self.epochs, self.minibatch_size, self.normalize = int(epochs), int(minibatch_size), bool(normalize)
        self.gen = torch.Generator().manual_seed(int(seed))

    def values(self, feats: torch.Tensor) -> torch.Tensor:
        """``float32 (B, N)`` of features ``(B, N, C)`` (no grad)."""
        B, N, C = feats.shape
        idx = torch.arange(N).repeat(B)
        with torch.no_grad():
            return self.module(feats.reshape(B * N, C), idx).reshape(B, N)

    def advantages(self, policy, rollouts: Sequence[Rollout], rewards: Sequence[torch.Tensor]
                   ) -> tuple[list[torch.Tensor], dict]:
        """Per-rollout ``float32 (B, N)`` advantages of the chunk rewards ``rewards[j]`` ``(B, N)``,
        then one fit of the value on the returns. Stats: ``value_loss``, ``value_explained_var``
        (before the fit), ``value_mean``, ``return_mean``."""
        feats = [rollout_features(policy, ro) for ro in rollouts]
        advs, rets, masks = [], [], []
        for ro, f, r in zip(rollouts, feats, rewards):
            alive = ro.alive.bool() & (ro.group_ids >= 0)[:, None]
            boot = branch_bootstrap(policy, self.module, ro)
            a, ret = gae(r, self.values(f), alive, self.gamma, self.lam, bootstrap=boot)
            advs.append(a); rets.append(ret); masks.append(alive)
        flat_a = torch.cat([a[m] for a, m in zip(advs, masks)])
        if self.normalize and flat_a.numel() > 1:
            mu, sd = flat_a.mean(), flat_a.std().clamp_min(1e-6)
            advs = [torch.where(m, (a - mu) / sd, torch.zeros(())) for a, m in zip(advs, masks)]
        stats = self.fit(feats, rets, masks)
        return advs, stats

    def fit(self, feats: Sequence[torch.Tensor], returns: Sequence[torch.Tensor], masks: Sequence[torch.Tensor]) -> dict:
        """Regress ``V`` on ``returns`` over the alive chunks (MSE, ``epochs`` passes)."""
        xs, ns, ys = [], [], []
        for f, r, m in zip(feats, returns, masks):
            b, n = m.nonzero(as_tuple=True)
            xs.append(f[b, n]); ns.append(n); ys.append(r[b, n])
        if not xs or sum(x.shape[0] for x in xs) == 0:
            return {"value_loss": 0.0, "value_explained_var": 0.0}
        x, n, y = torch.cat(xs), torch.cat(ns), torch.cat(ys)
        with torch.no_grad():
            pred0 = self.module(x, n)
        var_y = float(y.var()) if y.numel() > 1 else 0.0
        ev = 1.0 - float((y - pred0).var()) / var_y if var_y > 0 else 0.0
        self.module.train()
        losses = []
        for _ in range(self.epochs):
            perm = torch.randperm(x.shape[0], generator=self.gen)
            for i in range(0, x.shape[0], self.minibatch_size):
                j = perm[i:i + self.minibatch_size]
                loss = ((self.module(x[j], n[j]) - y[j]) ** 2).mean()
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                self.opt.step()
                losses.append(float(loss.detach()))
        self.module.eval()
        return {"value_loss": sum(losses) / len(losses), "value_explained_var": ev, "value_mean": float(pred0.mean()),
                "return_mean": float(y.mean())}

    # ------------------------------------------------------------ checkpoint
    def state_tensors(self) -> tuple[dict[str, torch.Tensor], dict]:
        """``(tensors, meta)`` for a checkpoint: ``value/<param>``, ``value_opt/<index>/<key>``, the generator."""
        from wmrl.kernel.checkpoint import optimizer_to_tensors

        t = {f"value/{k}": v.detach().clone() for k, v in self.module.state_dict().items()}
        ot, om = optimizer_to_tensors(self.opt)
        t.update({"value_" + k: v for k, v in ot.items()})
        t["value_rng"] = self.gen.get_state()
        return t, {"optimizer": om}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """Inverse of :meth:`state_tensors` (raises ``KeyError`` when the checkpoint has no value head)."""
        from wmrl.kernel.checkpoint import optimizer_from_tensors

        sd = {k[len("value/"):]: v for k, v in tensors.items() if k.startswith("value/")}
        if not sd:
            raise KeyError("the checkpoint has no value head (value/...): it was written with advantage=group")
        self.module.load_state_dict(sd)
        optimizer_from_tensors(self.opt, {k[len("value_"):]: v for k, v in tensors.items() if k.startswith("value_opt/")},
                               meta["optimizer"])
        self.gen.set_state(tensors["value_rng"])
