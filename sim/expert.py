"""Scripted experts of the suite: closed-loop waypoint controllers that read privileged object
poses and command robosuite's ``OSC_POSE`` (delta) controller, one control step at a time.

Each task's expert is a small phase machine (approach above, descend, close, lift / carry /
release / push), with a proportional law to the current waypoint: ``a_xyz = clip(k (p* - p) / 0.05)``
(0.05 m is the controller's output scale) and an orientation hold that keeps the gripper pointing
down, turned to the cube's nearest face.

Suboptimality knob ``noise`` (>= 0; 0 = clean). The task's expert works with an effective level
``e = noise * control.noise_scale[kind]`` (stacking is far more sensitive than lifting; each
control's scales are calibrated so that its default noise gives 30-60 % success on every task): correlated Gaussian action
noise (AR(1), coefficient 0.8, std ``e`` on the 3 position dims and ``rotation_noise * e`` on the 3
rotation dims; ``rotation_noise = 1`` by default), a per-episode grasp offset with std
``0.02 e`` m in x/y (misgrasps), a per-episode approach-height error (std ``0.01 e`` m), and short
random pauses (per-step probability ``0.05 e``, 1-5 steps). Deterministic given ``seed``.
"""

from __future__ import annotations

import numpy as np

from sim.control import OscDeltaControl
from sim.scenes import GREEN_HALF, RED_HALF, TABLE_TOP
from sim.tasks import TaskSpec, get_task

POS_SCALE = 0.05  # m per unit action (robosuite default OSC_POSE output_max)
ROT_SCALE = 0.5  # rad per unit action
OPEN, CLOSE = -1.0, 1.0


def _yaw_of(quat_wxyz: np.ndarray) -> float:
    w, x, y, z = quat_wxyz
    return float(np.arctan2(2 * (w * z + x * y), 1 - 2 * (y * y + z * z)))


class ScriptedExpert:
    """Scripted expert for one episode of one task.

    Args:
        task: ``TaskSpec`` or task name.
        noise: suboptimality (see module docstring); 0 = clean.
        seed: seed of the episode's noise.
        rotation_noise: scale of the action noise on the rotation dims relative to the position
            dims (>= 0). With robosuite's decoupled OSC_POSE a rotation command also moves the grip
            site (1.4-1.9 cm per step for 0.5 about x from an init pose), so rotation jitter makes the
            arm's motion much harder to predict from proprio and actions (see docs/measurements.md).

    ``act(s)`` maps the privileged state ``s`` (``TaskEnv.privileged()``) to an action
    ``float32 (7,)``: xyz delta, axis-angle delta (both in [-1, 1], base frame), gripper (-1 open,
    +1 close).
    """

    def __init__(self, task: TaskSpec | str, noise: float = 0.0, seed: int = 0, rotation_noise: float = 1.0,
                 control=None):
        self.task = get_task(task) if isinstance(task, str) else task
        self.control = OscDeltaControl() if control is None else control
        if self.task.kind not in self.control.noise_scale:
            raise ValueError(f"the {self.control.kind} control has no expert noise scale for task kind "
                             f"{self.task.kind!r} (known: {sorted(self.control.noise_scale)})")
        if noise < 0:
            raise ValueError(f"noise must be >= 0, got {noise}")
        if rotation_noise < 0:
            raise ValueError(f"rotation_noise must be >= 0, got {rotation_noise}")
        self.noise = float(noise) * self.control.noise_scale[self.task.kind]
        self._dim_scale = np.array([1.0, 1.0, 1.0] + [float(rotation_noise)] * 3)
        self.rng = np.random.default_rng(seed)
        self.phase = "above"
        self.count = 0
        self.grip = OPEN
        self._n = np.zeros(6)
        self._pause = 0
        self.offset = np.zeros(3)
        self.hover = 0.10
        if self.noise > 0:
            self.offset[:2] = self.rng.normal(0.0, 0.02 * self.noise, 2)
            self.offset[2] = abs(self.rng.normal(0.0, 0.01 * self.noise))
        self._yaw0 = None
        self._push_dir = None

    # ------------------------------------------------------------------ helpers
    def _move(self, s, goal, gain=1.6, max_a=1.0, yaw=0.0, hold=False) -> dict:
        """The step's intent; :meth:`act` turns it into an action of the control's space."""
        return dict(goal=goal, gain=gain, max_a=max_a, yaw=yaw, grip=self.grip, hold=hold)

    def _cube_yaw(self, s, name) -> float:
        y = _yaw_of(s["objects"][name]["quat_wxyz"])
        return float((y + np.pi / 4) % (np.pi / 2) - np.pi / 4)  # nearest face, in [-45, 45) deg

    def _advance(self, phase):
        self.phase, self.count = phase, 0

    # ------------------------------------------------------------------ policy
    def act(self, s: dict) -> np.ndarray:
        """The action ``float32 (D_a,)`` of the control's space for privileged state ``s``."""
        kind = self.task.kind
        move = self._lift_stack(s) if kind in ("lift", "stack") else self._push(s)
        self.count += 1
        n, still = np.zeros(6), False
        if self.noise > 0:
            self._n = 0.8 * self._n + np.sqrt(1 - 0.8 ** 2) * self.rng.normal(0.0, self.noise, 6)
            n = self._n * self._dim_scale
            if self._pause > 0:
                self._pause -= 1
                still = True
            elif self.rng.random() < 0.05 * self.noise:
                self._pause = int(self.rng.integers(1, 6))
        return self.control.waypoint_action(s, noise=n, still=still, **move)

    def _lift_stack(self, s) -> dict:
        obj = self.task.obj
        half = RED_HALF if obj == "red" else GREEN_HALF
        p = s["objects"][obj]["pos"]
        yaw = self._cube_yaw(s, obj)
        grasp = p + self.offset + np.array([0.0, 0.0, -0.005])
        eef = s["eef_pos"]
        if self.phase == "above":
            self.grip = OPEN
            goal = grasp + np.array([0, 0, self.hover])
            if (np.linalg.norm(goal[:2] - eef[:2]) < 0.01 and abs(goal[2] - eef[2]) < 0.02) or self.count > 40:
                self._advance("descend")
            return self._move(s, goal, yaw=yaw)
        if self.phase == "descend":
            goal = grasp
            if np.linalg.norm(goal - eef) < 0.008 or self.count > 30:
                self._advance("close")
            return self._move(s, goal, gain=1.2, yaw=yaw)
        if self.phase == "close":
            self.grip = CLOSE
            if self.count >= 8:
                self._hold = eef.copy()
                self._advance("lift")
            return self._move(s, grasp, yaw=yaw)
        if self.task.kind == "lift":
            if self.phase == "lift":
                return self._move(s, self._hold + np.array([0, 0, 0.15]), max_a=0.6, yaw=yaw)
        g = s["objects"][self.task.goal]["pos"]
        gyaw = self._cube_yaw(s, self.task.goal)
        place_z = g[2] + GREEN_HALF + half + 0.012
        if self.phase == "lift":
            goal = np.array([eef[0], eef[1], place_z + 0.06])
            if eef[2] > place_z + 0.04 or self.count > 30:
                self._advance("carry")
            return self._move(s, goal, max_a=0.7, yaw=gyaw)
        if self.phase == "carry":
            # move the cube (not the hand) over the goal
            goal = np.array([g[0], g[1], place_z + 0.06]) + (eef - p) * np.array([1, 1, 0])
            if np.linalg.norm(p[:2] - g[:2]) < 0.006 or self.count > 50:
                self._advance("lower")
            return self._move(s, goal, max_a=0.7, yaw=gyaw)
        if self.phase == "lower":
            goal = np.array([g[0], g[1], place_z]) + (eef - p) * np.array([1, 1, 0]) + np.array([0, 0, eef[2] - p[2]])
            if abs(p[2] - place_z) < 0.006 or self.count > 25:
                self._advance("release")
            return self._move(s, goal, gain=1.0, max_a=0.4, yaw=gyaw)
        if self.phase == "release":
            self.grip = OPEN
            if self.count >= 6:
                self._hold = eef.copy()
                self._advance("retreat")
            return self._move(s, eef, yaw=gyaw, hold=True)
        # retreat
        return self._move(s, self._hold + np.array([0, 0, 0.08]), max_a=0.5, yaw=gyaw)

    def _push(self, s) -> dict:
        c = s["objects"][self.task.obj]["pos"]
        t = s["objects"][self.task.goal]["pos"]
        eef = s["eef_pos"]
        self.grip = CLOSE
        d = t[:2] - c[:2]
        dist = np.linalg.norm(d)
        u = d / max(dist, 1e-6)
        push_z = TABLE_TOP + 0.018 + self.offset[2]
        behind = np.array([*(c[:2] - u * (RED_HALF + 0.03) + self.offset[:2]), push_z])
        yaw = float((np.arctan2(u[1], u[0]) + np.pi / 4) % (np.pi / 2) - np.pi / 4)
        if self.phase == "above":
            goal = behind + np.array([0, 0, 0.08])
            if np.linalg.norm(goal[:2] - eef[:2]) < 0.01 or self.count > 40:
                self._advance("descend")
            return self._move(s, goal, yaw=yaw)
        if self.phase == "descend":
            if abs(eef[2] - push_z) < 0.01 or self.count > 30:
                self._advance("push")
            return self._move(s, behind, gain=1.2, yaw=yaw)
        # push: stay on the line behind the cube and move along it towards the target
        rel = eef[:2] - c[:2]
        lateral = rel - np.dot(rel, u) * u
        if np.linalg.norm(lateral) > 0.03 and self.count > 3:  # slipped off the cube: re-approach
            self._advance("above")
            return self._move(s, behind + np.array([0, 0, 0.08]), yaw=yaw)
        step = min(0.02, dist)
        goal = np.array([*(c[:2] - u * (RED_HALF + 0.012) + u * step - 0.6 * lateral), push_z])
        return self._move(s, goal, gain=1.0, max_a=0.5, yaw=yaw)


class ExpertActor:
    """Drives one :class:`ScriptedExpert` per slot of a ``SimEnv`` (the "policy" ``expert`` of
    ``wmrl evaluate``). Follows the actor protocol of ``wmrl.evaluation``: ``begin(slot, task_name,
    seed)`` at each episode start, ``act(env, obs, active) -> float32 (B, 1, D_a)``.

    The expert reads privileged state, not images, so ``needs_images`` is ``False``.
    """

    chunk_size = 1
    needs_images = False

    def __init__(self, noise: float = 0.0, rotation_noise: float = 1.0, tasks=None, control=None):
        self.noise = float(noise)
        self.control = OscDeltaControl() if control is None else control
        self.rotation_noise = float(rotation_noise)
        self._tasks = get_task if tasks is None else tasks  # task_name -> TaskSpec (Suite.task)
        self._experts: dict[int, ScriptedExpert] = {}

    def begin(self, slot: int, task_name: str, seed: int) -> None:
        self._experts[slot] = ScriptedExpert(self._tasks(task_name), self.noise, seed, self.rotation_noise,
                                             self.control)

    def act(self, env, obs, active) -> "torch.Tensor":
        import torch

        out = np.zeros((env.num_envs, 1, env.action_dim), np.float32)
        for b in range(env.num_envs):
            if active[b]:
                out[b, 0] = self._experts[b].act(env.privileged(b))
        return torch.from_numpy(out)
