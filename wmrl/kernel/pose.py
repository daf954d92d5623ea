"""End-effector pose helpers on the proprio layout of ``wmrl.kernel.types`` (``quat_wxyz`` at
``[3:7]``), shared by the components that read a gripper's yaw (``worldmodels.dynamics``,
``policies.action_frames``, the hold target of ``robot_bridge.arm``). The numpy twins on rotation
matrices for the simulator are ``sim.control.yaw_of_down_mat`` / ``wrap_angle``."""

from __future__ import annotations

import math

import torch


def yaw_of_down_quat(q: torch.Tensor) -> torch.Tensor:
    """Yaw (rad, in (-pi, pi]) of a gripper pointing down, from ``quat_wxyz`` ``(..., 4)``:
    ``atan2(R10, R00)`` of its rotation, the same for ``q`` and ``-q``."""
    w, x, y, z = q.unbind(-1)
    return torch.atan2(2 * (x * y + w * z), 1 - 2 * (y * y + z * z))


def wrap_angle(a: torch.Tensor) -> torch.Tensor:
    """Angles (rad) wrapped to [-pi, pi)."""
    return torch.remainder(a + math.pi, 2 * math.pi) - math.pi


__all__ = ["yaw_of_down_quat", "wrap_angle"]
