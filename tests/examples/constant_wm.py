"""The smallest ``wmrl.kernel.interfaces.WorldModel``: it predicts that nothing changes.

Only the contract tests use it (``configs/worldmodel/constant.yaml``); it shows what a new world
model must declare: ``action_dim``, ``chunk_size``, ``context_frames``, ``init`` and ``imagine``.
"""

from __future__ import annotations

import torch

from wmrl.kernel.types import Obs


class ConstantWorldModel:
    """The state is the last context frame; ``imagine`` returns it unchanged (the "copy last frame"
    baseline of video prediction).

    Args:
        action_dim: ``D_a`` of the actions ``imagine`` accepts.
        chunk_size: ``H`` of the action chunks ``imagine`` accepts.

    Raises:
        ValueError: ``imagine`` with actions that are not ``(B, H, D_a)`` for the state's ``B``.
    """

    context_frames = 1

    def __init__(self, action_dim: int = 7, chunk_size: int = 4):
        self.action_dim, self.chunk_size = int(action_dim), int(chunk_size)

    def init(self, context: Obs) -> Obs:
        """State: a copy of ``context`` (``uint8`` images, ``float32`` proprio, batch ``B``)."""
        context.validate()
        return Obs({k: v.clone() for k, v in context.images.items()}, context.proprio.float().clone(), list(context.task))

    def imagine(self, state: Obs, actions: torch.Tensor, generator: torch.Generator | None = None) -> tuple[Obs, Obs]:
        """``(state, state)``: the predicted observation after ``actions`` is the current one."""
        a = torch.as_tensor(actions)
        if tuple(a.shape) != (state.batch_size, self.chunk_size, self.action_dim):
            raise ValueError(f"actions must be (B={state.batch_size}, H={self.chunk_size}, D_a={self.action_dim}), "
                             f"got {tuple(a.shape)}")
        return state, state
