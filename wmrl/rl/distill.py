"""Distillation of verified successes into the flow policy: filtered BC between GRPO iterations.

A latent-noise steering head (:class:`policies.steering.LatentNoisePolicy`) can only pick among the
chunks the frozen BC flow already makes; a bounded residual moves them a little. Periodic
distillation lifts that ceiling: the executed chunks of rollouts that succeeded, and that a gate
passes, become BC data for the flow itself (PA-RL, Mark et al. 2024, "Policy Agnostic RL":
optimised actions distilled into the base policy; RISE / RECAP train on the successes their value
filters). In the sim the successes are real; in imagination the gate should pass only those the
world model is sure of (its uncertainty gate), since an imagined success that does not replay
would teach the flow a failure.

:func:`gated_success_chunks` selects the data, :class:`Distiller` runs a few steps of the flow's own
BC loss (``policy.loss(batch, generator)``, e.g. ``FlowVLAPolicy.loss``) on it; the loop's
``DistillHook`` (:mod:`wmrl.rl.loop`) calls it every ``every`` iterations on that iteration's rollouts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from wmrl.kernel.types import Obs, Rollout

__all__ = ["Distiller", "gated_success_chunks"]


def gated_success_chunks(rollouts: Sequence[Rollout], gate: Callable[[Rollout], torch.Tensor] | None = None
                         ) -> tuple[Obs, torch.Tensor] | None:
    """The ``(observations, executed chunks float32 (M, H, D_a))`` of every alive chunk of every
    real slot that succeeded and that ``gate(rollout) -> bool (B,)`` passes (``None``: every
    success); ``None`` when there is none."""
    obs_parts, act_parts = [], []
    for ro in rollouts:
        keep = (ro.group_ids >= 0) & ro.success.bool()
        if gate is not None:
            g = torch.as_tensor(gate(ro), dtype=torch.bool).reshape(-1)
            if g.shape != keep.shape:
                raise ValueError(f"the gate gave {tuple(g.shape)} flags for {keep.shape[0]} slots")
            keep = keep & g
        for n, (o, s) in enumerate(zip(ro.obs, ro.samples)):
            sel = (ro.alive[:, n].bool() & keep).nonzero().flatten()
            if sel.numel():
                obs_parts.append(o.index(sel))
                act_parts.append(s.actions[sel].detach().float().cpu())
    if not obs_parts:
        return None
    return Obs.cat(obs_parts), torch.cat(act_parts)


class Distiller:
    """Filtered BC of gated successes into the flow (``policy.base`` of a steered policy, else the
    policy itself), with its own AdamW (fresh at every call, so nothing but the weights carries over).

    Args:
        steps: gradient steps per call; batch_size: chunks per step (drawn with replacement);
        lr: AdamW's learning rate; max_grad_norm: clipping;
        gate: ``rollout -> bool (B,)`` (see :func:`gated_success_chunks`).

    Calling it returns ``distill_chunks`` (how many chunks passed), ``distill_loss_first`` /
    ``distill_loss_last`` (``0`` chunks: only ``distill_chunks``).

    Raises:
        ValueError: the flow has no ``loss(batch, generator)``.
    """

    def __init__(self, steps: int = 50, batch_size: int = 64, lr: float = 1e-4, max_grad_norm: float = 1.0,
                 gate: Callable[[Rollout], torch.Tensor] | None = None):
        self.steps, self.batch_size, self.lr, self.max_grad_norm = int(steps), int(batch_size), float(lr), float(max_grad_norm)
        self.gate = gate

    def __call__(self, policy, rollouts: Sequence[Rollout], generator: torch.Generator | None = None) -> dict:
        data = gated_success_chunks(rollouts, self.gate)
        if data is None:
            return {"distill_chunks": 0.0}
        obs, actions = data
        flow = getattr(policy, "base", policy)
        if not callable(getattr(flow, "loss", None)):
            raise ValueError(f"distillation trains the flow with its BC loss, but {type(flow).__name__} has no "
                             "loss(batch, generator)")
        params = list(flow.parameters())
        was = [p.requires_grad for p in params]
        for p in params:
            p.requires_grad_(True)
        opt = torch.optim.AdamW(params, lr=self.lr)
        m = actions.shape[0]
        losses = []
        flow.train()
        try:
            for _ in range(self.steps):
                idx = torch.randint(m, (self.batch_size,), generator=generator)
                o = obs.index(idx)
                batch = {"images": o.images, "proprio": o.proprio, "actions": actions[idx], "instruction": list(o.task)}
                loss, _ = flow.loss(batch, generator=generator)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
                opt.step()
                losses.append(float(loss.detach()))
        finally:
            flow.eval()
            for p, w in zip(params, was):
                p.requires_grad_(w)
                p.grad = None
        return {"distill_chunks": float(m), "distill_loss_first": losses[0] if losses else 0.0,
                "distill_loss_last": losses[-1] if losses else 0.0}
