"""The LIBERO-style task suite: which tasks, their init states, and how observations are made.

Build it from Hydra (``configs/suite/default.yaml`` has ``_target_: sim.suite.Suite``)::

    suite = Suite(tasks=["lift_red", "push_red_to_target"], image_size=(64, 64))
    env = suite.make_env(num_envs=4)                      # SimEnv (a ChunkEnv)
    obs = env.reset([suite.eval_start("lift_red", j) for j in range(4)])

``Suite`` implements ``wmrl.kernel.interfaces.Suite``. A task is a built-in name (``sim.tasks.TASKS``)
or a ``sim.tasks.TaskSpec`` object, so a new task is a ``TaskSpec`` subclass plus a YAML entry in
the suite's ``tasks`` list (``{_target_: my_pkg.MyTask, name: ..., scene: ..., ...}``, built by
Hydra); no registry to edit (example: ``tests/examples/lift_high_task.py``).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np

from sim import init_states as _init
from sim.control import OscDeltaControl
from sim.render import RenderSettings
from sim.tasks import TASKS, TaskSpec, get_task
from wmrl.kernel.types import AGENTVIEW, EYE_IN_HAND, ActionSpace, Start

DEFAULT_TASKS = ("lift_red", "lift_green", "stack_red_on_green", "push_red_to_target")


class Suite:
    """A set of tasks with stored init states and the observation settings of its environments.

    Args:
        tasks: task names (default: all four; see ``sim.tasks.TASKS``) or ``TaskSpec`` objects (a
            ``TaskSpec`` subclass overrides ``success`` / ``failed`` for a new task on a stored scene).
        cameras: observation cameras (``agentview``, ``robot0_eye_in_hand``); may be empty.
        image_size: ``(Hi, Wi)`` of observation images (64 x 64 by default).
        render: render effects, a dict of ``sim.render.RenderSettings`` fields.
        init_states_path: ``.npz`` of init states (default: the packaged ``sim/data/init_states.npz``).
        name: suite name for reports.
        control: the arm control (``sim.control``; a Hydra ``_target_`` entry in the suite config):
            :class:`sim.control.OscDeltaControl` (default) or :class:`sim.control.EeTargetControl`.
            It decides ``action_space``.

    Raises:
        ValueError: unknown task, empty or duplicated task names, bad image size, unknown render setting.
    """

    fps = 20
    state_dim = 9

    def __init__(self, tasks: Sequence[str | TaskSpec] | None = None, cameras: Sequence[str] = (AGENTVIEW, EYE_IN_HAND),
                 image_size: Sequence[int] = (64, 64), render: dict | None = None,
                 init_states_path: str | None = None, name: str = "default", control=None):
        names = list(tasks) if tasks is not None else list(DEFAULT_TASKS)
        if not names:
            raise ValueError("a suite needs at least one task")
        self.tasks: list[TaskSpec] = [_as_task(t) for t in names]
        self._by_name = {t.name: t for t in self.tasks}
        if len(self._by_name) != len(self.tasks):
            raise ValueError(f"task names must be unique, got {[t.name for t in self.tasks]}")
        self.cameras = tuple(str(c) for c in cameras)
        for c in self.cameras:
            if c not in (AGENTVIEW, EYE_IN_HAND):
                raise ValueError(f"unknown camera {c!r}; this suite has {AGENTVIEW!r} and {EYE_IN_HAND!r}")
        if len(image_size) != 2 or min(int(x) for x in image_size) < 8 or max(int(x) for x in image_size) > 1024:
            raise ValueError(f"image_size must be (Hi, Wi) between 8 and 1024 pixels, got {list(image_size)}")
        self.image_size = (int(image_size[0]), int(image_size[1]))
        self.render = RenderSettings.from_any(render)
        self.init_states_path = str(init_states_path) if init_states_path else None
        self.name = name
        self.control = OscDeltaControl() if control is None else control
        self.action_space: ActionSpace = self.control.action_space

    # ------------------------------------------------------------------ tasks
    @property
    def task_names(self) -> list[str]:
        return [t.name for t in self.tasks]

    def task(self, name: str) -> TaskSpec:
        """The ``TaskSpec`` of ``name``; ``ValueError`` for a task not in the suite."""
        if name not in self._by_name:
            raise ValueError(f"task {name!r} is not in suite {self.name!r} (tasks: {self.task_names})")
        return self._by_name[name]

    def instruction(self, name: str) -> str:
        return self.task(name).instruction

    def max_steps(self, name: str) -> int:
        """Control-step limit of an episode of ``name`` (reaching it truncates)."""
        return int(self.task(name).max_steps)

    # ------------------------------------------------------------------ init states
    def num_init_states(self, task: str, split: str) -> int:
        return _init.count(self.task(task).scene, split, self.init_states_path)

    def init_state(self, task: str, split: str, index: int) -> np.ndarray:
        """Flattened MuJoCo init state ``float64 (1 + nq + nv,)`` (a copy)."""
        return _init.get(self.task(task).scene, split, index, self.init_states_path)

    def eval_start(self, task: str, j: int) -> Start:
        """Evaluation episode ``j`` of ``task`` starts from eval init state ``j % 50``."""
        n = self.num_init_states(task, "eval")
        return Start(task_name=task, instruction=self.instruction(task), init_index=int(j) % n, split="eval")

    def train_start(self, task: str, i: int) -> Start:
        """Training episode ``i`` of ``task`` starts from train init state ``i % N_train``."""
        n = self.num_init_states(task, "train")
        return Start(task_name=task, instruction=self.instruction(task), init_index=int(i) % n, split="train")

    def object_position(self, start: Start) -> np.ndarray | None:
        """Where the start's task object (``TaskSpec.obj``) is: ``float64 (3,)``, m, in the robot base
        frame (the frame of proprio's end effector), read from the start's ``sim_state`` or, without
        one, its init state (``init_index``, ``split``). ``None`` for a start with neither. This is
        the start-state perception a deployment gets from a pose estimator on the start frame;
        ``wmrl.imagination.ProprioLiftRule``'s grasp box reads it.

        Raises:
            ValueError: a task not in the suite, or a state of the wrong size for its scene.
        """
        return self._position(start, self.task(start.task_name).obj)

    def goal_position(self, start: Start) -> np.ndarray | None:
        """Where the start's goal object (``TaskSpec.goal``, e.g. the green cube of
        ``stack_red_on_green``) is: ``float64 (3,)``, m, robot base frame, read as
        :meth:`object_position` reads the task object; ``None`` for a task without a goal or a start
        without a state. ``wmrl.imagination.ProprioLiftRule``'s place box reads it.

        Raises:
            ValueError: a task not in the suite, or a state of the wrong size for its scene.
        """
        goal = self.task(start.task_name).goal
        return None if goal is None else self._position(start, goal)

    def _position(self, start: Start, name: str) -> np.ndarray | None:
        spec = self.task(start.task_name)
        state = start.sim_state
        if state is None:
            if start.init_index is None:
                return None
            state = self.init_state(start.task_name, start.split, int(start.init_index))
        envs = self.__dict__.setdefault("_state_readers", {})
        if spec.scene not in envs:
            from sim.env import TaskEnv

            envs[spec.scene] = TaskEnv(spec.scene, cameras=(), control=self.control)
        env = envs[spec.scene]
        state = np.asarray(state, dtype=np.float64)
        if state.shape != (env.state_size,):
            raise ValueError(f"sim_state for scene {spec.scene!r} must have shape ({env.state_size},), got {state.shape}")
        env.sim.set_state_from_flattened(state)
        env.sim.forward()
        pv = env.privileged()
        return pv["base_mat"].T @ (pv["objects"][name]["pos"] - pv["base_pos"])

    # ------------------------------------------------------------------ factories
    def make_env(self, num_envs: int, auto_reset: bool = True, next_start=None, device="cpu",
                 cameras: Sequence[str] | None = None):
        """A ``SimEnv`` with this suite's observation settings (``cameras`` overrides them)."""
        from sim.env import SimEnv

        return SimEnv(num_envs, self.init_state, cameras=self.cameras if cameras is None else tuple(cameras),
                      image_size=self.image_size, render=self.render, auto_reset=auto_reset,
                      next_start=next_start, device=device, tasks=self.task, control=self.control)

    def make_expert(self, noise: float = 0.0):
        """The scripted experts as an evaluation actor (``sim.expert.ExpertActor``)."""
        from sim.expert import ExpertActor

        return ExpertActor(noise, tasks=self.task, control=self.control)

    def describe(self) -> dict:
        """JSON-able description for reports and store metadata."""
        return {"name": self.name, "tasks": {t.name: {"instruction": t.instruction, "scene": t.scene,
                                                      "max_steps": t.max_steps} for t in self.tasks},
                "cameras": list(self.cameras), "image_size": list(self.image_size),
                "render": dict(self.render.__dict__), "fps": self.fps, "control": self.control.kind,
                "action_space": self.action_space.to_dict()}


def _as_task(t) -> TaskSpec:
    """A built-in task name, a ``TaskSpec`` or the structured config Hydra makes of a ``TaskSpec``
    (a dataclass) built from a ``_target_`` entry: back to the ``TaskSpec`` object."""
    if isinstance(t, TaskSpec):
        return t
    if isinstance(t, str):
        return get_task(t)
    from omegaconf import OmegaConf

    if OmegaConf.is_config(t):
        obj = OmegaConf.to_object(t)
        if isinstance(obj, TaskSpec):
            return obj
    raise ValueError(f"a suite task is a task name or a sim.tasks.TaskSpec (a _target_ entry), got {t!r}")


def collect_seed(seed: int, task: str, i: int) -> int:
    """Seed of collected (training) episode ``i`` of ``task``: independent of everything else."""
    return int(np.random.SeedSequence([int(seed), zlib.crc32(task.encode()), int(i), 7]).generate_state(1)[0])


__all__ = ["Suite", "DEFAULT_TASKS", "TASKS", "collect_seed"]
