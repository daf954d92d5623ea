"""Latent-noise steering of a frozen flow-matching policy (DSRL).

Wagenmaker et al. 2025, "Steering Your Diffusion Policy with Latent Space Reinforcement Learning"
(arXiv 2506.15799): instead of fine-tuning the flow policy, RL trains a small *noise policy*
``pi_w(w | obs)`` that chooses the initial noise ``w`` of the flow ODE; the frozen flow policy maps
``w`` to an action chunk. The action chunks stay on the behaviour-cloned action manifold (any ``w``
the ODE integrates gives a chunk the flow learnt from demonstrations), the RL problem is small (a
head on the frozen observation features) and the log-probability is an exact Gaussian density, so
GRPO's ratios are cheap and exact.

Here ``pi_w(w | obs) = N(bound * tanh(f(c)), std^2 I)`` with ``c`` the frozen policy's observation
conditioning (``FlowVLAPolicy.encode``) and ``f`` an MLP whose last layer starts at zero: at
initialisation the deterministic steered policy (``std = 0``: ``w = mean = 0``) *is* the BC policy
with its evaluation sampler ``EulerODESampler(noise_scale=0)``.

``LatentNoisePolicy`` implements ``wmrl.kernel.interfaces.Policy`` and is saved / loaded with
``wmrl.kernel.checkpoint`` like any policy (the checkpoint holds the frozen base and the noise head).
Exploration is set through its ``sampler`` (``LatentNoiseSampler(std)``; ``std = 0`` evaluates the
mean), the same attribute GRPO and evaluation already swap for ``FlowVLAPolicy``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from policies.action_space import clip_to_space
from policies.samplers import EulerODESampler, gaussian_log_prob
from wmrl.kernel.interfaces import SteerableFlowPolicy
from wmrl.kernel.types import Obs, PolicySample


class LatentNoiseSampler:
    """How a :class:`LatentNoisePolicy` draws its latent noise: ``w ~ N(mean(obs), std^2 I)``.

    Args:
        std: exploration standard deviation in the flow's noise space (``>= 0``; the flow's prior is
            ``N(0, I)``, so 0.3-1.0 keeps ``w`` typical of it). ``0`` is deterministic (``w = mean``,
            the evaluation sampler; it has no density).
        num_steps: Euler steps of the frozen flow ODE from ``w`` to the action chunk (``>= 1``).
        residual_std: exploration std of the bounded residual's pre-``tanh`` value (``None``: ``std``;
            used only by a policy with ``residual_bound > 0``).

    Raises ``ValueError`` for a negative ``std`` / ``residual_std`` or ``num_steps < 1``.
    """

    def __init__(self, std: float = 0.0, num_steps: int = 10, residual_std: float | None = None):
        if float(std) < 0 or (residual_std is not None and float(residual_std) < 0):
            raise ValueError(f"LatentNoiseSampler.std and residual_std must be >= 0, got {std}, {residual_std}")
        if int(num_steps) < 1:
            raise ValueError(f"LatentNoiseSampler.num_steps must be >= 1, got {num_steps}")
        self.std = float(std)
        self.num_steps = int(num_steps)
        self.residual_std = self.std if residual_std is None else float(residual_std)

    @property
    def stochastic(self) -> bool:
        return self.std > 0

    def __repr__(self) -> str:
        return f"LatentNoiseSampler(std={self.std}, num_steps={self.num_steps}, residual_std={self.residual_std})"


class LatentNoisePolicy(nn.Module):
    """A frozen flow-matching policy steered by a learnt latent-noise policy (DSRL, see the module docstring).

    Args:
        base: the flow policy (a ``FlowVLAPolicy`` or its constructor config); its parameters are
            frozen (``requires_grad=False``).
        hidden: width of the noise head's two hidden layers.
        bound: the mean noise is ``bound * tanh(.)``, in ``(-bound, bound)`` per coordinate (DSRL's
            bounded noise action; keeps ``w`` where the flow was trained).
        sampler: a :class:`LatentNoiseSampler` (default: ``std=0``, deterministic evaluation).
        residual_bound: ``> 0`` adds a bounded residual to the first ``residual_dims`` action
            dimensions of every step of the chunk, ``residual_bound * tanh(u)`` with
            ``u ~ N(g(c), residual_std^2 I)`` and ``g`` an MLP on the same conditioning whose last
            layer starts at zero (Policy Decorator, Yuan et al. 2024; ResiP, Ankile et al. 2024):
            the policy can move a chunk a little off the flow's manifold, which steering alone
            cannot. In action units (``OSC_POSE`` delta: 1 = 5 cm; ``suite=ee`` targets: m), so
            ``|residual| < residual_bound`` always. ``0``: none (DSRL alone).
        residual_dims: the residual's dimensions, the first ``k`` of the action (``None``: all
            but the last, the gripper).

    Shapes: ``sample`` returns actions ``float32 (B, H, D_a)`` (unnormalised, clipped to the action
    space), ``log_prob`` ``float32 (B,)`` and ``extras``: ``latent_noise`` ``float32 (B, H, D_a)``,
    ``cond`` ``float32 (B, C)`` (the frozen conditioning, so ``log_prob`` need not re-encode images),
    ``latent_std`` ``float32 (B,)`` and, with a residual, ``residual_u`` ``float32 (B, H, k)`` (pre-``tanh``).

    ``supports_rtc`` is ``False``: the chunk is a deterministic ODE image of the steered noise, with no
    prefix guidance.
    """

    supports_rtc = False  # no real-time chunking (wmrl.kernel.interfaces.Policy)

    def __init__(self, base: Any, hidden: int = 256, bound: float = 1.5, sampler: LatentNoiseSampler | None = None,
                 residual_bound: float = 0.0, residual_dims: int | None = None):
        super().__init__()
        if isinstance(base, dict):
            from hydra.utils import instantiate

            base = instantiate(base, _convert_="all")
        if not isinstance(base, SteerableFlowPolicy):
            raise ValueError(f"LatentNoisePolicy steers a flow policy (wmrl.kernel.interfaces.SteerableFlowPolicy: "
                             f"encode(), velocity(), init_config, e.g. FlowVLAPolicy), got {type(base).__name__}")
        if float(bound) <= 0:
            raise ValueError(f"bound must be > 0, got {bound}")
        self.base = base
        for p in self.base.parameters():
            p.requires_grad_(False)
        self.chunk_size, self.action_dim = int(base.chunk_size), int(base.action_dim)
        self.action_space = base.action_space
        self.bound = float(bound)
        cond_dim = int(base.init_config["cond_dim"])
        out = self.chunk_size * self.action_dim
        self.noise_head = nn.Sequential(nn.Linear(cond_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU(),
                                        nn.Linear(hidden, out))
        nn.init.zeros_(self.noise_head[-1].weight)
        nn.init.zeros_(self.noise_head[-1].bias)
        if float(residual_bound) < 0:
            raise ValueError(f"residual_bound must be >= 0 (0: no residual), got {residual_bound}")
        self.residual_bound = float(residual_bound)
        self.residual_dims = int(self.action_dim - 1 if residual_dims is None else residual_dims)
        if not 1 <= self.residual_dims <= self.action_dim:
            raise ValueError(f"residual_dims must be in 1..{self.action_dim}, got {residual_dims}")
        self.residual_head = None
        if self.residual_bound > 0:
            self.residual_head = nn.Sequential(nn.Linear(cond_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden),
                                               nn.SiLU(), nn.Linear(hidden, self.chunk_size * self.residual_dims))
            nn.init.zeros_(self.residual_head[-1].weight)
            nn.init.zeros_(self.residual_head[-1].bias)
        self.sampler = sampler if sampler is not None else LatentNoiseSampler(0.0)
        base_cfg = dict(base.init_config)
        base_cfg.setdefault("_target_", f"{type(base).__module__}.{type(base).__qualname__}")
        self.init_config = dict(base=base_cfg, hidden=int(hidden), bound=self.bound)
        if self.residual_bound > 0:
            self.init_config.update(residual_bound=self.residual_bound, residual_dims=self.residual_dims)

    def checkpoint_config(self) -> dict:
        """Constructor arguments for ``wmrl.kernel.checkpoint.save_checkpoint``, with the deterministic
        evaluation sampler (``std=0``, this policy's ODE step count) whatever ``sampler`` is now."""
        steps = self.sampler.num_steps if isinstance(self.sampler, LatentNoiseSampler) else 10
        return dict(self.init_config, _target_="policies.steering.LatentNoisePolicy",
                    sampler={"_target_": "policies.steering.LatentNoiseSampler", "std": 0.0, "num_steps": steps})

    def residual_parameters(self) -> list[nn.Parameter]:
        """The bounded residual head's parameters (``[]`` without one)."""
        return [] if self.residual_head is None else list(self.residual_head.parameters())

    @property
    def device(self) -> torch.device:
        return self.base.device

    def train(self, mode: bool = True) -> "LatentNoisePolicy":
        super().train(mode)
        self.base.eval()  # frozen: no augmentation, no dropout
        return self

    def _check_sampler(self) -> LatentNoiseSampler:
        if not isinstance(self.sampler, LatentNoiseSampler):
            raise ValueError(f"LatentNoisePolicy samples with policies.steering.LatentNoiseSampler, got "
                             f"{type(self.sampler).__name__}: post-train a steered checkpoint with steer.enabled=true "
                             "(its exploration is steer.std), or set policy.sampler = LatentNoiseSampler(std)")
        return self.sampler

    def mean_noise(self, cond: torch.Tensor) -> torch.Tensor:
        """``float32 (B, H, D_a)`` mean latent noise for conditioning ``cond`` ``(B, C)``."""
        raw = self.noise_head(cond.float())
        return (self.bound * torch.tanh(raw)).reshape(-1, self.chunk_size, self.action_dim)

    def residual_mean(self, cond: torch.Tensor) -> torch.Tensor:
        """``float32 (B, H, k)`` mean pre-``tanh`` residual for conditioning ``cond`` ``(B, C)``."""
        return self.residual_head(cond.float()).reshape(-1, self.chunk_size, self.residual_dims)

    def sample(self, obs: Obs, generator: torch.Generator | None = None) -> PolicySample:
        """Draw ``w ~ N(mean(obs), std^2 I)`` and integrate the frozen flow from it (no grad)."""
        s = self._check_sampler()
        with torch.no_grad():
            obs.validate()
            cond = self.base.encode(obs.images, obs.proprio, obs.task)
            mean = self.mean_noise(cond)
            w = mean
            if s.stochastic:
                gdev = generator.device if generator is not None else mean.device
                eps = torch.randn(mean.shape, generator=generator, device=gdev).to(mean.device)
                w = mean + s.std * eps
            ode = EulerODESampler(s.num_steps, noise_scale=1.0)
            out = ode.sample(lambda x, t: self.base.velocity(x, t, cond), tuple(w.shape), noise=w)
            actions = self.base.normalizer.unnormalize("actions", out.x0)
            lp = gaussian_log_prob(w, mean, s.std).float() if s.stochastic else torch.zeros(w.shape[0])
            b = obs.batch_size
            extras = {"latent_noise": w, "cond": cond, "latent_std": torch.full((b,), s.std, device=w.device)}
            if self.residual_head is not None:
                um = self.residual_mean(cond)
                u = um
                if s.stochastic and s.residual_std > 0:
                    gdev = generator.device if generator is not None else um.device
                    u = um + s.residual_std * torch.randn(um.shape, generator=generator, device=gdev).to(um.device)
                    lp = lp + gaussian_log_prob(u, um, s.residual_std).float()
                k = self.residual_dims
                actions = torch.cat([actions[..., :k] + self.residual_bound * torch.tanh(u), actions[..., k:]], -1)
                extras["residual_u"] = u
            actions = clip_to_space(actions, self.action_space).float()
        return PolicySample(actions=actions, log_prob=lp.to(actions.device), extras=extras)

    def log_prob(self, obs: Obs, sample: PolicySample, per_step: bool = False) -> torch.Tensor:
        """Differentiable ``float32 (B,)`` log-density ``log N(w; mean(obs), std^2 I)`` of the recorded
        latent noise under the current noise head (``per_step=True``: ``(B, 1)``, one "step").

        Raises ``ValueError`` when the sampler is deterministic, the sample was not drawn by a
        ``LatentNoisePolicy`` or with another ``std``."""
        s = self._check_sampler()
        if not s.stochastic:
            raise ValueError("log_prob needs a stochastic LatentNoiseSampler (std > 0); the deterministic one "
                             "(std=0) has no density")
        w = sample.extras.get("latent_noise")
        if w is None:
            raise ValueError("sample has no extras['latent_noise']; it was not drawn by a LatentNoisePolicy")
        std = sample.extras.get("latent_std")
        if std is not None and not torch.allclose(std.float().cpu(), torch.tensor(s.std)):
            raise ValueError(f"sample drawn with latent std {float(std.flatten()[0])}, the policy's sampler has {s.std}")
        cond = sample.extras.get("cond")
        if cond is None:
            with torch.no_grad():
                cond = self.base.encode(obs.images, obs.proprio, obs.task)
        lp = gaussian_log_prob(w.to(self.device), self.mean_noise(cond.to(self.device)), s.std).float()
        if self.residual_head is not None and s.residual_std > 0:
            u = sample.extras.get("residual_u")
            if u is None:
                raise ValueError("sample has no extras['residual_u']; it was drawn without this policy's residual")
            # the density of u (tanh's Jacobian does not depend on the parameters, so ratios need none)
            lp = lp + gaussian_log_prob(u.to(self.device), self.residual_mean(cond.to(self.device)),
                                        s.residual_std).float()
        return lp[:, None] if per_step else lp
