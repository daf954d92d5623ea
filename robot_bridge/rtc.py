"""Real-time chunking (RTC) for flow-matching policies: sample a new action chunk that continues
the committed prefix.

Reference: Black, Galliker, Levine 2025, "Real-Time Execution of Action Chunking Flow Policies"
(arXiv:2506.07339), Algorithm 1: inpainting by Pi-GDM guidance with a soft mask.

Convention (as in ``wmrl.kernel.types`` / the policies package): ``x_0`` is Gaussian noise, ``x_1`` the
action chunk, ``x_t = t x_1 + (1 - t) x_0``, the policy's velocity field ``v(x_t, t)`` points to
``x_1 - x_0``; Euler integration from ``t = 0`` to ``1`` in ``K`` steps.

With the prefix ``Y`` (``P`` actions already queued for execution), ``d`` of which will have run
before the new chunk arrives, each step uses

    x1_hat = x_t + (1 - t) v(x_t, t)
    g      = J^T [W * (Y - x1_hat)],  J = d x1_hat / d x_t  (one vector-Jacobian product)
    v'     = v + min(beta, (1 - t) / (t * r_t^2)) g,   r_t^2 = (1 - t)^2 / (t^2 + (1 - t)^2)

where the soft mask ``W`` is 1 on the ``d`` frozen actions, decays exponentially over the rest of
the prefix, and is 0 after it. The frozen actions are finally copied from the prefix (they are
skipped by the latency-aware queue anyway).
"""

from __future__ import annotations

import math
from typing import Callable, Protocol, runtime_checkable

import torch

VelocityFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@runtime_checkable
class RTCFlowPolicy(Protocol):
    """What the policy server needs for real-time chunking (besides ``wmrl.kernel.interfaces.Policy``).

    ``rtc_velocity_fn(obs)`` returns ``v(x (B, H, D_a), t (B,))`` in this module's convention
    (``t = 0`` noise, ``t = 1`` actions) over the policy's own action coordinates (e.g.
    normalised); ``to_flow_space`` maps actions ``(P, D_a)`` there, ``from_flow_space`` maps a
    sampled ``(B, H, D_a)`` back to controller units (unnormalise, clip). ``num_steps``: ``K``.
    """

    num_steps: int

    def rtc_velocity_fn(self, obs) -> VelocityFn: ...

    def to_flow_space(self, actions: torch.Tensor) -> torch.Tensor: ...

    def from_flow_space(self, x: torch.Tensor) -> torch.Tensor: ...


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


def rtc_sample(velocity: VelocityFn, noise: torch.Tensor, prefix: torch.Tensor | None, delay: int,
               num_steps: int = 10, beta: float = 5.0) -> torch.Tensor:
    """Euler-integrate the flow from ``noise`` ``(B, H, D_a)`` with RTC prefix guidance.

    Args:
        velocity: ``v(x (B, H, D_a), t (B,)) -> (B, H, D_a)``, differentiable in ``x``.
        noise: ``x_0``.
        prefix: ``(P, D_a)`` or ``(B, P, D_a)`` committed actions (same units as the velocity
            field's ``x``), or ``None`` / ``P = 0``: plain sampling.
        delay: ``d``, prefix actions frozen (executed before the chunk arrives).
        num_steps: ``K`` Euler steps.
        beta: guidance-weight cap (RTC uses 5).

    Returns:
        ``(B, H, D_a)`` chunk; its first ``min(d, P)`` actions equal the prefix.
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
        t = k * dt
        tt = torch.full((b,), t, dtype=x.dtype)
        if p == 0:
            with torch.no_grad():
                x = x + dt * velocity(x, tt)
            continue
        with torch.enable_grad():
            xg = x.detach().requires_grad_(True)
            v = velocity(xg, tt)
            x1_hat = xg + (1.0 - t) * v
            err = (y - x1_hat) * w
            (g,) = torch.autograd.grad(x1_hat, xg, grad_outputs=err)
        if t <= 0.0:
            gw = beta
        else:
            r2 = (1 - t) ** 2 / (t ** 2 + (1 - t) ** 2)
            gw = min(beta, (1 - t) / (t * r2))
        x = x.detach() + dt * (v.detach() + gw * g)
    if p:
        d = min(delay, p)
        x[:, :d] = prefix[:, :d].to(x)
    return x.detach()
