"""Chunk-relative action frames for absolute end-effector targets (openpi's "delta actions").

In an absolute target space (``ActionSpace.mode == "absolute"``, ``rotation == "yaw_down"``: actions
``(x, y, z, yaw, gripper)`` in the robot base frame, m / rad / gripper command; the ee suite,
``sim.control.EeTargetControl``) a policy can learn and predict its chunk *relative to the end
effector at the chunk's start*: ``rel_k = a_k - (p_0, yaw_0, 0)`` with the yaw difference wrapped to
[-pi, pi), the gripper unchanged. The env, the store and the bridge keep the absolute targets (a
chunk that arrives late still says where to go); the policy adds the pose of the observation it
was computed from back before it returns the chunk (Black et al. 2024, pi0 / openpi: actions
relative to the current state, executed as absolute targets).

Proprio layout (``wmrl.kernel.types``): end-effector position ``[0:3]`` (m, base frame) and its
``quat_wxyz`` ``[3:7]``; the yaw of a gripper pointing down is ``atan2(R10, R00)`` of its rotation
(``wmrl.kernel.pose.yaw_of_down_quat``, the convention of ``sim.control.yaw_of_down_mat``).
"""

from __future__ import annotations

import numpy as np
import torch

from wmrl.kernel.pose import wrap_angle, yaw_of_down_quat
from wmrl.kernel.types import ActionSpace


def check_space(space: ActionSpace) -> None:
    """Raises ``ValueError`` unless ``space`` is an absolute ``yaw_down`` target space."""
    if space.mode != "absolute" or space.rotation != "yaw_down" or space.dim != 5:
        raise ValueError(f"chunk-relative actions need the 5-D absolute yaw_down target space (suite=ee), got "
                         f"{space.dim}-D mode={space.mode!r} rotation={space.rotation!r}; set relative_actions=false")


def resolve(setting, space: ActionSpace) -> bool:
    """A policy's ``relative_actions`` setting: ``"auto"`` is true exactly in the 5-D absolute
    ``yaw_down`` space, a bool is taken as given (true elsewhere raises in :func:`check_space`)."""
    if setting == "auto":
        return space.mode == "absolute" and space.rotation == "yaw_down" and space.dim == 5
    return bool(setting)


def to_chunk_frame(actions: torch.Tensor, proprio: torch.Tensor) -> torch.Tensor:
    """Absolute targets ``float (B, H, 5)`` -> relative to the pose in ``proprio`` ``(B, D_s)``."""
    rel = actions.clone()
    rel[..., :3] = actions[..., :3] - proprio[:, None, :3].to(actions)
    rel[..., 3] = wrap_angle(actions[..., 3] - yaw_of_down_quat(proprio[:, 3:7].to(actions))[:, None])
    return rel


def from_chunk_frame(rel: torch.Tensor, proprio: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`to_chunk_frame`: absolute targets ``(B, H, 5)``."""
    a = rel.clone()
    a[..., :3] = rel[..., :3] + proprio[:, None, :3].to(rel)
    a[..., 3] = wrap_angle(rel[..., 3] + yaw_of_down_quat(proprio[:, 3:7].to(rel))[:, None])
    return a


def chunk_frame_samples(episodes, chunk_size: int) -> np.ndarray:
    """Every action of every chunk window of ``episodes`` (pairs ``(proprio (T, D_s), actions (T, 5))``)
    in its window's chunk frame, ``float32 (N, 5)``: the data for the policy's action statistics."""
    out = []
    for proprio, actions in episodes:
        p, a = torch.as_tensor(np.asarray(proprio, np.float32)), torch.as_tensor(np.asarray(actions, np.float32))
        T = len(a)
        idx = torch.clamp(torch.arange(T)[:, None] + torch.arange(chunk_size)[None], max=T - 1)   # (T, H)
        out.append(to_chunk_frame(a[idx], p).reshape(-1, a.shape[1]).numpy())
    return np.concatenate(out)


__all__ = ["resolve", "check_space", "to_chunk_frame", "from_chunk_frame", "chunk_frame_samples"]
