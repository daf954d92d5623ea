"""Samplers for flow-matching action heads, separate from the networks (diffusers' model/scheduler
split; LeRobot's ``euler_integrate`` takes a denoise function).

Flow convention (the one of openpi / LeRobot pi0, pi0.5, SmolVLA, so the lerobot adapters plug in
unchanged): ``x_t = (1 - t) * x_0 + t * eps`` with ``x_0`` the (normalised) action chunk and
``eps ~ N(0, I)``; the network predicts the velocity ``v(x_t, t) = eps - x_0``; sampling integrates
from ``t = 1`` (noise) to ``t = 0`` (actions) on the grid ``t_k = 1 - k / K``, ``k = 0..K``.

A *velocity function* is ``velocity_fn(x_t: float32 (B, H, D_a), t: float32 (B,)) -> (B, H, D_a)``;
it closes over an already-encoded observation, so the observation is encoded once per chunk.

Samplers
--------
:class:`EulerODESampler` (evaluation): ``x_{k+1} = x_k + (t_{k+1} - t_k) v(x_k, t_k)``; deterministic
given the initial noise, which is drawn from the ``generator`` (so a seeded generator reproduces the
chunk exactly). ``log_prob`` is not defined (returned as ``0``).

:class:`SDESampler` (RL): the Euler-Maruyama discretisation of the reverse-time SDE that has the same
marginals as the flow ODE, as in Flow-GRPO (Liu et al. 2025, "Flow-GRPO: Training Flow Matching
Models via Online RL", arXiv 2505.05470, eq. 9-10; reference implementation
``flow_grpo/diffusers_patch/sd3_sde_with_logprob.py``) and FA-GRPO / pi_RL for action chunks. With the
score of the linear path ``grad log p_t(x) = -(x + (1 - t) v) / t`` and step ``h = t_k - t_{k+1} > 0``::

    sigma_k = a * sqrt(t_k / (1 - t_k))          (t_k = 1 in the denominator replaced by t_1)
    mean_k  = x_k - h * [ v + sigma_k^2 / (2 t_k) * (x_k + (1 - t_k) v) ]
    x_{k+1} = mean_k + sigma_k * sqrt(h) * z,    z ~ N(0, I)

``a`` is the **noise level** (``noise_level``, Flow-GRPO's ``a``; default 0.5): ``a = 0`` gives back the
ODE sampler, larger ``a`` explores more.

With ``noise_steps = m < K`` only the first ``m`` transitions are stochastic and the rest are plain
Euler ODE steps (the stochastic window of MixGRPO, Li et al. 2025, arXiv 2507.21802, and
Flow-GRPO-Fast): the policy explores in the high-noise part of the chain, where a transition's std is
about ``a`` per dimension, and the chain's log-prob (and GRPO's ratios) covers only those ``m``
transitions; the late, low-noise transitions (std ``~ a * sqrt(t h)``) make per-step ratios jump with
tiny parameter changes, and without them ``log_prob`` also costs ``m`` instead of ``K`` network calls.
The deterministic tail's own dependence on the parameters is left out of the log-prob (as in
MixGRPO): the ratios are those of the stochastic window.

Every stochastic transition is an isotropic Gaussian, so the chain ``x_0 .. x_K`` (here indexed by
sampler step, ``chain[:, 0]`` is the initial noise, ``chain[:, K]`` the normalised action chunk) has
the exact log-density::

    log p(chain) = log N(chain[:, 0]; 0, I) + sum_k log N(chain[:, k+1]; mean_k(chain[:, k]), sigma_k^2 h I)

summed over ``H x D_a`` and the ``K`` (or ``m``) stochastic transitions. The prior term does not
depend on the network, so probability ratios (GRPO) are those of the transitions. ``log_prob``
recomputes the means from the recorded chain with the current network (teacher forcing), so it is
differentiable in the network's parameters; it follows exactly the computation done while sampling (same batch, same order of
operations), so at unchanged parameters the recomputed log-prob is bit-identical and the ratio is 1.
The log-prob is of the **pre-clip, normalised** chain; the policy unnormalises and clips the final
actions afterwards (a deterministic map that does not change the ratio).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

VelocityFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

_LOG_2PI = math.log(2.0 * math.pi)


@dataclass
class SamplerOutput:
    """Result of a sampler.

    Attributes:
        x0: ``float32 (B, H, D_a)`` the final (normalised, unclipped) action chunk.
        log_prob: ``float32 (B,)`` log-density of the chain (zeros for deterministic samplers).
        chain: ``float32 (B, K+1, H, D_a)`` the denoising chain, initial noise first (``None`` when
            not recorded).
    """

    x0: torch.Tensor
    log_prob: torch.Tensor
    chain: torch.Tensor | None = None


def sample_extras(sampler, out: SamplerOutput, batch_size: int, device) -> dict[str, torch.Tensor]:
    """``PolicySample.extras`` of one sampler call: ``chain`` ``(B, K+1, H, D_a)`` when recorded and,
    for a stochastic sampler, ``noise_level`` ``float32 (B,)`` and ``noise_steps`` ``int64 (B,)``
    (checked again by :func:`check_sample_extras` before ``log_prob``)."""
    extras: dict[str, torch.Tensor] = {}
    if out.chain is not None:
        extras["chain"] = out.chain
    if sampler.stochastic:
        extras["noise_level"] = torch.full((batch_size,), sampler.noise_level, device=device)
        extras["noise_steps"] = torch.full((batch_size,), sampler.stochastic_steps, device=device, dtype=torch.long)
    return extras


def check_sample_extras(sampler, extras: dict[str, torch.Tensor]) -> None:
    """Raise ``ValueError`` when a recorded chain was drawn with another ``noise_level`` or number of
    stochastic steps than ``sampler`` has (its log-prob would be of a different chain distribution)."""
    nl = extras.get("noise_level")
    if nl is not None and not torch.allclose(nl.float().cpu(), torch.tensor(float(sampler.noise_level))):
        raise ValueError(f"sample drawn with noise_level {float(nl.flatten()[0])}, the policy's sampler "
                         f"has {sampler.noise_level}")
    ns = extras.get("noise_steps")
    if ns is not None and bool((ns.cpu() != sampler.stochastic_steps).any()):
        raise ValueError(f"sample drawn with {int(ns.flatten()[0])} stochastic steps, the policy's sampler "
                         f"has {sampler.stochastic_steps} (noise_steps={sampler.noise_steps})")


def time_grid(num_steps: int, device=None) -> torch.Tensor:
    """``float32 (K+1,)`` grid ``t_k = 1 - k/K`` from 1 (noise) to 0 (actions)."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    return torch.linspace(1.0, 0.0, num_steps + 1, device=device, dtype=torch.float32)


def draw_noise(shape, generator: torch.Generator | None, device, dtype) -> torch.Tensor:
    """``N(0, I)`` of ``shape`` drawn on the generator's device (so a seeded CPU generator gives the
    same noise whatever ``device``), then moved to ``device``."""
    if generator is not None:
        return torch.randn(shape, generator=generator, device=generator.device, dtype=dtype).to(device)
    return torch.randn(shape, device=device, dtype=dtype)


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: float | torch.Tensor) -> torch.Tensor:
    """``log N(x; mean, std^2 I)`` summed over all but the first dim: ``(B, ...) -> float64 (B,)``.

    ``std`` is a positive scalar (or ``(B,)`` tensor). Computed in float64.
    """
    x64, m64 = x.double(), mean.double()
    std64 = torch.as_tensor(std, dtype=torch.float64, device=x.device)
    d = x64[0].numel()
    if std64.ndim:
        std64 = std64.reshape(-1, *([1] * (x.ndim - 1)))
    z = (x64 - m64) / std64
    log_std = torch.log(std64).reshape(-1) if std64.ndim else torch.log(std64)
    lp = -0.5 * z.pow(2).flatten(1).sum(1) - d * log_std - 0.5 * d * _LOG_2PI
    return lp


class EulerODESampler:
    """Deterministic Euler integration of the flow ODE (evaluation sampler).

    Args:
        num_steps: ``K`` Euler steps (>= 1).
        record_chain: also return the chain ``(B, K+1, H, D_a)`` (off by default: costs memory).
        noise_scale: the initial noise is ``noise_scale * N(0, I)`` (sampling temperature; ``1`` samples
            the learned distribution, ``0`` integrates from the mean of the prior, a deterministic
            "mode-seeking" chunk that ignores the generator).
    """

    stochastic = False

    def __init__(self, num_steps: int = 10, record_chain: bool = False, noise_scale: float = 1.0):
        if int(num_steps) < 1:
            raise ValueError(f"EulerODESampler.num_steps must be >= 1, got {num_steps}")
        if float(noise_scale) < 0:
            raise ValueError(f"EulerODESampler.noise_scale must be >= 0, got {noise_scale}")
        self.num_steps = int(num_steps)
        self.record_chain = bool(record_chain)
        self.noise_scale = float(noise_scale)

    def sample(self, velocity_fn: VelocityFn, shape: tuple[int, ...], generator: torch.Generator | None = None,
               device=None, noise: torch.Tensor | None = None) -> SamplerOutput:
        """Integrate from ``noise`` (drawn from ``generator`` if not given) of ``shape = (B, H, D_a)``."""
        x = draw_noise(shape, generator, device, torch.float32) if noise is None else noise
        if self.noise_scale != 1.0:
            x = x * self.noise_scale
        ts = time_grid(self.num_steps, device=x.device)
        chain = [x] if self.record_chain else None
        for k in range(self.num_steps):
            t = ts[k].expand(x.shape[0])
            v = velocity_fn(x, t)
            x = x + (ts[k + 1] - ts[k]) * v
            if chain is not None:
                chain.append(x)
        return SamplerOutput(x0=x, log_prob=torch.zeros(x.shape[0], device=x.device),
                             chain=torch.stack(chain, 1) if chain is not None else None)

    def log_prob(self, velocity_fn: VelocityFn, chain: torch.Tensor) -> torch.Tensor:
        raise ValueError("the deterministic Euler ODE sampler has no log-probability; "
                         "sample with policies.samplers.SDESampler for RL")

    def __repr__(self) -> str:
        return f"EulerODESampler(num_steps={self.num_steps}, noise_scale={self.noise_scale})"


class SDESampler:
    """Stochastic sampler with Gaussian transitions and exact chain log-probabilities (Flow-GRPO).

    Args:
        num_steps: ``K`` transitions (>= 1).
        noise_level: ``a >= 0`` in ``sigma_t = a * sqrt(t / (1 - t))`` (see the module docstring).
            Typical values 0.3-0.8 (Flow-GRPO uses 0.7 for images); ``0`` makes it deterministic,
            which has no density, so ``noise_level`` must be ``> 0``.
        include_prior: add ``log N(chain[:, 0]; 0, init_scale^2 I)`` (parameter-free) to the log-prob
            (left out when ``init_scale = 0``: a point mass).
        init_scale: the chain starts from ``init_scale * N(0, I)`` (default 1: the flow's prior, the
            SDE then has the flow's marginals). ``0`` starts from the prior mean, like the evaluation
            sampler ``EulerODESampler(noise_scale=0)``, so the exploration comes from the transitions
            only and the RL policy explores around the behaviour that is evaluated.
        noise_steps: ``m`` in ``1..K``: only the first ``m`` transitions are stochastic, the others
            deterministic Euler steps (``None``: all ``K``). ``log_prob`` then covers the ``m``
            stochastic transitions (``per_step=True``: ``(B, m)``).

    Raises ``ValueError`` for ``num_steps < 1``, ``noise_level <= 0``, ``init_scale < 0`` or
    ``noise_steps`` outside ``1..num_steps``.

    ``sample`` returns the chain ``(B, K+1, H, D_a)`` and its log-prob; ``log_prob(velocity_fn, chain)``
    recomputes the log-prob of a recorded chain, differentiably in the velocity network.
    """

    stochastic = True

    def __init__(self, num_steps: int = 10, noise_level: float = 0.5, include_prior: bool = True,
                 init_scale: float = 1.0, noise_steps: int | None = None):
        if float(init_scale) < 0:
            raise ValueError(f"SDESampler.init_scale must be >= 0, got {init_scale}")
        if int(num_steps) < 1:
            raise ValueError(f"SDESampler.num_steps must be >= 1, got {num_steps}")
        if not float(noise_level) > 0:
            raise ValueError(f"SDESampler.noise_level must be > 0 (got {noise_level}); "
                             "use EulerODESampler for deterministic sampling")
        if noise_steps is not None and not 1 <= int(noise_steps) <= int(num_steps):
            raise ValueError(f"SDESampler.noise_steps must be in 1..num_steps={num_steps} (or null for all), "
                             f"got {noise_steps}")
        self.num_steps = int(num_steps)
        self.noise_level = float(noise_level)
        self.include_prior = bool(include_prior)
        self.init_scale = float(init_scale)
        self.noise_steps = int(noise_steps) if noise_steps is not None else None

    @property
    def stochastic_steps(self) -> int:
        """``m``: the number of leading stochastic transitions (``K`` unless ``noise_steps`` is set)."""
        return self.num_steps if self.noise_steps is None else self.noise_steps

    # ------------------------------------------------------------------ the transition kernel
    def _sigmas(self, ts: torch.Tensor) -> list[float]:
        """``sigma_k`` for ``k = 0..K-1`` (python floats, identical in sample and log_prob)."""
        t1 = float(ts[1]) if self.num_steps > 1 else 0.5
        out = []
        for k in range(self.num_steps):
            t = float(ts[k])
            denom = 1.0 - (t1 if t >= 1.0 else t)
            out.append(self.noise_level * math.sqrt(t / denom))
        return out

    def transition(self, x: torch.Tensor, v: torch.Tensor, k: int, ts: torch.Tensor, sigmas: list[float]):
        """Mean ``(B, H, D_a)`` and std (float) of ``p(x_{k+1} | x_k)``."""
        t = float(ts[k])
        h = float(ts[k] - ts[k + 1])
        sig = sigmas[k]
        mean = x - h * (v + (sig * sig / (2.0 * t)) * (x + (1.0 - t) * v))
        return mean, sig * math.sqrt(h)

    # ------------------------------------------------------------------ API
    def sample(self, velocity_fn: VelocityFn, shape: tuple[int, ...], generator: torch.Generator | None = None,
               device=None, noise: torch.Tensor | None = None) -> SamplerOutput:
        """Sample a chain from ``noise`` (or fresh noise of ``shape``), all noise from ``generator``."""
        if noise is None:
            x = draw_noise(shape, generator, device, torch.float32)
            if self.init_scale != 1.0:
                x = x * self.init_scale
        else:
            x = noise
        ts = time_grid(self.num_steps, device=x.device)
        sigmas = self._sigmas(ts)
        chain = [x]
        m = self.stochastic_steps
        with torch.no_grad():
            for k in range(self.num_steps):
                v = velocity_fn(x, ts[k].expand(x.shape[0]))
                if k < m:
                    mean, std = self.transition(x, v, k, ts, sigmas)
                    x = mean + std * draw_noise(x.shape, generator, x.device, x.dtype)
                else:
                    x = x + (ts[k + 1] - ts[k]) * v
                chain.append(x)
            chain_t = torch.stack(chain, 1)
            lp = self.log_prob(velocity_fn, chain_t)
        return SamplerOutput(x0=chain_t[:, -1], log_prob=lp, chain=chain_t)

    def log_prob(self, velocity_fn: VelocityFn, chain: torch.Tensor, per_step: bool = False) -> torch.Tensor:
        """Exact log-density ``float32 (B,)`` of ``chain`` ``(B, K+1, H, D_a)`` under ``velocity_fn``.

        With ``per_step=True`` it returns the log-densities of the stochastic transitions
        ``float32 (B, m)`` (``m = K`` unless ``noise_steps`` is set; without the parameter-free
        prior): Flow-GRPO's per-denoising-step ratios (Liu et al. 2025, "Flow-GRPO", Eq. 8 sums the
        clipped surrogate over the steps of the chain).

        Raises ``ValueError`` if the chain has not ``K+1`` steps.
        """
        if chain.ndim < 3 or chain.shape[1] != self.num_steps + 1:
            raise ValueError(f"chain must be (B, K+1={self.num_steps + 1}, H, D_a), got {tuple(chain.shape)}; "
                             "was it sampled with a different num_steps?")
        ts = time_grid(self.num_steps, device=chain.device)
        sigmas = self._sigmas(ts)
        steps = []
        for k in range(self.stochastic_steps):
            x = chain[:, k]
            v = velocity_fn(x, ts[k].expand(x.shape[0]))
            mean, std = self.transition(x, v, k, ts, sigmas)
            steps.append(gaussian_log_prob(chain[:, k + 1], mean, std))
        if per_step:
            return torch.stack(steps, 1).float()
        lp = gaussian_log_prob(chain[:, 0], torch.zeros_like(chain[:, 0]), self.init_scale) \
            if self.include_prior and self.init_scale > 0 \
            else torch.zeros(chain.shape[0], device=chain.device, dtype=torch.float64)
        for step_lp in steps:
            lp = lp + step_lp
        return lp.float()

    def __repr__(self) -> str:
        extra = f", noise_steps={self.noise_steps}" if self.noise_steps is not None else ""
        return (f"SDESampler(num_steps={self.num_steps}, noise_level={self.noise_level}, "
                f"init_scale={self.init_scale}{extra})")
