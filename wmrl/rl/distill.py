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
``DistillHook`` (:mod:`wmrl.rl.loop`) calls it every ``every`` iterations on that iteration's rollouts,
or, with a :class:`SuccessBuffer`, on the gated successes of every iteration so far (the newest
``capacity`` chunks): iterated filtered BC on everything verified, as in expert iteration / RFT
(Anthony et al. 2017; Zelikman et al. 2022, STaR) rather than on one iteration's few successes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import torch

from wmrl.kernel.types import Obs, Rollout

__all__ = ["Distiller", "SuccessBuffer", "gated_success_chunks"]


def gated_success_chunks(rollouts: Sequence[Rollout], gate: Callable[[Rollout], torch.Tensor] | None = None,
                         first_chunks: int | None = None) -> tuple[Obs, torch.Tensor] | None:
    """The ``(observations, executed chunks float32 (M, H, D_a))`` of every alive chunk of every
    real slot that succeeded and that ``gate(rollout) -> bool (B,)`` passes (``None``: every
    success); ``None`` when there is none. ``first_chunks = m``: only each rollout's first ``m``
    chunks (in imagination the first is the one taken on the start's real frame; later ones see
    world-model frames).

    Raises:
        ValueError: a gate with the wrong number of flags; ``first_chunks < 1``.
    """
    if first_chunks is not None and int(first_chunks) < 1:
        raise ValueError(f"first_chunks must be >= 1 (or None: every chunk), got {first_chunks}")
    obs_parts, act_parts = [], []
    for ro in rollouts:
        keep = (ro.group_ids >= 0) & ro.success.bool()
        if gate is not None:
            g = torch.as_tensor(gate(ro), dtype=torch.bool).reshape(-1)
            if g.shape != keep.shape:
                raise ValueError(f"the gate gave {tuple(g.shape)} flags for {keep.shape[0]} slots")
            keep = keep & g
        for n, (o, s) in enumerate(zip(ro.obs, ro.samples)):
            if first_chunks is not None and n >= int(first_chunks):
                break
            sel = (ro.alive[:, n].bool() & keep).nonzero().flatten()
            if sel.numel():
                obs_parts.append(o.index(sel))
                act_parts.append(s.actions[sel].detach().float().cpu())
    if not obs_parts:
        return None
    return Obs.cat(obs_parts), torch.cat(act_parts)


class SuccessBuffer:
    """The gated successes of every iteration so far, newest ``capacity`` chunks kept (FIFO).

    ``add(rollouts)`` appends :func:`gated_success_chunks` of them; ``data()`` is ``(Obs, float32
    (M, H, D_a))`` or ``None`` while empty. Saved and restored with the GRPO checkpoints
    (:meth:`state_tensors` / :meth:`load_state_tensors`), so a resumed run distils the same data.

    Args:
        capacity: chunks kept (>= 1); gate: ``rollout -> bool (B,)``, applied when adding;
        first_chunks: only each success's first ``m`` chunks (see :func:`gated_success_chunks`).

    Raises:
        ValueError: ``capacity < 1``; chunks whose cameras, proprio or action shape differ from those
            already held; a checkpoint whose buffer tensors disagree with its task list.
    """

    PREFIX = "distill_buffer/"

    def __init__(self, capacity: int = 5000, gate: Callable[[Rollout], torch.Tensor] | None = None,
                 first_chunks: int | None = None):
        if int(capacity) < 1:
            raise ValueError(f"SuccessBuffer capacity must be >= 1 chunk, got {capacity}")
        self.capacity, self.gate, self.first_chunks = int(capacity), gate, first_chunks
        self.obs: Obs | None = None
        self.actions: torch.Tensor | None = None
        self.added = 0

    def __len__(self) -> int:
        return 0 if self.actions is None else int(self.actions.shape[0])

    def add(self, rollouts: Sequence[Rollout]) -> int:
        """Append the gated successes of ``rollouts``; returns how many chunks were added."""
        data = gated_success_chunks(rollouts, self.gate, self.first_chunks)
        if data is None:
            return 0
        obs, actions = data
        if self.obs is not None and self.actions is not None:
            if set(obs.images) != set(self.obs.images) or obs.proprio.shape[1:] != self.obs.proprio.shape[1:] \
                    or actions.shape[1:] != self.actions.shape[1:] \
                    or any(obs.images[k].shape[1:] != self.obs.images[k].shape[1:] for k in obs.images):
                raise ValueError("SuccessBuffer: new chunks have cameras / proprio / actions shaped "
                                 f"{ {k: tuple(v.shape[1:]) for k, v in obs.images.items()} } / {tuple(obs.proprio.shape[1:])} / "
                                 f"{tuple(actions.shape[1:])}, the buffer holds "
                                 f"{ {k: tuple(v.shape[1:]) for k, v in self.obs.images.items()} } / "
                                 f"{tuple(self.obs.proprio.shape[1:])} / {tuple(self.actions.shape[1:])}")
            obs, actions = Obs.cat([self.obs, obs]), torch.cat([self.actions, actions])
        keep = slice(max(0, actions.shape[0] - self.capacity), None)
        self.obs, self.actions = obs.index(keep), actions[keep].contiguous()
        self.added += int(data[1].shape[0])
        return int(data[1].shape[0])

    def data(self) -> tuple[Obs, torch.Tensor] | None:
        return None if self.obs is None or self.actions is None else (self.obs, self.actions)

    def state_tensors(self) -> tuple[dict[str, torch.Tensor], dict]:
        """``(tensors, meta)``: ``distill_buffer/images/<camera>``, ``.../proprio``, ``.../actions``;
        meta has the task strings and the count of chunks ever added."""
        meta: dict = {"capacity": self.capacity, "added": self.added, "task": []}
        if self.obs is None or self.actions is None:
            return {}, meta
        t = {f"{self.PREFIX}images/{k}": v.contiguous() for k, v in self.obs.images.items()}
        t[f"{self.PREFIX}proprio"] = self.obs.proprio.contiguous()
        t[f"{self.PREFIX}actions"] = self.actions
        meta["task"] = list(self.obs.task)
        return t, meta

    def load_state_tensors(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """Inverse of :meth:`state_tensors`."""
        self.added = int(meta.get("added", 0))
        tasks = list(meta.get("task", []))
        if not tasks:
            self.obs = self.actions = None
            return
        p = self.PREFIX
        images = {k[len(p + "images/"):]: v for k, v in tensors.items() if k.startswith(p + "images/")}
        obs = Obs(images, tensors[p + "proprio"], tasks)
        actions = tensors[p + "actions"]
        if actions.shape[0] != len(tasks):
            raise ValueError(f"the checkpoint's distillation buffer has {actions.shape[0]} chunks but {len(tasks)} "
                             "task strings: it is damaged; start a new run directory")
        obs.validate()
        keep = slice(max(0, len(tasks) - self.capacity), None)
        self.obs, self.actions = obs.index(keep), actions[keep]


class Distiller:
    """Filtered BC of gated successes into the flow (``policy.base`` of a steered policy, else the
    policy itself), with its own AdamW (fresh at every call, so nothing but the weights carries over).

    Args:
        steps: gradient steps per call; batch_size: chunks per step (drawn with replacement);
        lr: AdamW's learning rate; max_grad_norm: clipping;
        gate: ``rollout -> bool (B,)`` (see :func:`gated_success_chunks`);
        buffer: a :class:`SuccessBuffer`: the flow is trained on its contents and ``rollouts`` is not
            read (the caller adds to it: the loop's ``DistillHook`` does, every iteration); ``None``:
            on the gated successes of ``rollouts`` alone.
        balance_tasks: draw every task present with equal probability (then a chunk uniformly within
            it) instead of every chunk alike, so a task whose successes are rare (stacking beside two
            lifts) is not forgotten; ``False``: uniform over chunks.
        first_chunks: without a buffer, only each success's first ``m`` chunks (see
            :func:`gated_success_chunks`; a buffer has its own).

    Calling it returns ``distill_chunks`` (how many chunks it trained on), ``distill_loss_first`` /
    ``distill_loss_last`` (``0`` chunks: only ``distill_chunks``).

    Raises:
        ValueError: the flow has no ``loss(batch, generator)``.
    """

    def __init__(self, steps: int = 50, batch_size: int = 64, lr: float = 1e-4, max_grad_norm: float = 1.0,
                 gate: Callable[[Rollout], torch.Tensor] | None = None, buffer: SuccessBuffer | None = None,
                 balance_tasks: bool = False, first_chunks: int | None = None):
        self.steps, self.batch_size, self.lr, self.max_grad_norm = int(steps), int(batch_size), float(lr), float(max_grad_norm)
        self.gate, self.buffer, self.balance_tasks, self.first_chunks = gate, buffer, bool(balance_tasks), first_chunks

    def task_weights(self, tasks: Sequence[str]) -> torch.Tensor | None:
        """``float64 (M,)`` draw weights of the ``M = len(tasks)`` chunks, ``1 / (chunks of its
        task)`` each, with ``balance_tasks``; ``None`` (uniform over chunks) without."""
        if not self.balance_tasks:
            return None
        count = Counter(tasks)
        return torch.tensor([1.0 / count[t] for t in tasks], dtype=torch.float64)

    def draw(self, m: int, weights: torch.Tensor | None, generator: torch.Generator | None = None) -> torch.Tensor:
        """``int64 (batch_size,)`` indices into ``m`` chunks, with replacement: uniform, or by
        ``weights`` (:meth:`task_weights`)."""
        if weights is None:
            return torch.randint(m, (self.batch_size,), generator=generator)
        return torch.multinomial(weights, self.batch_size, replacement=True, generator=generator)

    def __call__(self, policy, rollouts: Sequence[Rollout], generator: torch.Generator | None = None) -> dict:
        data = self.buffer.data() if self.buffer is not None else gated_success_chunks(rollouts, self.gate,
                                                                                         self.first_chunks)
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
        weights = self.task_weights(list(obs.task))
        losses = []
        flow.train()
        try:
            for _ in range(self.steps):
                idx = self.draw(m, weights, generator)
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
