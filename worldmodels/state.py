"""The explicit state of ``worldmodels.video_wm.ChunkFlowWorldModel`` (DreamerV3's vocabulary) and
the pixel conversions it uses."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class WMState:
    """Explicit world-model state for a batch ``B`` of imagined branches.

    Attributes:
        frames: ``float32 (B, 3 * n_cam, Hi, Wi)`` in [-1, 1], cameras stacked in model order.
        proprio: ``float32 (B, D_s)`` (unnormalised).
        task: ``B`` instruction strings (carried through to the predicted ``Obs``).
        prev_proprio: ``float32 (B, D_s)``, the proprio one control step before ``proprio`` (its
            velocity, for a model with ``dynamics``); ``None``: at rest (equal to ``proprio``).
        uncertainty: ``float32 (B,)``, the dynamics ensemble's disagreement (std of the predicted
            end-effector position over members, m) at the end of the last imagined chunk; ``None``
            for a state not imagined by a model with ``dynamics``.
    """

    frames: torch.Tensor
    proprio: torch.Tensor
    task: list[str]
    prev_proprio: torch.Tensor | None = None
    uncertainty: torch.Tensor | None = None

    def index(self, idx: torch.Tensor) -> "WMState":
        il = idx.nonzero().flatten() if idx.dtype == torch.bool else idx
        return WMState(self.frames[il], self.proprio[il], [self.task[i] for i in il.tolist()],
                       None if self.prev_proprio is None else self.prev_proprio[il],
                       None if self.uncertainty is None else self.uncertainty[il])

    def assign(self, idx: torch.Tensor, sub: "WMState") -> None:
        """Write ``sub`` (the state of the slots ``idx``, a bool mask or indices) into these slots."""
        self.frames[idx], self.proprio[idx] = sub.frames, sub.proprio
        if sub.prev_proprio is not None:
            if self.prev_proprio is None:
                self.prev_proprio = self.proprio.clone()
            self.prev_proprio[idx] = sub.prev_proprio
        if sub.uncertainty is not None:
            if self.uncertainty is None:
                self.uncertainty = self.proprio.new_zeros(self.proprio.shape[0])
            self.uncertainty[idx] = sub.uncertainty


def to_unit(x: torch.Tensor) -> torch.Tensor:
    """``uint8`` [0, 255] -> ``float32`` [-1, 1]."""
    return x.float().div(127.5).sub(1.0)


def to_uint8(x: torch.Tensor) -> torch.Tensor:
    """``float`` [-1, 1] -> ``uint8`` [0, 255] (clamped, rounded)."""
    return ((x.float().clamp(-1, 1) + 1.0) * 127.5).round().to(torch.uint8)
