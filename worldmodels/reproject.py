"""Reprojection of a hand-mounted camera's frame to another pose of the hand, through a plane.

A camera fixed to the hand (robosuite's ``robot0_eye_in_hand``) sees the table from wherever the
arm is: over one imagined chunk its whole picture shifts, scales and turns, which a world model that
predicts frame residuals blurs into a wash after a single chunk (docs/measurements.md, "Frames
conditioned on the real start frame"). Before the arm grasps anything, the scene below the hand is
static, so the *real* frame of the rollout's start (the anchor), seen from the start pose, already
shows what the camera will see from the predicted pose, up to a change of viewpoint. For points on
a horizontal plane that change of viewpoint is exact geometry (a plane-induced homography, Hartley
and Zisserman, "Multiple View Geometry", 2nd ed., section 13.1): every pixel of the target view
is a ray from the camera, which meets the plane at one point, which projects into the anchor
camera. The world model is conditioned on this warped anchor (``worldmodels.video_wm``) and
corrects what the plane does not explain (the cubes' sides, the fingers, a grasped object that
moves with the hand, what was outside the anchor's view).

Conventions: poses are the end effector's ``(position m, quat_wxyz)`` in the robot base frame (the
first 7 proprio dims of ``wmrl.kernel.types``); the camera's mount is its position and rotation in
the end-effector frame; the camera looks along its own ``-z`` with ``+x`` to the right of the
image and ``+y`` up (MuJoCo / OpenGL), pinhole with a vertical field of view ``fovy_deg`` and
square pixels. Checked against MuJoCo's renders of the suite (``tests/test_reproject.py``).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F


def quat_wxyz_to_mat(q: torch.Tensor) -> torch.Tensor:
    """Rotation matrices ``(..., 3, 3)`` of quaternions ``(..., 4)`` (``w, x, y, z``; normalised here)."""
    q = q / q.norm(dim=-1, keepdim=True).clamp_min(1e-8)
    w, x, y, z = q.unbind(-1)
    return torch.stack([1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y),
                        2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x),
                        2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)], -1).reshape(*q.shape[:-1], 3, 3)


class PlaneReprojection(torch.nn.Module):
    """Warp a hand camera's frame from one end-effector pose to another through the plane
    ``z = plane_z_m`` (robot base frame). No trainable parameters.

    Args:
        fovy_deg: vertical field of view of the camera (deg).
        mount_pos_m: the camera's position in the end-effector frame (m, 3 values).
        mount_rot: the camera's rotation in the end-effector frame (3x3, rows).
        plane_z_m: height of the plane in the base frame (m); the scene is taken to lie on it.

    Raises:
        ValueError: a field of view outside (0, 180), or a mount of the wrong shape.
    """

    def __init__(self, fovy_deg: float, mount_pos_m: Sequence[float], mount_rot: Sequence[Sequence[float]],
                 plane_z_m: float):
        super().__init__()
        if not 0 < float(fovy_deg) < 180:
            raise ValueError(f"fovy_deg must be in (0, 180), got {fovy_deg}")
        pos = torch.tensor([float(v) for v in mount_pos_m])
        rot = torch.tensor([[float(v) for v in row] for row in mount_rot])
        if pos.shape != (3,) or rot.shape != (3, 3):
            raise ValueError(f"mount_pos_m needs 3 values and mount_rot a 3x3 matrix, got {tuple(pos.shape)} and "
                             f"{tuple(rot.shape)}")
        self.fovy_deg, self.plane_z_m = float(fovy_deg), float(plane_z_m)
        self.register_buffer("mount_pos", pos, persistent=False)
        self.register_buffer("mount_rot", rot, persistent=False)

    def camera(self, pose: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Camera position ``(B, 3)`` and rotation ``(B, 3, 3)`` in the base frame for end-effector
        poses ``(B, >= 7)`` (position, ``quat_wxyz``)."""
        r = quat_wxyz_to_mat(pose[:, 3:7].float())
        return pose[:, :3].float() + r @ self.mount_pos, r @ self.mount_rot

    def grid(self, anchor_pose: torch.Tensor, pose: torch.Tensor, hw: tuple[int, int]) -> torch.Tensor:
        """``grid_sample`` grid ``float32 (B, Hi, Wi, 2)``: where each pixel of the camera at ``pose``
        lies in the anchor camera at ``anchor_pose`` (normalised coordinates; outside [-1, 1]: not in
        the anchor's view, or a ray that does not meet the plane in front of the camera)."""
        h, w = hw
        dev = pose.device
        f = (h / 2) / math.tan(math.radians(self.fovy_deg) / 2)
        rows, cols = torch.meshgrid(torch.arange(h, device=dev) + 0.5, torch.arange(w, device=dev) + 0.5, indexing="ij")
        d = torch.stack([(cols - w / 2) / f, -(rows - h / 2) / f, -torch.ones_like(cols)], -1).reshape(-1, 3)
        c, rc = self.camera(pose)
        ca, rca = self.camera(anchor_pose)
        ray = torch.einsum("bij,pj->bpi", rc, d)                       # (B, P, 3) in the base frame
        down = ray[..., 2] < -1e-4
        lam = (self.plane_z_m - c[:, None, 2]) / torch.where(down, ray[..., 2], -torch.ones_like(ray[..., 2]))
        ok = down & (lam > 0)
        pt = c[:, None] + lam[..., None] * ray
        q = torch.einsum("bji,bpj->bpi", rca, pt - ca[:, None])        # anchor camera frame
        depth = -q[..., 2]
        ok = ok & (depth > 1e-3)
        depth = depth.clamp_min(1e-3)
        gx = (q[..., 0] / depth * f) / (w / 2)
        gy = (-q[..., 1] / depth * f) / (h / 2)
        g = torch.stack([gx, gy], -1)
        g = torch.where(ok[..., None], g, torch.full_like(g, 2.0))     # marked out of view
        return g.reshape(-1, h, w, 2)

    def forward(self, anchor: torch.Tensor, anchor_pose: torch.Tensor, pose: torch.Tensor) -> torch.Tensor:
        """The anchor frame ``float32 (B, C, Hi, Wi)`` (in [-1, 1]) as the camera at ``pose`` would
        see it; pixels it does not cover are 0 (mid-grey)."""
        g = self.grid(anchor_pose, pose, tuple(anchor.shape[-2:]))
        return F.grid_sample(anchor.float(), g, mode="bilinear", padding_mode="zeros", align_corners=False)


__all__ = ["PlaneReprojection", "quat_wxyz_to_mat"]
