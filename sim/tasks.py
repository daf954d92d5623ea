"""The tasks of the Panda tabletop suite: instruction, scene, success predicate, step limit and
how init-state layouts are sampled (LIBERO's task = scene + language goal + init states).

All tasks of a scene share the scene's init states (as in LIBERO-Goal), so in ``two_cubes`` the
same picture can ask for ``lift_red``, ``lift_green`` or ``stack_red_on_green``: only the
instruction tells them apart.

Positions are in the world frame, metres; the table top is at ``z = 0.8``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.scenes import GREEN_HALF, RED_HALF, TABLE_TOP, TARGET_RADIUS

LIFT_HEIGHT = 0.05  # m the cube's centre must rise above its resting height
FALL_Z = TABLE_TOP - 0.05  # below this an object has left the table: failure


@dataclass(frozen=True)
class TaskSpec:
    """One task of the suite.

    A new task on a stored scene is a subclass (a frozen dataclass too) that overrides
    :meth:`success` (and :meth:`failed` if needed), listed in a suite config's ``tasks`` as
    ``{_target_: my_pkg.MyTask, name: ..., scene: ..., instruction: ..., max_steps: ..., kind: ..., obj: ...}``;
    ``sim.suite.Suite`` resolves it by name, nothing is registered. ``kind`` also picks the scripted
    expert (``sim.expert``: ``lift`` / ``stack`` / ``push``), so a subclass with one of those kinds can
    be collected with the experts. Example: ``tests/examples/lift_high_task.py``.

    Attributes:
        name: task id (``lift_red``...).
        scene: scene name (``sim.scenes.SCENES``).
        instruction: the language instruction.
        max_steps: step limit (control steps at 20 Hz); reaching it truncates the episode.
        kind: ``"lift"``, ``"stack"`` or ``"push"`` (selects predicate and scripted expert).
        obj: the object to move (``"red"`` / ``"green"``); ``goal``: the other object or target.
    """

    name: str
    scene: str
    instruction: str
    max_steps: int
    kind: str
    obj: str
    goal: str | None = None

    def success(self, s: dict) -> bool:
        """Success predicate on a privileged state ``s`` (see ``TaskEnv.privileged``)."""
        p = s["objects"][self.obj]["pos"]
        if self.kind == "lift":
            half = RED_HALF if self.obj == "red" else GREEN_HALF
            return bool(p[2] > TABLE_TOP + half + LIFT_HEIGHT)
        if self.kind == "stack":
            g = s["objects"][self.goal]["pos"]
            on_top = abs(p[2] - (g[2] + GREEN_HALF + RED_HALF)) < 0.01
            centred = np.linalg.norm(p[:2] - g[:2]) < GREEN_HALF
            return bool(on_top and centred and s["contact"][f"{self.obj}_{self.goal}"]
                        and not s["grasped"][self.obj])
        if self.kind == "push":
            g = s["objects"][self.goal]["pos"]
            return bool(np.linalg.norm(p[:2] - g[:2]) < TARGET_RADIUS - RED_HALF
                        and p[2] < TABLE_TOP + RED_HALF + 0.01)
        raise ValueError(f"unknown task kind {self.kind!r}")

    @property
    def has_proprio_success(self) -> bool:
        """Whether :meth:`proprio_success` can read this task's success from proprio alone (lifts)."""
        return self.kind == "lift"

    def proprio_success(self, proprio: np.ndarray, gripper_cmd: np.ndarray, closed_steps: int = 12,
                        gap_min_m: float = 0.02, rise_min_m: float = 0.055) -> np.ndarray:
        """Success of a lift read from the arm alone, at every step: ``bool (T,)``.

        Step ``t`` succeeds when the gripper has been commanded closed for the last ``closed_steps``
        steps or more (``gripper_cmd > 0``; robosuite's +1 = close), the fingers are still
        ``gap_min_m`` or more apart (an object is held: on nothing the fingers close from 8 cm to
        under 2 cm within about 11 steps and end at 1-2 mm; the cubes are 4 and 5 cm), and the end
        effector has risen ``rise_min_m`` or more above its lowest point since the gripper closed
        (the sim's success is the object 5 cm up, and the hand holds it a little above its bottom).
        This is what an imagined rollout can get right where a critic on imagined frames cannot (a
        false grasp shows as a closed gap). Defaults chosen on recorded lifts in both action spaces
        (seed 2026) and checked on a fresh recording (seed 2027, docs/measurements.md); precision
        and recall against the sim's own success are tested in ``tests/test_proprio_success.py``.

        Args:
            proprio: ``float (T, 9)`` (eef position, ``quat_wxyz``, two finger joints; base frame, m),
                the state before each step's action.
            gripper_cmd: ``float (T,)``, the gripper command of each step's action.

        Raises:
            ValueError: the task is not a lift (``has_proprio_success`` is false) or shapes disagree.
        """
        if not self.has_proprio_success:
            raise ValueError(f"task {self.name!r} ({self.kind}) has no proprio success rule; only lifts do")
        p, g = np.asarray(proprio, dtype=np.float64), np.asarray(gripper_cmd, dtype=np.float64).reshape(-1)
        if p.ndim != 2 or p.shape[1] < 9 or p.shape[0] != g.shape[0]:
            raise ValueError(f"proprio (T, 9) and gripper_cmd (T,) needed, got {p.shape} and {g.shape}")
        out = np.zeros(len(g), dtype=bool)
        streak, z_low = 0, 0.0
        for t in range(len(g)):
            streak = streak + 1 if g[t] > 0 else 0
            z_low = p[t, 2] if streak <= 1 else min(z_low, p[t, 2])
            out[t] = streak >= closed_steps and (p[t, 7] - p[t, 8]) >= gap_min_m and p[t, 2] - z_low >= rise_min_m
        return out

    def failed(self, s: dict) -> bool:
        """Failure termination: an object fell off the table."""
        return any(o["pos"][2] < FALL_Z for k, o in s["objects"].items() if k != "target")


TASKS: dict[str, TaskSpec] = {t.name: t for t in (
    TaskSpec("lift_red", "two_cubes", "lift the red cube", 100, "lift", "red"),
    TaskSpec("lift_green", "two_cubes", "lift the green cube", 100, "lift", "green"),
    TaskSpec("stack_red_on_green", "two_cubes", "stack the red cube on the green cube", 160, "stack", "red", "green"),
    TaskSpec("push_red_to_target", "cube_target", "push the red cube onto the green target", 150, "push", "red", "target"),
)}


def get_task(name: str) -> TaskSpec:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {sorted(TASKS)}")
    return TASKS[name]


def sample_layout(scene: str, rng: np.random.Generator) -> dict[str, tuple[float, float, float]]:
    """Object layout ``{name: (x, y, yaw)}`` of one init state (world frame, m / rad).

    ``two_cubes``: both cubes in a 24 x 36 cm area in front of the robot, centres at least 9 cm
    apart, yaw within +-30 deg. ``cube_target``: cube as above; target centre 12-20 cm from the cube,
    inside the reachable area.
    """
    def cube():
        return (rng.uniform(-0.10, 0.12), rng.uniform(-0.18, 0.18), rng.uniform(-np.pi / 6, np.pi / 6))

    if scene == "two_cubes":
        while True:
            r, g = cube(), cube()
            if np.hypot(r[0] - g[0], r[1] - g[1]) >= 0.09:
                return {"red": r, "green": g}
    if scene == "cube_target":
        while True:
            r = cube()
            d, a = rng.uniform(0.12, 0.20), rng.uniform(-np.pi, np.pi)
            tx, ty = r[0] + d * np.cos(a), r[1] + d * np.sin(a)
            if -0.14 <= tx <= 0.16 and -0.2 <= ty <= 0.2:
                return {"red": r, "target": (tx, ty, 0.0)}
    raise ValueError(f"unknown scene {scene!r}")
