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
        gripper_command: ``float32 (B,)`` in [-1, 1], the gripper's integrated command after the last
            imagined chunk (``worldmodels.dynamics``, ``gripper_speed``); ``None``: not known (a
            dynamics model estimates it from the fingers).
        anchor: ``float32 (B, 3 * n_cam, Hi, Wi)`` in [-1, 1], the real frames the rollout started
            from (``init``'s context; WoVR's first-frame conditioning); ``None``: ``frames``.
        anchor_proprio: ``float32 (B, D_s)``, the proprio of the anchor frames (the pose a hand camera
            saw them from, ``worldmodels.reproject``); ``None``: ``proprio``.
    """

    frames: torch.Tensor
    proprio: torch.Tensor
    task: list[str]
    prev_proprio: torch.Tensor | None = None
    uncertainty: torch.Tensor | None = None
    gripper_command: torch.Tensor | None = None
    anchor: torch.Tensor | None = None
    anchor_proprio: torch.Tensor | None = None

    def index(self, idx: torch.Tensor) -> "WMState":
        il = idx.nonzero().flatten() if idx.dtype == torch.bool else idx
        return WMState(self.frames[il], self.proprio[il], [self.task[i] for i in il.tolist()],
                       None if self.prev_proprio is None else self.prev_proprio[il],
                       None if self.uncertainty is None else self.uncertainty[il],
                       None if self.gripper_command is None else self.gripper_command[il],
                       None if self.anchor is None else self.anchor[il],
                       None if self.anchor_proprio is None else self.anchor_proprio[il])

    def merge(self, slots: torch.Tensor, other: "WMState") -> "WMState":
        """A new state: this one, with the slots ``slots`` (``bool (B,)``) taken from ``other`` (same
        ``B``). A missing ``prev_proprio`` counts as at rest (``proprio``), a missing ``uncertainty``
        as 0; the result has both when either input has them. ``gripper_command`` is kept only when
        both have it (an unknown command is estimated again from the fingers)."""
        m = slots.to(self.frames.device)
        pick = lambda a, b: torch.where(m.view(-1, *([1] * (a.dim() - 1))), b, a)   # noqa: E731
        prev = None
        if self.prev_proprio is not None or other.prev_proprio is not None:
            prev = pick(self.proprio if self.prev_proprio is None else self.prev_proprio,
                        other.proprio if other.prev_proprio is None else other.prev_proprio)
        unc = None
        if self.uncertainty is not None or other.uncertainty is not None:
            zero = self.proprio.new_zeros(self.proprio.shape[0])
            unc = pick(zero if self.uncertainty is None else self.uncertainty,
                       zero if other.uncertainty is None else other.uncertainty)
        cmd = None
        if self.gripper_command is not None and other.gripper_command is not None:
            cmd = pick(self.gripper_command, other.gripper_command)
        task = [o if bool(f) else t for t, o, f in zip(self.task, other.task, m.tolist())]
        anchor = None
        if self.anchor is not None or other.anchor is not None:
            anchor = pick(self.frames if self.anchor is None else self.anchor,
                          other.frames if other.anchor is None else other.anchor)
        anchor_p = None
        if self.anchor_proprio is not None or other.anchor_proprio is not None:
            anchor_p = pick(self.proprio if self.anchor_proprio is None else self.anchor_proprio,
                            other.proprio if other.anchor_proprio is None else other.anchor_proprio)
        return WMState(pick(self.frames, other.frames), pick(self.proprio, other.proprio), task, prev, unc, cmd, anchor,
                       anchor_p)

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
        if sub.anchor is not None or self.anchor is not None:
            if self.anchor is None:
                self.anchor = self.frames.clone()
            self.anchor[idx] = sub.frames if sub.anchor is None else sub.anchor
        if sub.anchor_proprio is not None or self.anchor_proprio is not None:
            if self.anchor_proprio is None:
                self.anchor_proprio = self.proprio.clone()
            self.anchor_proprio[idx] = sub.proprio if sub.anchor_proprio is None else sub.anchor_proprio
        if self.gripper_command is not None:
            if sub.gripper_command is None:
                self.gripper_command = None     # unknown for some slots: estimated again from the fingers
            else:
                self.gripper_command[idx] = sub.gripper_command


def to_unit(x: torch.Tensor) -> torch.Tensor:
    """``uint8`` [0, 255] -> ``float32`` [-1, 1]."""
    return x.float().div(127.5).sub(1.0)


def to_uint8(x: torch.Tensor) -> torch.Tensor:
    """``float`` [-1, 1] -> ``uint8`` [0, 255] (clamped, rounded)."""
    return ((x.float().clamp(-1, 1) + 1.0) * 127.5).round().to(torch.uint8)
