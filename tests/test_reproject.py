"""Reprojection of the wrist camera through the table plane (worldmodels/reproject.py): the geometry
is exact on synthetic points, and the Panda mount in configs/worldmodel/anchor.yaml matches MuJoCo's
renders of the suite (a cube seen from one pose lands where the reprojection puts it in another)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from worldmodels.reproject import PlaneReprojection, quat_wxyz_to_mat

ANCHOR_CFG = yaml.safe_load((Path(__file__).parents[1] / "configs/worldmodel/anchor.yaml").read_text())["anchor"]["reproject"]


def _reprojection(plane_z=ANCHOR_CFG["plane_z_m"]):
    return PlaneReprojection(ANCHOR_CFG["fovy_deg"], ANCHOR_CFG["mount_pos_m"], ANCHOR_CFG["mount_rot"], plane_z)


def _down_pose(x, y, z, yaw):
    """End-effector pose (7,) pointing down (the Panda grip site's z axis along -z of the base) with a yaw."""
    # rotation about x by pi (pointing down), then about the base z by yaw
    c, s = math.cos(yaw / 2), math.sin(yaw / 2)
    q_yaw = torch.tensor([c, 0.0, 0.0, s])
    q_down = torch.tensor([0.0, 1.0, 0.0, 0.0])
    w1, x1, y1, z1 = q_yaw
    w2, x2, y2, z2 = q_down
    q = torch.tensor([w1 * w2 - x1 * x2 - y1 * y2 - z1 * z2, w1 * x2 + x1 * w2 + y1 * z2 - z1 * y2,
                      w1 * y2 - x1 * z2 + y1 * w2 + z1 * x2, w1 * z2 + x1 * y2 - y1 * x2 + z1 * w2])
    return torch.cat([torch.tensor([x, y, z]), q])


def _project(rp, pose, point, hw=(64, 64)):
    """Pixel (row, col) of a base-frame point in the camera at ``pose`` (pixel centres at +0.5)."""
    c, r = rp.camera(pose[None])
    q = r[0].T @ (point - c[0])
    f = (hw[0] / 2) / math.tan(math.radians(rp.fovy_deg) / 2)
    return hw[0] / 2 - q[1] / -q[2] * f, hw[1] / 2 + q[0] / -q[2] * f


def test_quaternion_matrices_are_rotations():
    q = torch.randn(16, 4)
    r = quat_wxyz_to_mat(q)
    assert torch.allclose(r @ r.transpose(-1, -2), torch.eye(3).expand(16, 3, 3), atol=1e-5)
    assert torch.allclose(torch.linalg.det(r), torch.ones(16), atol=1e-5)


def test_same_pose_is_the_identity_warp():
    rp = _reprojection()
    pose = _down_pose(0.0, 0.0, 0.05, 0.3)[None]
    img = torch.rand(1, 3, 64, 64) * 2 - 1
    out = rp(img, pose, pose)
    assert torch.allclose(out, img, atol=1e-4)


def test_a_point_on_the_plane_moves_where_the_geometry_says():
    rp = _reprojection()
    a, b = _down_pose(0.0, 0.0, 0.06, 0.0), _down_pose(0.03, -0.02, 0.02, 0.4)
    grid = rp.grid(a[None], b[None], (64, 64))[0]
    for px, py in [(0.01, 0.02), (-0.02, -0.01), (0.03, 0.0)]:
        point = torch.tensor([px, py, rp.plane_z_m])
        ra, ca = _project(rp, a, point)
        rb, cb = _project(rp, b, point)
        assert 0 <= rb < 64 and 0 <= cb < 64
        g = grid[int(rb), int(cb)]  # where that pixel of view b lies in view a (normalised)
        assert abs((g[1] + 1) * 32 - ra) < 1.0 and abs((g[0] + 1) * 32 - ca) < 1.0


def test_rays_above_the_horizon_are_out_of_view():
    rp = _reprojection()
    up = torch.cat([torch.tensor([0.0, 0.0, 0.1]), torch.tensor([1.0, 0.0, 0.0, 0.0])])  # camera looking up
    g = rp.grid(_down_pose(0.0, 0.0, 0.05, 0.0)[None], up[None], (8, 8))
    assert (g.abs() > 1).all()


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="fovy"):
        PlaneReprojection(0.0, [0, 0, 0], np.eye(3).tolist(), 0.0)
    with pytest.raises(ValueError, match="mount"):
        PlaneReprojection(60.0, [0, 0], np.eye(3).tolist(), 0.0)


@pytest.mark.usefixtures("shared_data")
def test_the_panda_mount_matches_mujoco_renders():
    """The red cube rendered from two wrist poses: its centroid in the second render is where the
    reprojection of the first puts it (within 3 px of 64), and the warped first render is closer to
    the second than the unwarped one."""
    from sim.control import EeTargetControl
    from sim.env import TaskEnv
    from sim.init_states import get

    env = TaskEnv("two_cubes", cameras=("robot0_eye_in_hand",), control=EeTargetControl())
    env.reset("lift_red", get("two_cubes", "train", 0))
    pv = env.privileged()
    red = pv["base_mat"].T @ (pv["objects"]["red"]["pos"] - pv["base_pos"])

    def go(target):
        for _ in range(40):
            env.step(np.asarray(target, np.float32))
        return env.render("robot0_eye_in_hand"), torch.from_numpy(env.proprio()[:7]).float()

    img_a, pose_a = go([red[0] - 0.03, red[1] + 0.02, 0.03, 0.0, -1.0])
    img_b, pose_b = go([red[0] - 0.01, red[1] - 0.01, 0.0, -0.3, -1.0])
    rp = _reprojection()
    to_t = lambda im: torch.from_numpy(im).permute(2, 0, 1)[None].float() / 127.5 - 1  # noqa: E731
    warped = rp(to_t(img_a), pose_a[None], pose_b[None])[0].permute(1, 2, 0).numpy()

    def red_centroid(im):
        m = (im[..., 0] - im[..., 1] > 0.6) & (im[..., 0] - im[..., 2] > 0.6)  # red: R at least 76 levels above G and B
        rows, cols = np.nonzero(m)
        assert len(rows) > 20, "the red cube should be in view"
        return np.array([rows.mean(), cols.mean()])

    seen = red_centroid(to_t(img_b)[0].permute(1, 2, 0).numpy())
    assert np.linalg.norm(red_centroid(warped) - seen) < 3.0
    assert np.linalg.norm(red_centroid(to_t(img_a)[0].permute(1, 2, 0).numpy()) - seen) > 5.0
    covered = (rp.grid(pose_a[None], pose_b[None], (64, 64))[0].abs() <= 1).all(-1).numpy()
    covered[48:] = False  # the fingers, which move with the camera, are not on the plane
    b = to_t(img_b)[0].permute(1, 2, 0).numpy()
    err_warped = np.abs(warped - b)[covered].mean()
    err_copy = np.abs(to_t(img_a)[0].permute(1, 2, 0).numpy() - b)[covered].mean()
    assert covered.mean() > 0.5 and err_warped < 0.7 * err_copy
