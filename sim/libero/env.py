"""The original LIBERO tasks as wmrl environments (run in ``.venv-libero``; see ``sim.libero``).

:class:`LiberoEnv` plays one LIBERO task at a time the way LIBERO's evaluation protocol does (as
lerobot 0.6.1's ``lerobot.envs.libero.LiberoEnv`` and LIBERO's own evaluation run it):

* the task is built from its BDDL file (``<shared>/libero/bddl_files/<suite>/<task>.bddl``) as
  hf-libero's ``OffScreenRenderEnv`` with cameras of the chosen size, 20 Hz control and hard resets;
* ``reset(init_index, seed)`` seeds the env, resets it, sets the MuJoCo state to the official init
  state ``init_index`` (``.pruned_init`` read by ``sim.libero.init_states.load_pruned_init``) and runs
  :data:`SETTLE_STEPS` = 10 no-op steps (``[0, 0, 0, 0, 0, 0, -1]``: stay, gripper open) so the
  objects settle; those steps do not count towards the step limit;
* ``step(action)`` executes one 7-D ``OSC_POSE`` delta command (robosuite 1.4 ``OSC_POSE`` with
  ``control_delta``: xyz in ``[-1, 1]`` scaled to 0.05 m, axis-angle rotation in ``[-1, 1]`` scaled
  to 0.5 rad, gripper ``-1`` open / ``+1`` close, LIBERO's convention) and reports
  ``check_success()``; the episode ends on success or after :data:`MAX_STEPS` of the suite
  (lerobot's ``TASK_SUITE_MAX_STEPS``: 280 / 280 / 300 / 520 / 400 for spatial / object / goal /
  10 / 90; OpenVLA's LIBERO evaluation uses 220 for libero_spatial).

Frames: LIBERO renders through OpenGL, whose raw frames are upside down. wmrl's convention for
LIBERO is the frame rotated by 180 degrees (both axes flipped), which is what lerobot's
``LiberoProcessorStep`` feeds LIBERO-trained policies (``lerobot/processor/env_processor.py``):
``frame = raw[::-1, ::-1]``. Cameras ``agentview`` and ``robot0_eye_in_hand``, ``uint8 (3, Hi, Wi)``.

Proprio (``D_s = 8``, float32), lerobot's LIBERO state: end-effector position (3, m, world frame),
its orientation as axis-angle (3, rad; from ``robot0_eef_quat`` in (x, y, z, w)) and the two finger
joint positions (2, m).

:class:`LiberoChunkEnv` is a ``wmrl.kernel.interfaces.ChunkEnv`` with one slot over a
:class:`LiberoEnv` (``Start.task_name`` = the LIBERO task name, ``Start.init_index`` = the official
init state); ``robot_bridge.arm.ChunkEnvArm`` drives it as a simulated robot (``wmrl robot
arm.kind=env``), so evaluating on LIBERO is deploying to it through the bridge.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sim.libero.init_states import load_pruned_init
from sim.libero.setup_env import configure

SUITES = ("libero_spatial", "libero_object", "libero_goal", "libero_10", "libero_90")
MAX_STEPS = {"libero_spatial": 280, "libero_object": 280, "libero_goal": 300, "libero_10": 520, "libero_90": 400}
SETTLE_STEPS = 10
NOOP_ACTION = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1.0)
CAMERAS = {"agentview": "agentview_image", "robot0_eye_in_hand": "robot0_eye_in_hand_image"}
STATE_DIM = 8
ACTION_DIM = 7


@dataclass(frozen=True)
class LiberoTask:
    """One task of a LIBERO suite: ``suite``, ``index`` (LIBERO's order), ``name`` (BDDL file stem),
    ``instruction``, ``bddl_file`` and ``init_file`` (``None`` for libero_90, which ships none)."""

    suite: str
    index: int
    name: str
    instruction: str
    bddl_file: Path
    init_file: Path | None


def suite_tasks(suite: str) -> list[LiberoTask]:
    """The tasks of ``suite`` in LIBERO's order (``libero.libero.benchmark``).

    Raises:
        ValueError: an unknown suite (names the five).
    """
    if suite not in SUITES:
        raise ValueError(f"unknown LIBERO suite {suite!r}; one of {', '.join(SUITES)}")
    configure()
    from libero.libero import benchmark, get_libero_path

    bddl, init = Path(get_libero_path("bddl_files")), Path(get_libero_path("init_states"))
    s = benchmark.get_benchmark_dict()[suite]()
    out = []
    for i in range(s.n_tasks):
        t = s.get_task(i)
        f = init / t.problem_folder / t.init_states_file
        out.append(LiberoTask(suite, i, t.name, t.language, bddl / t.problem_folder / t.bddl_file,
                              f if f.is_file() else None))
    return out


def libero_action_space():
    """LIBERO's action space: 7-D ``OSC_POSE`` delta of robosuite 1.4 in the world frame (xyz, axis-angle
    rotation, gripper -1 open / +1 close), each in ``[-1, 1]``."""
    from wmrl.kernel.types import ActionSpace

    return ActionSpace(dim=ACTION_DIM, controller="OSC_POSE", mode="delta", frame="world", rotation="axis_angle")


def quat_xyzw_to_axis_angle(q: np.ndarray) -> np.ndarray:
    """Axis-angle ``(3,)`` (rad) of a unit quaternion ``(x, y, z, w)``; zero for the identity."""
    q = np.asarray(q, np.float64)
    w = min(1.0, max(-1.0, float(q[3])))
    s = math.sqrt(max(0.0, 1.0 - w * w))
    if s <= 1e-10:
        return np.zeros(3)
    return q[:3] / s * (2.0 * math.acos(w))


class LiberoEnv:
    """One LIBERO task at a time (see the module docstring for the protocol and conventions).

    Args:
        suite: one of :data:`SUITES`.
        image_size: ``(Hi, Wi)`` of both cameras (px).
        max_steps: step limit (``None``: the suite's, :data:`MAX_STEPS`).
        settle_steps: no-op steps after each reset.
        control_freq: Hz (LIBERO: 20).
        cameras: ``True`` renders both cameras at every step (robosuite's camera observables);
            ``"on_demand"`` renders them only when :meth:`frames` (or :meth:`observation` with
            ``images=True``) is called, through the same ``sim.render`` call robosuite's camera
            sensor makes, so the frames are pixel-identical (``scripts/check_libero.py
            --on-demand``); ``False``: privileged state only, no frames. Rendering is 85 % of a
            64 px step here (6.3 steps/s with both cameras, 41 without), so a client that reads
            frames once per action chunk runs several times faster.

    Raises:
        ValueError: ``cameras`` not one of ``True``, ``False``, ``"on_demand"``.
    """

    def __init__(self, suite: str, image_size: Sequence[int] = (128, 128), max_steps: int | None = None,
                 settle_steps: int = SETTLE_STEPS, control_freq: int = 20, cameras: bool = True):
        if cameras not in (True, False, "on_demand"):
            raise ValueError(f"cameras must be true, false or 'on_demand', got {cameras!r}")
        self.on_demand = cameras == "on_demand"
        self.cameras = bool(cameras)
        self._frames_at: tuple[int, int] | None = None  # frame_key (reset count, step) of the cached frames
        self._frames: dict = {}
        self._resets = 0
        self.tasks = suite_tasks(suite)
        self.suite = suite
        self.by_name = {t.name: t for t in self.tasks}
        self.image_size = (int(image_size[0]), int(image_size[1]))
        self.max_steps = int(max_steps if max_steps is not None else MAX_STEPS[suite])
        self.settle_steps = int(settle_steps)
        self.control_freq = int(control_freq)
        self.task: LiberoTask | None = None
        self._env = None
        self._init_states: np.ndarray | None = None
        self.steps = 0
        self.build_s = 0.0

    def task_by(self, task: str | int) -> LiberoTask:
        """A task by name or index (raises ``KeyError`` naming the suite's tasks)."""
        if isinstance(task, (int, np.integer)):
            return self.tasks[int(task)]
        if task not in self.by_name:
            raise KeyError(f"no task {task!r} in {self.suite}; its tasks: {sorted(self.by_name)}")
        return self.by_name[task]

    def load(self, task: str | int) -> LiberoTask:
        """Build the task's env (a no-op when it is the current one)."""
        t = self.task_by(task)
        if self.task == t and self._env is not None:
            return t
        self.close()
        from libero.libero.envs import OffScreenRenderEnv

        t0 = time.monotonic()
        self._env = OffScreenRenderEnv(bddl_file_name=str(t.bddl_file), camera_heights=self.image_size[0],
                                       camera_widths=self.image_size[1], control_freq=self.control_freq,
                                       hard_reset=True, use_camera_obs=self.cameras)
        self._env.reset()
        self.build_s = time.monotonic() - t0
        self._init_states = load_pruned_init(t.init_file) if t.init_file is not None else None
        self.task = t
        return t

    @property
    def num_init_states(self) -> int:
        return 0 if self._init_states is None else len(self._init_states)

    def init_state(self, index: int) -> np.ndarray:
        """The official init state ``float64 (1 + nq + nv,)`` of the current task."""
        if self._init_states is None:
            raise ValueError(f"{self.suite} task {self.task.name if self.task else None!r} has no official init states")
        if not 0 <= index < len(self._init_states):
            raise IndexError(f"init index {index} out of range 0..{len(self._init_states) - 1}")
        return self._init_states[index]

    def reset(self, init_index: int | None, seed: int | None = 0) -> dict:
        """Reset the current task to init state ``init_index`` and settle; returns :meth:`observation`.
        ``init_index=None``, or a task without official init states (libero_90): the objects are
        placed by the env's own sampler (LIBERO's placement regions), seeded by ``seed``; this is how
        demonstrations are collected away from the official init states that evaluation uses."""
        if self._env is None:
            raise RuntimeError("LiberoEnv.reset before load(task)")
        self._env.seed(seed)
        if self._init_states is None or init_index is None:  # the env's own placement (seeded)
            raw = self._env.reset()
            if self.on_demand:
                self._install_frame_sensors()
        else:
            state = self.init_state(init_index)
            self._env.reset()
            if self.on_demand:
                self._install_frame_sensors()
            raw = self._env.set_init_state(state)
        for _ in range(self.settle_steps):
            raw, _, _, _ = self._env.step(list(NOOP_ACTION))
        for robot in self._env.robots:
            robot.controller.use_delta = True
        self.steps = 0
        self._resets += 1
        self._raw = raw
        return self.observation()

    def step(self, action: np.ndarray, images: bool = True) -> tuple[dict, float, bool, bool]:
        """One control step: ``(observation, reward, success, done)``; ``done`` is success or the
        step limit (or robosuite's own horizon); ``images`` as in :meth:`observation`."""
        a = np.asarray(action, np.float64).reshape(-1)
        if a.shape != (ACTION_DIM,):
            raise ValueError(f"LIBERO takes 7-D OSC_POSE delta actions, got shape {a.shape}")
        raw, reward, done, _ = self._env.step(a)
        self._raw = raw
        self.steps += 1
        success = bool(self._env.check_success())
        return (self.observation(images), float(reward), success,
                bool(done or success or self.steps >= self.max_steps))

    @property
    def frame_key(self) -> tuple[int, int]:
        """``(reset count, step)``: which state the current frames belong to."""
        return (self._resets, self.steps)

    def raw_frames(self) -> dict:
        """``{camera: uint8 (Hi, Wi, 3)}`` of the current state as LIBERO renders it (upside down);
        rendered now (once per state) with ``cameras="on_demand"``; ``{}`` with ``cameras=False``."""
        if not self.cameras:
            return {}
        if not self.on_demand:
            return {c: self._raw[k] for c, k in CAMERAS.items()}
        key = self.frame_key
        if self._frames_at != key:
            self._frames = self._render_kept()
            self._frames_at = key
        return self._frames

    def _install_frame_sensors(self) -> None:
        """``cameras="on_demand"``: robosuite's camera sensors keep their sampling (robosuite samples
        its observables at a physics substep chosen by each observable's own clock,
        ``robosuite.utils.observables.Observable.update``: substep 24 of 25 at the first step
        here, drifting with float rounding), but instead of rendering they keep a copy of the
        ``MjData`` they would have rendered; :meth:`_render_kept` renders that copy when frames
        are read. The live simulation is never touched, so the physics is the same whether
        frames are read or not, and the pixels are the ones robosuite would have given
        (``scripts/check_libero.py --on-demand``). A hard reset rebuilds the observables, so this
        runs after each reset."""
        import copy

        from robosuite.utils.observables import sensor

        env = self._env.env
        h, w = self.image_size
        blank = np.zeros((h, w, 3), np.uint8)

        @sensor(modality="image")
        def keep_data(obs_cache):
            self._kept = copy.copy(env.sim.data._data)
            return blank

        for c in CAMERAS:
            env.modify_observable(f"{c}_image", "sensor", keep_data)
        self._kept = copy.copy(env.sim.data._data)  # what the reset's own (forced) observation rendered

    def _render_kept(self) -> dict:
        h, w = self.image_size
        sim = self._env.env.sim
        ctx = sim._render_context_offscreen
        live = ctx.data
        ctx.data = _DataView(self._kept)
        try:
            return {c: sim.render(camera_name=c, width=w, height=h, depth=False) for c in CAMERAS}
        finally:
            ctx.data = live

    def frames(self) -> dict:
        """``{camera: uint8 (3, Hi, Wi)}`` rotated 180 deg (wmrl's LIBERO convention) of the current state."""
        return {c: np.ascontiguousarray(v[::-1, ::-1].transpose(2, 0, 1)) for c, v in self.raw_frames().items()}

    def observation(self, images: bool = True) -> dict:
        """``{"images": {camera: uint8 (3, Hi, Wi)} rotated 180 deg, "proprio": float32 (8,),
        "raw": {camera: uint8 (Hi, Wi, 3)} as rendered}``; ``images=False`` leaves both frame
        dicts empty (nothing is rendered with ``cameras="on_demand"``)."""
        raw = self._raw
        proprio = np.concatenate([raw["robot0_eef_pos"], quat_xyzw_to_axis_angle(raw["robot0_eef_quat"]),
                                  raw["robot0_gripper_qpos"]]).astype(np.float32)
        if not images:
            return {"images": {}, "proprio": proprio, "raw": {}}
        return {"images": self.frames(), "proprio": proprio, "raw": self.raw_frames()}

    @property
    def raw(self) -> dict:
        """The last raw robosuite observation (privileged: every object's ``<name>_pos`` / ``_quat``,
        world frame, m; quaternions (x, y, z, w))."""
        return self._raw

    def objects_of_interest(self) -> list[str]:
        """The task's objects of interest from its BDDL file (libero_object: the object, the basket)."""
        return list(self._env.env.obj_of_interest)

    def sim_state(self) -> np.ndarray:
        """Flattened MuJoCo state ``float64 (1 + nq + nv,)`` now."""
        return np.asarray(self._env.get_sim_state(), np.float64).copy()

    def close(self) -> None:
        if self._env is not None:
            try:
                self._env.close()
            finally:
                self._env = None
                self.task = None


class _DataView:
    """What robosuite's render context reads of its ``MjData`` wrapper (``._data``)."""

    def __init__(self, data):
        self._data = data


class LazyFrames(Mapping):
    """``camera -> uint8 (1, 3, Hi, Wi)`` tensors of one state of a :class:`LiberoEnv` built with
    ``cameras="on_demand"``, rendered when first read (both cameras at once, then cached).

    Raises:
        RuntimeError: reading it after the env stepped or reset (the frames of that state are gone).
    """

    def __init__(self, env: LiberoEnv):
        self._env, self._key, self._frames = env, env.frame_key, None

    def _load(self) -> dict:
        if self._frames is None:
            if self._env.frame_key != self._key:
                raise RuntimeError(f"stale LIBERO observation: its frames were not read before the env moved on "
                                   f"(state {self._key}, env now at {self._env.frame_key})")
            import torch

            self._frames = {c: torch.from_numpy(v)[None] for c, v in self._env.frames().items()}
        return self._frames

    def __getitem__(self, camera: str):
        if camera not in CAMERAS:
            raise KeyError(camera)
        return self._load()[camera]

    def __iter__(self):
        return iter(CAMERAS)

    def __len__(self) -> int:
        return len(CAMERAS)


class LiberoChunkEnv:
    """``ChunkEnv`` with one slot over :class:`LiberoEnv` (no auto-reset).

    ``reset([Start])``: ``Start.task_name`` a task of ``suite`` (name), ``Start.init_index`` its
    official init state. ``step(actions float32 (1, H, 7))`` executes the chunk until success or
    the step limit (the remaining actions are not executed); ``StepResult.success`` is LIBERO's
    ``check_success()`` after the executed steps, ``reward`` their summed sparse reward.
    Observations: ``Obs`` with ``images[cam] uint8 (1, 3, Hi, Wi)`` (180-degree convention),
    ``proprio float32 (1, 8)``, the task's instruction. ``preload``: a task (name or index) to
    build at construction; ``seed``: the env seed of every reset (LIBERO's ``env.seed``);
    ``frames``: ``"every_step"`` renders both cameras at every control step (robosuite's camera
    observables), ``"on_demand"`` only for observations whose ``images`` are read
    (:class:`LazyFrames`; the same pixels), which is what a client that reads frames once per
    chunk wants (``frames_on_demand`` declares it).

    Raises:
        ValueError: ``num_envs`` other than 1, an unknown ``frames``.
    """

    def __init__(self, suite: str, image_size: Sequence[int] = (128, 128), max_steps: int | None = None,
                 seed: int = 0, num_envs: int = 1, preload: str | int | None = None, frames: str = "every_step"):
        if num_envs != 1:
            raise ValueError(f"LiberoChunkEnv has one slot; run several workers for more, got num_envs={num_envs}")
        if frames not in ("every_step", "on_demand"):
            raise ValueError(f"frames must be 'every_step' or 'on_demand', got {frames!r}")
        self.frames_on_demand = frames == "on_demand"
        self.env = LiberoEnv(suite, image_size=image_size, max_steps=max_steps,
                             cameras="on_demand" if self.frames_on_demand else True)
        if preload is not None:  # build the first task now (3-12 s), not while a policy server waits
            self.env.load(preload)
        self.num_envs = 1
        self.action_dim = ACTION_DIM
        self.state_dim = STATE_DIM
        self.action_space = libero_action_space()
        self.cameras = list(CAMERAS)
        self.image_size = self.env.image_size
        self.seed = int(seed)
        self._obs = None

    def _to_obs(self, o: dict):
        import torch

        from wmrl.kernel.types import Obs

        images = (LazyFrames(self.env) if self.frames_on_demand
                  else {c: torch.from_numpy(v)[None] for c, v in o["images"].items()})
        return Obs(images, torch.from_numpy(o["proprio"])[None], [self.env.task.instruction])

    def reset(self, starts):
        if len(starts) != 1:
            raise ValueError(f"LiberoChunkEnv.reset takes one Start, got {len(starts)}")
        s = starts[0]
        if s.init_index is None:
            raise ValueError("a LIBERO Start needs init_index (the official init state)")
        self.env.load(s.task_name)
        self._obs = self._to_obs(self.env.reset(int(s.init_index), seed=self.seed))
        return self._obs

    def reset_slots(self, slots, starts):
        if list(slots) != [0] or len(starts) != 1:
            raise ValueError(f"LiberoChunkEnv has one slot 0; got slots {list(slots)} with {len(starts)} starts")
        return self.reset(list(starts))

    def step(self, actions):
        import torch

        from wmrl.kernel.types import StepResult

        a = torch.as_tensor(actions, dtype=torch.float32)
        if a.ndim != 3 or a.shape[0] != 1 or a.shape[2] != ACTION_DIM:
            raise ValueError(f"actions must be (1, H, {ACTION_DIM}), got {tuple(a.shape)}")
        reward, success, done, n = 0.0, False, False, 0
        for act in a[0].numpy():
            o, r, success, done = self.env.step(act, images=not self.frames_on_demand)
            reward += r
            n += 1
            if done:
                break
        self._obs = self._to_obs(o)
        truncated = done and not success
        return StepResult(self._obs, torch.tensor([reward], dtype=torch.float32), torch.tensor([success]),
                          torch.tensor([truncated]), torch.tensor([success]), torch.tensor([n], dtype=torch.int64))

    def sim_state(self, slot: int = 0) -> np.ndarray:
        return self.env.sim_state()

    def close(self) -> None:
        self.env.close()


def libero_starts(suite: str, tasks: Sequence[str | int] | None = None, init_indices: Sequence[int] | None = None,
                  pairs: Sequence[Sequence] | None = None):
    """``i -> Start``: episode ``i`` plays task ``i % T`` on init state ``init_indices[i // T]``
    (default: all tasks of ``suite``, init states ``0..49``), or, with ``pairs``, the ``i``-th
    ``(task, init_index)`` pair (tasks by name or index in LIBERO's order).

    Raises:
        KeyError / IndexError: a task not in the suite.
    """
    from wmrl.kernel.types import Start

    all_tasks = suite_tasks(suite)
    names = {t.name: t for t in all_tasks}

    def task(n) -> LiberoTask:
        if isinstance(n, str) and not n.isdigit():
            if n not in names:
                raise KeyError(f"no task {n!r} in {suite}; its tasks: {sorted(names)}")
            return names[n]
        return all_tasks[int(n)]

    if pairs is not None:
        chosen_pairs = [(task(t), int(k)) for t, k in pairs]

        def start_pair(i: int) -> Start:
            t, k = chosen_pairs[i % len(chosen_pairs)]
            return Start(task_name=t.name, instruction=t.instruction, init_index=k)

        return start_pair
    chosen = [task(n) for n in tasks] if tasks else all_tasks
    inits = list(init_indices) if init_indices is not None else list(range(50))

    def start(i: int) -> Start:
        t = chosen[i % len(chosen)]
        return Start(task_name=t.name, instruction=t.instruction, init_index=int(inits[(i // len(chosen)) % len(inits)]))

    return start
