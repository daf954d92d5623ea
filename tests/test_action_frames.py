"""Chunk-relative action frames (policies.action_frames) and a FlowVLAPolicy that learns in them."""

from __future__ import annotations

import math

import pytest
import torch

from policies.action_frames import (
    check_space,
    chunk_frame_samples,
    from_chunk_frame,
    to_chunk_frame,
)
from wmrl.kernel.pose import yaw_of_down_quat as yaw_of_quat
from wmrl.kernel.types import PANDA_EE_YAW, PANDA_OSC_POSE


def _proprio(b, yaw):
    """Gripper pointing down at yaw ``yaw``: R = rot_z(yaw) @ diag(1, -1, -1) -> quat_wxyz (0, cos y/2, sin y/2, 0)."""
    p = torch.zeros(b, 9)
    p[:, :3] = torch.tensor([0.5, 0.1, 0.2])
    p[:, 4], p[:, 5] = math.cos(yaw / 2), math.sin(yaw / 2)
    return p


def test_round_trip_and_the_yaw_wraps():
    p = _proprio(2, 3.0)
    assert yaw_of_quat(p[:, 3:7]).allclose(torch.full((2,), 3.0), atol=1e-5)
    assert yaw_of_quat(-p[:, 3:7]).allclose(torch.full((2,), 3.0), atol=1e-5)   # q and -q
    a = torch.tensor([[[0.52, 0.08, 0.25, -3.0, 1.0]] * 3] * 2)
    rel = to_chunk_frame(a, p)
    assert rel[..., :3].allclose(torch.tensor([0.02, -0.02, 0.05]).expand(2, 3, 3), atol=1e-6)
    assert rel[..., 3].allclose(torch.full((2, 3), 2 * math.pi - 6.0), atol=1e-5)   # -3 - 3 wrapped: +0.283
    assert (rel[..., 4] == 1).all()
    assert from_chunk_frame(rel, p).allclose(a, atol=1e-5)


def test_only_the_absolute_yaw_space_has_a_chunk_frame():
    check_space(PANDA_EE_YAW)
    with pytest.raises(ValueError, match="relative_actions=false"):
        check_space(PANDA_OSC_POSE)


def test_samples_for_the_statistics_cover_every_window():
    p = _proprio(6, 0.0)
    p[:, 0] = torch.arange(6) * 0.01
    a = torch.zeros(6, 5)
    a[:, 0] = torch.arange(6) * 0.01 + 0.03
    out = chunk_frame_samples([(p.numpy(), a.numpy())], chunk_size=2)
    assert out.shape == (12, 5)
    # window t: actions t, t+1 relative to p_t: 0.03 and 0.04 (the last window repeats its last action)
    assert sorted(set(round(float(v), 4) for v in out[:, 0])) == [0.03, 0.04]


def test_a_relative_policy_returns_absolute_targets_around_the_observed_arm():
    from policies.flow_vla import FlowVLAPolicy
    from wmrl.kernel.storage.normalize import NormStats
    from wmrl.kernel.types import Obs

    torch.manual_seed(0)
    kw = dict(cameras=["agentview"], image_size=[32, 32], state_dim=9, action_dim=5, chunk_size=4,
              encoder={"kind": "conv", "channels": [8, 8, 8], "out_dim": 16}, lang_dim=16, proprio_dim=8,
              cond_dim=16, head_width=16, head_depth=1, time_dim=8, action_space=PANDA_EE_YAW.to_dict())
    with pytest.raises(ValueError, match="relative_actions=false"):
        FlowVLAPolicy(**{**kw, "action_dim": 7, "action_space": PANDA_OSC_POSE.to_dict()}, relative_actions=True)
    pol = FlowVLAPolicy(**kw, relative_actions=True).eval()
    assert pol.init_config["relative_actions"] is True and "relative_actions" not in FlowVLAPolicy(**kw).init_config
    rel = torch.zeros(64, 5)
    rel[:, :4] = torch.randn(64, 4) * 0.001          # the policy's chunks stay within ~mm (mrad) of the arm
    rel[:, 4] = torch.rand(64) * 2 - 1
    pol.set_norm_stats(NormStats.from_data({"proprio": torch.randn(64, 9).numpy(), "actions": rel.numpy()}))
    obs = Obs({"agentview": torch.zeros(2, 3, 32, 32, dtype=torch.uint8)}, _proprio(2, 0.5), ["lift", "lift"])
    obs.proprio[1, :3] = torch.tensor([0.3, -0.2, 0.05])
    out = pol.sample(obs, torch.Generator().manual_seed(0)).actions
    assert out.shape == (2, 4, 5)
    assert (out[..., :3] - obs.proprio[:, None, :3]).abs().max() < 0.02     # targets around each slot's own arm
    assert (out[..., 3] - 0.5).abs().max() < 0.1


def test_auto_means_the_absolute_target_space_only():
    from policies.action_frames import resolve

    assert resolve("auto", PANDA_EE_YAW) is True and resolve("auto", PANDA_OSC_POSE) is False
    assert resolve(False, PANDA_EE_YAW) is False
