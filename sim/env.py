"""Single-task environment (:class:`TaskEnv`) and the batched chunk environment (:class:`SimEnv`).

``SimEnv`` implements ``wmrl.kernel.interfaces.ChunkEnv`` over ``B`` robosuite scenes stepped in process:
* ``step(actions)`` takes ``float32 (B, H, D_a)`` actions in the arm control's action space
  (``sim.control``: OSC_POSE delta by default, or absolute end-effector targets; gripper -1 open /
  +1 close, see ``wmrl.kernel.types``); ``info["clipped_steps"]`` counts, per slot, the executed
  steps whose action the control clipped. When a slot succeeds or fails (terminates) or reaches its step limit
  (truncates) at inner step ``h``, that slot stops there: actions ``h+1..H-1`` are not executed and
  the reward of the executed steps is kept.
* with ``auto_reset=True`` only finished slots are reset (to ``next_start(slot)``, by default the
  slot's last ``Start``) and ``terminated | truncated`` marks the boundary; ``info["final_obs"]``
  holds the observation before the reset. With ``auto_reset=False`` a finished slot stays finished
  (later chunks execute nothing for it, ``info["finished"]`` says so) until ``reset_slots``.

Reset to a stored init state is exact: the same ``Start`` always gives bitwise the same MuJoCo
state and the same future under the same actions, whatever the slot did before.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from sim import _backend
from sim.control import OscDeltaControl
from sim.render import RenderSettings, SceneRenderer
from sim.scenes import make_scene
from sim.tasks import TaskSpec, get_task
from wmrl.kernel.types import AGENTVIEW, EYE_IN_HAND, Obs, Start, StepResult

STATE_DIM = 9

_RENDERERS: dict = {}


def _renderer(scene: str, model, settings: RenderSettings, max_size: tuple[int, int]) -> SceneRenderer:
    """One ``SceneRenderer`` per (scene, settings) in the process, shared by every env of that scene."""
    key = (scene, settings)
    r = _RENDERERS.get(key)
    if r is None or r.model.vis.global_.offheight < max_size[0] or r.model.vis.global_.offwidth < max_size[1]:
        size = (max(max_size[0], 256), max(max_size[1], 256))
        r = SceneRenderer(model, settings, size)
        _RENDERERS[key] = r
    return r


def quat_wxyz_from_mat(m: np.ndarray) -> np.ndarray:
    mj = _backend.mujoco()
    q = np.empty(4)
    mj.mju_mat2Quat(q, np.ascontiguousarray(m, dtype=np.float64).reshape(9))
    return q


class TaskEnv:
    """One Panda scene running one task at a time (no batching, numpy in and out).

    Args:
        scene: scene name (``sim.scenes.SCENES``).
        cameras: camera names rendered by :meth:`observe` (may be empty).
        image_size: ``(Hi, Wi)`` of observation images.
        render: :class:`RenderSettings` (or a dict of them).
        control: the arm control (``sim.control``; default :class:`sim.control.OscDeltaControl`).
    """

    def __init__(self, scene: str, cameras: Sequence[str] = (AGENTVIEW, EYE_IN_HAND),
                 image_size: tuple[int, int] = (64, 64), render: RenderSettings | dict | None = None,
                 control=None):
        self.scene = scene
        self.control = OscDeltaControl() if control is None else control
        self.action_dim = int(self.control.action_space.dim)
        self.clipped_steps = 0
        self.cameras = tuple(cameras)
        self.image_size = (int(image_size[0]), int(image_size[1]))
        self.render_settings = RenderSettings.from_any(render)
        self.rs = make_scene(scene, controller_configs=self.control.controller_config())
        self.sim = self.rs.sim
        self.model = self.sim.model._model
        self.data = self.sim.data._data
        robot = self.rs.robots[0]
        self._robot = robot
        self._eef_site = robot.eef_site_id["right"]
        self._base_body = self.sim.model.body_name2id(robot.robot_model.root_body)
        self._grip_qpos = np.array(robot._ref_gripper_joint_pos_indexes["right"])
        self._gripper = robot.gripper["right"]
        self.task: TaskSpec | None = None
        self.elapsed = 0
        self.state_size = 1 + self.model.nq + self.model.nv
        self._contact_geoms = None  # (gripper geom ids, {object: geom ids}), on first use

    # ---------------------------------------------------------------- reset / step
    def reset(self, task: TaskSpec | str, sim_state: np.ndarray) -> None:
        """Start ``task`` from the flattened MuJoCo state ``float64 (1 + nq + nv,)``.

        Raises:
            ValueError: the task belongs to another scene, or the state has the wrong size.
        """
        task = get_task(task) if isinstance(task, str) else task
        if task.scene != self.scene:
            raise ValueError(f"task {task.name!r} runs in scene {task.scene!r}, this env is {self.scene!r}")
        state = np.asarray(sim_state, dtype=np.float64)
        if state.shape != (self.state_size,):
            raise ValueError(f"sim_state for scene {self.scene!r} must have shape ({self.state_size},), "
                             f"got {state.shape}")
        self.rs.reset()  # mj_resetData (clears warm starts), robot + controller reset
        self.sim.set_state_from_flattened(state)
        self.sim.forward()
        self.task = task
        self.elapsed = 0
        self.clipped_steps = 0

    def step(self, action: np.ndarray) -> tuple[float, bool, bool, bool]:
        """Execute one control step. Returns ``(reward, success, terminated, truncated)``:
        reward 1 on success else 0; terminated on success or failure; truncated at the step limit."""
        if self.task is None:
            raise RuntimeError("TaskEnv.step before reset")
        a = np.asarray(action, dtype=np.float64)
        if a.shape != (self.action_dim,):
            raise ValueError(f"TaskEnv.step expects an action ({self.action_dim},) of the {self.control.kind} "
                             f"control, got shape {a.shape}")
        cmd, clipped = self.control.to_command(a, *self.eef_pose())
        self.clipped_steps += int(clipped)
        self.rs.step(cmd)
        self.elapsed += 1
        s = self.privileged()
        success = self.task.success(s)
        terminated = success or self.task.failed(s)
        truncated = (not terminated) and self.elapsed >= self.task.max_steps
        return (1.0 if success else 0.0), success, terminated, truncated

    # ---------------------------------------------------------------- observations
    def sim_state(self) -> np.ndarray:
        """Flattened MuJoCo state ``float64 (1 + nq + nv,)`` (time, qpos, qvel)."""
        return np.asarray(self.sim.get_state().flatten(), dtype=np.float64)

    def eef_pose(self) -> tuple[np.ndarray, np.ndarray]:
        """End-effector (grip site) position ``float64 (3,)`` (m) and rotation ``(3, 3)`` in the robot base frame."""
        d = self.data
        rb = d.xmat[self._base_body].reshape(3, 3)
        pb = d.xpos[self._base_body]
        return rb.T @ (d.site_xpos[self._eef_site] - pb), rb.T @ d.site_xmat[self._eef_site].reshape(3, 3)

    def proprio(self) -> np.ndarray:
        """``float32 (9,)``: eef position in the robot base frame (m), eef ``quat_wxyz`` in the base
        frame, the two gripper finger joint positions (m)."""
        d = self.data
        pos, rot = self.eef_pose()
        q = quat_wxyz_from_mat(rot)
        if q[0] < 0:
            q = -q
        return np.concatenate([pos, q, d.qpos[self._grip_qpos]]).astype(np.float32)

    def render(self, camera: str, size: tuple[int, int] | None = None) -> np.ndarray:
        """Upright ``uint8 (Hi, Wi, 3)`` frame of ``camera``."""
        size = self.image_size if size is None else (int(size[0]), int(size[1]))
        r = _renderer(self.scene, self.model, self.render_settings, size)
        return r.render(self.data, camera, size)

    def observe(self) -> dict:
        """``{"images": {cam: uint8 (3, Hi, Wi)}, "proprio": float32 (9,)}``."""
        return {"images": {c: np.ascontiguousarray(self.render(c).transpose(2, 0, 1)) for c in self.cameras},
                "proprio": self.proprio()}

    def gripper_contact_forces(self) -> dict[str, float]:
        """Normal contact force (N, >= 0) that the gripper's collision geoms (hand, fingers, pads)
        and each object of the scene, or the table, press on each other at this instant: the sum over
        MuJoCo's active contacts of the normal component of ``mujoco.mj_contactForce``. Keys: the
        scene's object names (``"red"``, ``"green"``, ``"target"``, ...) and ``"table"``; ``0.0``
        where nothing touches. Read-only (no physics step)."""
        import mujoco

        if self._contact_geoms is None:
            gid = lambda n: mujoco.mj_name2id(self.model, mujoco.mjtObj.mjOBJ_GEOM, n)
            self._contact_geoms = ({gid(n) for n in self._gripper.contact_geoms},
                                   {k: {gid(n) for n in o.contact_geoms} for k, o in self.rs.objects.items()}
                                   | {"table": {gid("table_collision")} - {-1}})
        grip, others = self._contact_geoms
        out = {k: 0.0 for k in others}
        f6 = np.zeros(6)
        for c in range(self.data.ncon):
            con = self.data.contact[c]
            g1, g2 = int(con.geom1), int(con.geom2)
            if (g1 in grip) == (g2 in grip):
                continue
            other = g2 if g1 in grip else g1
            for k, ids in others.items():
                if other in ids:
                    mujoco.mj_contactForce(self.model, self.data, c, f6)
                    out[k] += abs(float(f6[0]))
                    break
        return out

    def privileged(self) -> dict:
        """Privileged world-frame state for success predicates and scripted experts:
        ``eef_pos (3,)``, ``eef_mat (3, 3)``, ``gripper_qpos (2,)``, ``objects[name] = {pos, quat_wxyz}``,
        ``grasped[name]`` (both finger pads touch it), ``contact["red_green"]``, the robot base pose
        ``base_pos (3,)``, ``base_mat (3, 3)``."""
        d = self.data
        objs = {}
        for k, bid in self.rs.body_ids.items():
            objs[k] = {"pos": d.xpos[bid].copy(), "quat_wxyz": d.xquat[bid].copy()}
        grasped = {k: bool(self.rs._check_grasp(self._gripper, o)) for k, o in self.rs.objects.items() if k != "target"}
        contact = {}
        if "green" in self.rs.objects:
            contact["red_green"] = bool(self.rs.check_contact(self.rs.objects["red"], self.rs.objects["green"]))
        return {"eef_pos": d.site_xpos[self._eef_site].copy(), "eef_mat": d.site_xmat[self._eef_site].reshape(3, 3).copy(),
                "gripper_qpos": d.qpos[self._grip_qpos].copy(), "objects": objs, "grasped": grasped,
                "contact": contact, "elapsed": self.elapsed,
                "base_pos": d.xpos[self._base_body].copy(), "base_mat": d.xmat[self._base_body].reshape(3, 3).copy()}


class SimEnv:
    """Batched ``ChunkEnv`` over ``num_envs`` Panda scenes (sequential, in process).

    Args:
        num_envs: ``B``.
        init_states: callable ``(task_name, split, index) -> float64 state`` resolving a ``Start``
            without ``sim_state`` (``Suite.init_state``).
        cameras, image_size, render: observation cameras, ``(Hi, Wi)`` and :class:`RenderSettings`.
        auto_reset: reset finished slots automatically (see module docstring).
        next_start: ``slot -> Start`` used by auto-reset; default: the slot's last ``Start``.
        device: where observation tensors are put.
        tasks: ``task_name -> TaskSpec`` resolving ``Start.task_name`` (``Suite.task``, which knows
            the suite's own task classes); default: the built-in ``sim.tasks.get_task``.
        control: the arm control of every slot (``sim.control``; default OSC_POSE delta); it sets
            ``action_dim`` and ``action_space``.

    Obs: images ``uint8 (B, 3, Hi, Wi)`` per camera, proprio ``float32 (B, 9)``, task = instructions.
    """

    def __init__(self, num_envs: int, init_states: Callable[[str, str, int], np.ndarray],
                 cameras: Sequence[str] = (AGENTVIEW, EYE_IN_HAND), image_size: tuple[int, int] = (64, 64),
                 render: RenderSettings | dict | None = None, auto_reset: bool = True,
                 next_start: Callable[[int], Start] | None = None, device: str | torch.device = "cpu",
                 tasks: Callable[[str], TaskSpec] | None = None, control=None):
        if int(num_envs) < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        self.num_envs = int(num_envs)
        self._init_states = init_states
        self.cameras = tuple(cameras)
        self.image_size = (int(image_size[0]), int(image_size[1]))
        self.render_settings = RenderSettings.from_any(render)
        self.auto_reset = bool(auto_reset)
        self.next_start = next_start
        self.device = torch.device(device)
        self._tasks = get_task if tasks is None else tasks
        self.control = OscDeltaControl() if control is None else control
        self.action_space = self.control.action_space
        self.action_dim = int(self.action_space.dim)
        self._envs: list[dict[str, TaskEnv]] = [dict() for _ in range(self.num_envs)]
        self._active: list[TaskEnv | None] = [None] * self.num_envs
        self._starts: list[Start | None] = [None] * self.num_envs
        self._instr: list[str] = [""] * self.num_envs
        self._finished = np.zeros(self.num_envs, dtype=bool)
        self._obs: list[dict | None] = [None] * self.num_envs
        self._record: list[tuple[str, tuple[int, int]] | None] = [None] * self.num_envs
        self._frames: list[list[np.ndarray]] = [[] for _ in range(self.num_envs)]

    # ---------------------------------------------------------------- helpers
    def _env(self, slot: int, scene: str) -> TaskEnv:
        env = self._envs[slot].get(scene)
        if env is None:
            env = TaskEnv(scene, self.cameras, self.image_size, self.render_settings, self.control)
            self._envs[slot][scene] = env
        return env

    def task_env(self, slot: int) -> TaskEnv:
        """The :class:`TaskEnv` running in ``slot`` (privileged access for scripted experts)."""
        env = self._active[slot]
        if env is None:
            raise RuntimeError(f"slot {slot} has not been reset")
        return env

    def privileged(self, slot: int) -> dict:
        return self.task_env(slot).privileged()

    def sim_state(self, slot: int) -> np.ndarray:
        return self.task_env(slot).sim_state()

    def elapsed(self, slot: int) -> int:
        return self.task_env(slot).elapsed

    def _reset_slot(self, slot: int, start: Start) -> None:
        task = self._tasks(start.task_name)
        if start.sim_state is not None:
            state = np.asarray(start.sim_state, dtype=np.float64)
        elif start.init_index is not None:
            state = self._init_states(task.name, start.split, int(start.init_index))
        else:
            raise ValueError(f"Start for task {task.name!r} needs sim_state or init_index")
        env = self._env(slot, task.scene)
        env.reset(task, state)
        self._active[slot] = env
        self._starts[slot] = start
        self._instr[slot] = start.instruction or task.instruction
        self._finished[slot] = False
        self._obs[slot] = env.observe()
        self._frames[slot] = []
        if self._record[slot] is not None:
            cam, size = self._record[slot]
            self._frames[slot].append(env.render(cam, size))

    def _batch_obs(self, per_slot: list[dict]) -> Obs:
        images = {c: torch.from_numpy(np.stack([o["images"][c] for o in per_slot])).to(self.device)
                  for c in self.cameras}
        proprio = torch.from_numpy(np.stack([o["proprio"] for o in per_slot])).to(self.device)
        return Obs(images=images, proprio=proprio, task=list(self._instr))

    # ---------------------------------------------------------------- ChunkEnv
    def reset(self, starts: list[Start]) -> Obs:
        """Reset every slot to ``starts[i]``. Raises ``ValueError`` when ``len(starts) != B``."""
        if len(starts) != self.num_envs:
            raise ValueError(f"reset needs {self.num_envs} starts (one per slot), got {len(starts)}")
        for i, s in enumerate(starts):
            self._reset_slot(i, s)
        return self._batch_obs(self._obs)

    def reset_slots(self, slots: Sequence[int], starts: Sequence[Start]) -> Obs:
        """Reset only ``slots`` (to ``starts``); returns the whole batch's current observation."""
        if len(slots) != len(starts):
            raise ValueError(f"reset_slots got {len(slots)} slots and {len(starts)} starts")
        for i, s in zip(slots, starts):
            if not 0 <= int(i) < self.num_envs:
                raise ValueError(f"slot {i} out of range for num_envs={self.num_envs}")
            self._reset_slot(int(i), s)
        return self._batch_obs(self._obs)

    def record(self, slot: int, camera: str | None, size: tuple[int, int] | None = None) -> None:
        """Record every control step's frame of ``camera`` for ``slot`` from its next reset
        (``None`` stops). Frames come back in ``step(...).info["frames"][slot]`` (list of
        ``uint8 (Hi, Wi, 3)``) and from :meth:`take_frames`."""
        self._record[slot] = None if camera is None else (camera, tuple(size or self.image_size))

    def take_frames(self, slot: int) -> list[np.ndarray]:
        """The frames recorded for ``slot`` since its last reset (emptied on return)."""
        f, self._frames[slot] = self._frames[slot], []
        return f

    def step(self, actions: torch.Tensor | np.ndarray) -> StepResult:
        """Execute one action chunk per slot (see module docstring).

        Args:
            actions: ``float32 (B, H, D_a)``, finite.

        Raises:
            ValueError: wrong shape or non-finite values.
            RuntimeError: a slot was never reset.
        """
        a = actions.detach().cpu().numpy() if isinstance(actions, torch.Tensor) else np.asarray(actions)
        if a.ndim != 3 or a.shape[0] != self.num_envs or a.shape[2] != self.action_dim or a.shape[1] < 1:
            raise ValueError(f"SimEnv.step expects actions (B={self.num_envs}, H>=1, D_a={self.action_dim}), "
                             f"got shape {tuple(a.shape)}")
        if not np.isfinite(a).all():
            raise ValueError("SimEnv.step got non-finite actions (NaN or inf)")
        if any(e is None for e in self._active):
            raise RuntimeError("SimEnv.step before reset: call reset(starts) first")
        B, H = a.shape[:2]
        reward = np.zeros(B, np.float32)
        term = np.zeros(B, bool)
        trunc = np.zeros(B, bool)
        succ = np.zeros(B, bool)
        nexec = np.zeros(B, np.int64)
        clipped = np.zeros(B, np.int64)
        was_finished = self._finished.copy()
        lengths = np.zeros(B, np.int64)
        for b in range(B):
            env = self._active[b]
            if self._finished[b]:
                lengths[b] = env.elapsed
                continue
            clipped0 = env.clipped_steps
            for h in range(H):
                r, s, te, tr = env.step(a[b, h])
                reward[b] += r
                nexec[b] += 1
                if self._record[b] is not None:
                    cam, size = self._record[b]
                    self._frames[b].append(env.render(cam, size))
                if te or tr:
                    succ[b], term[b], trunc[b] = s, te, tr
                    break
            else:
                succ[b] = env.task.success(env.privileged())
            lengths[b] = env.elapsed
            clipped[b] = env.clipped_steps - clipped0
            self._obs[b] = env.observe()
        done = term | trunc
        self._finished |= done
        final_obs = self._batch_obs(self._obs)
        info = {"final_obs": final_obs, "finished": torch.from_numpy(was_finished),
                "episode_length": torch.from_numpy(lengths),
                "task_name": [e.task.name for e in self._active], "clipped_steps": torch.from_numpy(clipped)}
        if any(r is not None for r in self._record):
            info["frames"] = {b: list(self._frames[b]) for b in range(B) if self._record[b] is not None}
        if self.auto_reset and done.any():
            for b in np.flatnonzero(done):
                start = self.next_start(int(b)) if self.next_start is not None else self._starts[b]
                self._reset_slot(int(b), start)
            obs = self._batch_obs(self._obs)
        else:
            obs = final_obs
        t = torch.from_numpy
        return StepResult(obs=obs, reward=t(reward), terminated=t(term), truncated=t(trunc), success=t(succ),
                          steps_executed=t(nexec), info=info)
