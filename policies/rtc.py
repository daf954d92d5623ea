"""Real-time chunking (RTC): sample a new action chunk that continues the committed prefix.

Reference: Black, Galliker, Levine 2025, "Real-Time Execution of Action Chunking Flow Policies"
(arXiv:2506.07339), Algorithm 1: inpainting by Pi-GDM guidance with a soft mask.

Written in the flow convention of ``policies.samplers`` (openpi / LeRobot pi0): ``x_s = (1 - s) a
+ s eps`` with ``a`` the normalised action chunk and ``eps ~ N(0, I)``, the velocity field
``v(x_s, s)`` points to ``eps - a``, sampling goes from ``s = 1`` (noise) to ``s = 0`` (actions).
The paper's time is ``tau = 1 - s`` (``tau = 0`` noise, ``tau = 1`` actions); its guidance weight
is written with ``tau`` below, everything else with ``s``.

With the prefix ``Y`` (``P`` actions already queued for execution), ``d`` of which will have run
before the new chunk arrives, step ``k = 0 .. K-1`` (``tau = k / K``, ``s = 1 - tau``) uses

    a_hat = x_s - s v(x_s, s)                       (the chunk predicted from x_s)
    g     = J^T [W * (Y - a_hat)],  J = d a_hat / d x_s  (one vector-Jacobian product)
    v'    = v - min(beta, (1 - tau) / (tau * r^2)) g,   r^2 = (1 - tau)^2 / (tau^2 + (1 - tau)^2)
    x     <- x - (1 / K) v'                         (Euler step from s to s - 1/K)

(``beta`` at ``tau = 0``), where the soft mask ``W`` is 1 on the ``d`` frozen actions, decays
exponentially over the rest of the prefix, and is 0 after it. The frozen actions are finally
copied from the prefix (the latency-aware queue skips them anyway). Without a prefix
(``P = 0``) the same grid is integrated without guidance.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

VelocityFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def prefix_weights(horizon: int, prefix_len: int, delay: int) -> torch.Tensor:
    """Soft mask ``float32 (H,)``: 1 for ``i < d``, ``c_i (e^{c_i} - 1) / (e - 1)`` with
    ``c_i = (P - i) / (P - d + 1)`` for ``d <= i < P``, 0 for ``i >= P`` (RTC eq. 5, with the
    prefix length ``P = H - s``)."""
    p = min(prefix_len, horizon)
    d = min(delay, p)
    w = torch.zeros(horizon)
    w[:d] = 1.0
    for i in range(d, p):
        c = (p - i) / (p - d + 1)
        w[i] = c * (math.exp(c) - 1) / (math.e - 1)
    return w


def guidance_weight(tau: float, beta: float) -> float:
    """RTC's guidance weight ``min(beta, (1 - tau) / (tau r^2))`` at the paper's time ``tau = 1 - s``
    (``beta`` at ``tau = 0``)."""
    if tau <= 0.0:
        return beta
    r2 = (1 - tau) ** 2 / (tau ** 2 + (1 - tau) ** 2)
    return min(beta, (1 - tau) / (tau * r2))


def rtc_sample(velocity_fn: VelocityFn, noise: torch.Tensor, prefix: torch.Tensor | None, delay: int,
               num_steps: int = 10, beta: float = 5.0) -> torch.Tensor:
    """Euler-integrate the flow from ``noise`` (``s = 1``) to the chunk (``s = 0``) with RTC prefix guidance.

    Args:
        velocity_fn: ``v(x (B, H, D_a), s (B,)) -> (B, H, D_a)`` in the convention of
            ``policies.samplers``, differentiable in ``x``.
        noise: ``float32 (B, H, D_a)``, the chain's start ``x_{s=1}``.
        prefix: ``(P, D_a)`` or ``(B, P, D_a)`` committed actions in the coordinates of ``x``
            (e.g. normalised), or ``None`` / ``P = 0``: plain sampling on the same grid.
        delay: ``d``, prefix actions frozen (executed before the chunk arrives).
        num_steps: ``K`` Euler steps.
        beta: guidance-weight cap (RTC uses 5); ``0`` gives back plain sampling.

    Returns:
        ``(B, H, D_a)`` chunk (detached); its first ``min(d, P)`` actions equal the prefix.
    """
    x = noise.detach().clone()
    b, h, _ = x.shape
    if prefix is not None and prefix.shape[-2] > 0:
        if prefix.ndim == 2:
            prefix = prefix.unsqueeze(0).expand(b, -1, -1)
        p = min(prefix.shape[1], h)
        y = torch.zeros_like(x)
        y[:, :p] = prefix[:, :p].to(x)
        w = prefix_weights(h, p, delay).to(x).view(1, h, 1)
    else:
        p, y, w = 0, None, None
    dt = 1.0 / num_steps
    for k in range(num_steps):
        tau = k * dt
        s = 1.0 - torch.full((b,), tau, dtype=x.dtype)
        if p == 0:
            with torch.no_grad():
                x = x - dt * velocity_fn(x, s)
            continue
        with torch.enable_grad():
            xg = x.detach().requires_grad_(True)
            v = velocity_fn(xg, s)
            a_hat = xg - (1.0 - tau) * v
            err = (y - a_hat) * w
            (g,) = torch.autograd.grad(a_hat, xg, grad_outputs=err)
        x = x.detach() - dt * (v.detach() - guidance_weight(tau, beta) * g)
    if p:
        d = min(delay, p)
        x[:, :d] = prefix[:, :d].to(x)
    return x.detach()
