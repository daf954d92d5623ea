"""Arm controls (sim/control.py): the absolute end-effector target space keeps the arm where the
actions put it (issue gate 1), clips what it must and counts it; the delta space is unchanged."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from policies.action_space import ActionConverter, as_action_space, clip_to_space
from sim.control import EeTargetControl, OscDeltaControl, yaw_of_down_mat
from sim.env import TaskEnv
from sim.expert import ScriptedExpert
from sim.init_states import get
from sim.suite import Suite
from wmrl.kernel.types import PANDA_EE_YAW, PANDA_OSC_POSE, ActionSpace

CHUNK = 8


@pytest.fixture(scope="module")
def ee_env():
    return TaskEnv("two_cubes", cameras=(), control=EeTargetControl())


def _reset(env, i=0):
    env.reset("lift_red", get("two_cubes", "train", i))
    pos, mat = env.eef_pose()
    return pos.copy(), yaw_of_down_mat(mat)


def test_holding_the_current_pose_does_not_move_the_arm(ee_env):
    pos0, yaw0 = _reset(ee_env)
    for _ in range(CHUNK):  # robosuite's init pose is 7.5 deg off pointing down: the first chunk turns it down
        ee_env.step(np.array([*pos0, yaw0, -1.0]))
    pos1, yaw1 = ee_env.eef_pose()[0].copy(), yaw_of_down_mat(ee_env.eef_pose()[1])
    assert np.linalg.norm(pos1 - pos0) < 2e-3
    for _ in range(CHUNK):  # now the current pose is one the action space says: holding it holds the arm
        ee_env.step(np.array([*pos1, yaw1, -1.0]))
    assert np.linalg.norm(ee_env.eef_pose()[0] - pos1) < 1e-3  # < 1 mm per chunk
    assert ee_env.clipped_steps == 0


@pytest.mark.parametrize("offset", [(0.05, 0, 0), (0, 0.05, 0), (0, 0, -0.05), (0.035, -0.035, 0)])
def test_a_5cm_target_is_tracked_within_one_chunk(ee_env, offset):
    pos0, yaw0 = _reset(ee_env, 1)
    target = pos0 + np.array(offset)
    for _ in range(CHUNK):
        ee_env.step(np.array([*target, yaw0, -1.0]))
    assert np.linalg.norm(ee_env.eef_pose()[0] - target) < 0.005  # < 0.5 cm at the chunk's end
    assert ee_env.clipped_steps == 0  # 5 cm is inside the default 5 cm box per axis


def test_far_targets_are_clipped_to_the_box_and_the_workspace_and_counted(ee_env):
    ctl = ee_env.control
    pos0, yaw0 = _reset(ee_env)
    cmd, clipped = ctl.to_command(np.array([*(pos0 + [0.3, 0, 0]), yaw0, -1.0]), *ee_env.eef_pose())
    assert clipped and cmd[0] == pytest.approx(pos0[0] + ctl.max_step_m)
    cmd, clipped = ctl.to_command(np.array([*pos0[:2], -1.0, yaw0, -1.0]), *ee_env.eef_pose())
    assert clipped and cmd[2] == pytest.approx(max(pos0[2] - ctl.max_step_m, ctl.low[2]))
    _, clipped = ctl.to_command(np.array([*pos0, yaw0 + 1.5, -1.0]), *ee_env.eef_pose())
    assert clipped  # yaw beyond max_yaw_step_rad
    for _ in range(3):
        ee_env.step(np.array([*(pos0 + [0.0, 0.0, 0.3]), yaw0, -1.0]))
    assert ee_env.clipped_steps == 3
    _reset(ee_env)
    assert ee_env.clipped_steps == 0  # counted per episode


def test_sim_env_reports_clipped_steps_per_slot():
    suite = Suite(tasks=["lift_red"], cameras=(), control=EeTargetControl())
    env = suite.make_env(num_envs=2, auto_reset=False)
    obs = env.reset([suite.train_start("lift_red", 0), suite.train_start("lift_red", 1)])
    assert env.action_dim == 5 and env.action_space == PANDA_EE_YAW
    pos = obs.proprio[:, :3].numpy()
    a = np.zeros((2, 4, 5), np.float32)
    a[:, :, :3] = pos[:, None]
    a[:, :, 3] = 1.5708
    a[:, :, 4] = -1
    a[1, :2, 2] += 0.2  # slot 1: two steps 20 cm up, clipped
    res = env.step(torch.from_numpy(a))
    assert res.info["clipped_steps"].tolist() == [0, 2]
    with pytest.raises(ValueError, match="D_a=5"):
        env.step(torch.zeros(2, 4, 7))


def test_the_scripted_expert_succeeds_in_the_target_space():
    env = TaskEnv("two_cubes", cameras=(), control=EeTargetControl())
    env.reset("lift_red", get("two_cubes", "train", 2))
    ex = ScriptedExpert("lift_red", 0.0, 0, control=env.control)
    for _ in range(env.task.max_steps):
        a = ex.act(env.privileged())
        assert a.shape == (5,) and a.dtype == np.float32
        _, success, terminated, truncated = env.step(a)
        if terminated or truncated:
            break
    assert success


def test_action_spaces_round_trip_and_refuse_mismatches():
    d = json.loads(json.dumps(PANDA_EE_YAW.to_dict()))  # as a store / checkpoint keeps it
    assert ActionSpace.from_dict(d) == PANDA_EE_YAW and as_action_space("panda_ee") == PANDA_EE_YAW
    with pytest.raises(ValueError, match="mode"):
        ActionConverter(PANDA_OSC_POSE, ActionSpace(**{**PANDA_OSC_POSE.to_dict(), "mode": "absolute"}))
    with pytest.raises(ValueError, match="dim"):
        ActionConverter(PANDA_OSC_POSE, PANDA_EE_YAW)
    with pytest.raises(ValueError, match="3 values"):
        ActionSpace(dim=5, low=(0.0, 0.0, 0.0))
    x = torch.tensor([[9.0, -9.0, 0.0, 4.0, 2.0]])
    low, high = PANDA_EE_YAW.bounds()
    assert clip_to_space(x, PANDA_EE_YAW)[0].tolist() == pytest.approx([high[0], low[1], 0.0, high[3], 1.0])


def test_the_ee_suite_config_builds_the_target_control():
    from hydra import compose, initialize_config_module
    from hydra.utils import instantiate

    with initialize_config_module(config_module="configs", version_base="1.3"):
        cfg = compose(config_name="collect", overrides=["suite=ee"])
    suite = instantiate(cfg.suite)
    assert isinstance(suite.control, EeTargetControl) and suite.action_space == PANDA_EE_YAW
    assert suite.describe()["control"] == "ee_target"
    assert isinstance(Suite().control, OscDeltaControl) and Suite().action_space == PANDA_OSC_POSE


def test_bad_control_settings_are_refused():
    with pytest.raises(ValueError, match="max_step_m"):
        EeTargetControl(max_step_m=0)
    with pytest.raises(ValueError, match="workspace_low"):
        EeTargetControl(workspace_low=[1, 0, 0], workspace_high=[0, 1, 1])
