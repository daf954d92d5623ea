"""Arm control of the suite: how an action's numbers become a robosuite ``OSC_POSE`` command.

A control declares its action space (``action_space``, a :class:`wmrl.kernel.types.ActionSpace`),
the robosuite controller config it runs, and :meth:`to_command` (one action in, one robosuite
command out, plus whether the action was clipped). The suite's config picks one with a Hydra
``_target_`` (``configs/suite/*.yaml``, key ``control``); a new control is one class with these
members plus a YAML entry.

* :class:`OscDeltaControl` (``suite=default``): robosuite's default Panda ``OSC_POSE`` in delta
  mode, 7-D (xyz delta scaled to 5 cm, axis-angle delta scaled to 0.5 rad, gripper). Position and
  orientation are decoupled and the arm integrates the commands, so every step's tracking error
  persists (docs/measurements.md: 2.8 cm after one chunk, growing like a random walk). LIBERO and
  robomimic data use this space.
* :class:`EeTargetControl` (``suite=ee``): absolute end-effector targets, 5-D ``(x, y, z, yaw,
  gripper)`` in the robot base frame (m, m, m, rad, -1 open / +1 close), roll and pitch held with
  the gripper pointing down, ``OSC_POSE`` in absolute mode with position and orientation coupled
  (``uncouple_pos_ori: false``) and fixed impedance. A target is reached to about 0.25 cm within
  one 8-step chunk (kp 150), so an error does not outlive its chunk. Each target is clipped to a
  box of ``max_step_m`` around the current end effector (and ``max_yaw_step_rad`` in yaw) and to
  the ``workspace`` box; absolute mode does no clipping of its own. The env, the store and the
  bridge carry base-frame targets (a chunk that arrives late still says where to go); a policy that
  predicts chunk-relative targets (openpi's delta actions: target of step k = end effector at the
  chunk's start + a_k) adds the chunk-start pose of its observation before it returns the chunk.

Measured on ``two_cubes`` from the init pose, no rendering (``tests/test_control.py``): holding the
current pose moves the grip site < 1e-6 mm per chunk; a 5 cm target is 0.23-0.25 cm away after 8
steps and 0.01-0.02 cm after 16; a 0.5 rad yaw command moves the grip site 0.37 cm (1.43 cm with
decoupled position and orientation).
"""

from __future__ import annotations

import copy
import math
from typing import Sequence

import numpy as np

from wmrl.kernel.types import PANDA_EE_YAW, PANDA_OSC_POSE, ActionSpace

#: gripper z pointing down, fingers along the base frame's y axis at yaw 0
DOWN = np.array([[1.0, 0.0, 0.0], [0.0, -1.0, 0.0], [0.0, 0.0, -1.0]])


def rot_z(a: float) -> np.ndarray:
    c, s = math.cos(a), math.sin(a)
    return np.array([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]])


def yaw_of_down_mat(m: np.ndarray) -> float:
    """Yaw ``y`` (rad, in (-pi, pi]) of a rotation close to ``rot_z(y) @ DOWN`` (gripper down)."""
    return float(math.atan2(m[1, 0], m[0, 0]))


def wrap_angle(a: np.ndarray | float) -> np.ndarray | float:
    """Angle(s) wrapped to [-pi, pi)."""
    return (np.asarray(a) + np.pi) % (2 * np.pi) - np.pi


def axis_angle(r: np.ndarray) -> np.ndarray:
    """Axis-angle vector ``(3,)`` (rad) of rotation matrix ``r``."""
    cos = np.clip((np.trace(r) - 1.0) / 2.0, -1.0, 1.0)
    ang = np.arccos(cos)
    if ang < 1e-8:
        return np.zeros(3)
    v = np.array([r[2, 1] - r[1, 2], r[0, 2] - r[2, 0], r[1, 0] - r[0, 1]])
    n = np.linalg.norm(v)
    if n < 1e-8:  # ~180 deg: take the dominant column of r + I
        w, u = np.linalg.eigh((r + np.eye(3)) / 2)
        return u[:, -1] * ang
    return v / n * ang


def _rotvec(m: np.ndarray) -> np.ndarray:
    from scipy.spatial.transform import Rotation

    return Rotation.from_matrix(m).as_rotvec()


def _robosuite_default() -> dict:
    from sim.scenes import default_controller_config

    return default_controller_config()


class OscDeltaControl:
    """robosuite's default Panda ``OSC_POSE`` delta control (7-D; see the module docstring).

    ``to_command`` passes the action through (robosuite clips it to [-1, 1] and scales it); an
    action outside [-1, 1] counts as clipped.
    """

    kind = "osc_delta"
    action_space: ActionSpace = PANDA_OSC_POSE
    #: the scripted experts' noise per task kind, calibrated so that ``noise = 0.6`` gives 30-60 %
    #: success on every task (``sim.expert``)
    noise_scale = {"lift": 0.68, "stack": 0.3, "push": 0.45}

    def controller_config(self) -> dict:
        return _robosuite_default()

    def to_command(self, action: np.ndarray, eef_pos: np.ndarray, eef_mat: np.ndarray) -> tuple[np.ndarray, bool]:
        """``float (7,)`` action -> ``(float64 (7,) robosuite command, clipped)``."""
        a = np.asarray(action, dtype=np.float64)
        return a, bool(np.any(np.abs(a[:6]) > 1.0))

    def waypoint_action(self, s: dict, goal: np.ndarray, yaw: float, grip: float, gain: float, max_a: float,
                        noise: np.ndarray, still: bool = False, hold: bool = False) -> np.ndarray:
        """A scripted expert's step toward ``goal`` (world frame, m) at gripper ``yaw`` (rad), from the
        privileged state ``s`` (``TaskEnv.privileged()``): ``a_xyz = clip(gain (goal - eef) / 5 cm,
        +-max_a)`` (0 with ``hold``), an orientation hold to ``rot_z(yaw) @ DOWN``, plus ``noise``
        ``(6,)`` in action units (``still``: the noise only, scaled by 0.2). Returns ``float32 (7,)``."""
        a = np.zeros(7)
        a[:3] = np.clip(gain * (goal - s["eef_pos"]) / 0.05, -max_a, max_a)
        a[3:6] = np.clip(1.5 * axis_angle(rot_z(yaw) @ DOWN @ s["eef_mat"].T) / 0.5, -1.0, 1.0)
        a[6] = grip
        if hold:
            a[:3] = 0.0
        a[:6] = a[:6] + noise
        if still:
            a[:6] = noise * 0.2
        a[:6] = np.clip(a[:6], -1.0, 1.0)
        return a.astype(np.float32)


class EeTargetControl:
    """Absolute end-effector targets with yaw, coupled ``OSC_POSE`` (5-D; see the module docstring).

    Args:
        max_step_m: half-size of the box around the current end effector a target is clipped to (m).
        max_yaw_step_rad: the most a yaw target may differ from the current yaw (rad).
        workspace_low, workspace_high: the box targets are clipped to, base frame (m).
        kp: OSC stiffness (fixed impedance; critically damped).

    Raises:
        ValueError: a non-positive clip size or kp, or an empty workspace box.
    """

    kind = "ee_target"
    action_space: ActionSpace = PANDA_EE_YAW
    #: the scripted experts' noise per task kind (``sim.expert``), calibrated so that the suite's
    #: default noise (``configs/suite/ee.yaml``) gives 30-60 % success on every task
    noise_scale = {"lift": 1.1, "stack": 0.45, "push": 0.9}

    def __init__(self, max_step_m: float = 0.05, max_yaw_step_rad: float = 0.5,
                 workspace_low: Sequence[float] = PANDA_EE_YAW.low[:3],
                 workspace_high: Sequence[float] = PANDA_EE_YAW.high[:3], kp: float = 150.0):
        self.max_step_m, self.max_yaw_step_rad, self.kp = float(max_step_m), float(max_yaw_step_rad), float(kp)
        self.low = np.asarray(workspace_low, dtype=np.float64)
        self.high = np.asarray(workspace_high, dtype=np.float64)
        if self.max_step_m <= 0 or self.max_yaw_step_rad <= 0 or self.kp <= 0:
            raise ValueError(f"max_step_m, max_yaw_step_rad and kp must be > 0, got {max_step_m}, "
                             f"{max_yaw_step_rad}, {kp}")
        if self.low.shape != (3,) or self.high.shape != (3,) or np.any(self.low >= self.high):
            raise ValueError(f"workspace_low < workspace_high (3 values each) needed, got {list(self.low)} "
                             f"and {list(self.high)}")

    def controller_config(self) -> dict:
        cfg = copy.deepcopy(_robosuite_default())
        arm = cfg["body_parts"]["right"]
        arm.update(input_type="absolute", uncouple_pos_ori=False, impedance_mode="fixed", kp=self.kp)
        return cfg

    def to_command(self, action: np.ndarray, eef_pos: np.ndarray, eef_mat: np.ndarray) -> tuple[np.ndarray, bool]:
        """``float (5,)`` target ``(x, y, z, yaw, gripper)`` and the current end-effector pose (base
        frame) -> ``(float64 (7,) robosuite absolute command, clipped)``."""
        a = np.asarray(action, dtype=np.float64)
        pos = np.clip(a[:3], eef_pos - self.max_step_m, eef_pos + self.max_step_m)
        pos = np.clip(pos, self.low, self.high)
        yaw_now = yaw_of_down_mat(eef_mat)
        dyaw = float(wrap_angle(a[3] - yaw_now))
        dyaw_c = float(np.clip(dyaw, -self.max_yaw_step_rad, self.max_yaw_step_rad))
        clipped = bool(np.any(np.abs(pos - a[:3]) > 1e-9) or abs(dyaw_c - dyaw) > 1e-9 or abs(a[4]) > 1.0)
        cmd = np.concatenate([pos, _rotvec(rot_z(yaw_now + dyaw_c) @ DOWN), [np.clip(a[4], -1.0, 1.0)]])
        return cmd, clipped

    def waypoint_action(self, s: dict, goal: np.ndarray, yaw: float, grip: float, gain: float, max_a: float,
                        noise: np.ndarray, still: bool = False, hold: bool = False) -> np.ndarray:
        """A scripted expert's target toward ``goal`` (world frame, m) from the privileged state ``s``:
        the current end effector plus ``clip(gain (goal - eef), +-max_a * 5 cm)`` (0 with ``hold``),
        at a yaw stepped toward ``yaw`` (at most 0.5 rad), in the base frame; ``noise`` ``(6,)`` is
        in the delta space's units (5 cm on xyz, 0.5 rad on the third rotation dim, i.e. yaw; roll
        and pitch are held down). ``still``: the current pose plus 0.2 x the noise. Returns
        ``float32 (5,)``."""
        rb, pb = s["base_mat"], s["base_pos"]
        eef_b = rb.T @ (s["eef_pos"] - pb)
        step = rb.T @ np.clip(gain * (goal - s["eef_pos"]), -max_a * 0.05, max_a * 0.05)
        if hold or still:
            step = np.zeros(3)
        scale = 0.2 if still else 1.0
        yaw_now = yaw_of_down_mat(rb.T @ s["eef_mat"])
        yaw_goal = yaw - yaw_of_down_mat(rb)  # the goal yaw is in the world frame
        dyaw = 0.0 if still else float(np.clip(1.5 * wrap_angle(yaw_goal - yaw_now), -0.5, 0.5))
        target = eef_b + step + scale * noise[:3] * 0.05
        yaw_t = float(wrap_angle(yaw_now + dyaw + scale * noise[5] * 0.5))
        return np.array([*target, yaw_t, grip], dtype=np.float32)


__all__ = ["OscDeltaControl", "EeTargetControl", "DOWN", "rot_z", "axis_angle", "yaw_of_down_mat", "wrap_angle"]
