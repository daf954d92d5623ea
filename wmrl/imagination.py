"""``ImaginationEnv``: a ``ChunkEnv`` whose dynamics are a world model and whose reward and
termination come from a progress critic (DIAMOND's ``WorldModelEnv`` idea, with keyframe-initialised
rollouts as in WoVR / VLA-MBPO: every rollout starts from real frames of a stored episode, at any
step, so imagined horizons stay short).

Semantics are those of ``sim.env.SimEnv`` (see ``wmrl.kernel.interfaces.ChunkEnv``):

* ``step(actions float32 (B, H, D_a))`` imagines the observation after the chunk for every slot
  (one batched world-model call). The world model predicts chunk ends only, so a predicted success
  is detected at the end of a chunk and ``steps_executed == H`` for every running slot.
* reward per chunk: ``progress_scale * (progress(o_{n+1}) - progress(o_n)) + success_bonus *
  success`` (RISE-style progress gain plus a success bonus), with ``success = success_prob >
  success_threshold``;
* ``terminated`` on predicted success; ``truncated`` when a slot has run ``max_chunks`` chunks;
* ``proprio_success`` (optional, :class:`ProprioLiftRule`): for the tasks it names (lifts), success
  also needs the predicted arm to hold and raise an object, read from the imagined proprio and the
  commanded gripper; the critic alone is fooled by generated frames where the proprio is not;
  for its ``release_tasks`` (stacking) success also needs an object held earlier and let go;
  with the rule's ``grasp_box_m`` and a ``start_objects`` callable, a close whose imagined end
  effector is not around the task's object (where the start's init state puts it) is a miss, and
  the fingers' imagined gap cannot turn it into a hold (counted in :attr:`ImaginationEnv.grasp_misses`);
  with its ``place_box_m`` and a ``start_goals`` callable, a release is a success only with the hand
  that lets go over the goal object (where the start put it);
* ``halt_uncertainty`` (optional, a world model with the ``UncertainWorldModel`` capability): a slot
  whose imagined state the model is unsure of beyond it halts: terminated, reward 0, no success,
  flagged in ``info["halted"]`` and counted in :attr:`ImaginationEnv.halted` (MOReL's unknown-state
  halt, Kidambi et al. 2020); with or without the halt, such a world model's disagreement after the
  chunk is in ``info["uncertainty"]`` (``float32 (B,)``, its units: m for the dynamics ensemble);
* ``auto_reset=True``: only finished slots restart (from ``next_start(slot)``, by default their last
  ``Start``), ``info["final_obs"]`` keeps the observation before the reset; ``auto_reset=False``:
  finished slots stay finished (no reward, ``steps_executed == 0``, ``info["finished"]``) until
  :meth:`reset_slots`.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from wmrl.kernel.interfaces import ProgressCritic, SlotStateWorldModel, UncertainWorldModel, WorldModel
from wmrl.kernel.types import Obs, Start, StepResult


def _trailing_steps(mask: np.ndarray) -> np.ndarray:
    """``int (B,)``: how many of the last steps of each row of ``mask`` ``bool (B, H)`` are true."""
    return np.argmin(np.concatenate([mask[:, ::-1], np.zeros((len(mask), 1), bool)], 1), axis=1)


def _offsets(ee: np.ndarray, ref: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``ee - ref`` (``(B, 3)`` each, m) as ``float64`` with NaN rows zeroed, and ``bool (B,)``: which
    rows were known (no NaN)."""
    off = np.asarray(ee, dtype=np.float64) - np.asarray(ref, dtype=np.float64)
    return np.nan_to_num(off), np.isfinite(off).all(1)


class ProprioLiftRule:
    """A lift's success read from the arm at chunk resolution, streaming per slot: the gripper has
    been commanded closed (action dim ``gripper_dim`` > 0) on the last ``closed_steps`` control steps
    or more, the fingers are ``gap_min_m`` or more apart (proprio dims 7 and 8: an object is held),
    and the end effector (proprio dim 2, m) is ``rise_min_m`` or more above its lowest chunk-end
    height since the gripper closed. The per-step rule of ``sim.tasks.TaskSpec.proprio_success``,
    measured there on recorded lifts, seen at chunk ends (an imagined rollout has no other steps).

    For the ``release_tasks`` (placing tasks such as stacking, whose success in ``sim.tasks`` needs the
    object let go) the rule is instead: an object was held (the lift rule's closed streak and finger
    gap at an earlier chunk end) and the gripper is commanded open on the chunk's last
    ``release_open_steps`` steps. The
    critic still decides where the object is; this rule only refuses a success read from a frame in
    which the object is still in the hand (measured: 13 of 14 imagined stacking successes of the
    critic alone were the red cube held above the green one, docs/measurements.md).

    **The grasp box** (``grasp_box_m = (bx, by, bz)``, m): the finger gap is what the world model gets
    wrong (every imagined lift that failed in the sim on the seed-1 check was a close on nothing read
    as a hold, the imagined arm within 0.2-1 cm of the real one; docs/measurements.md). The arm is
    what it gets right, and objects stay where they are until touched, so the close is also judged
    geometrically: at the end of the chunk in which the gripper becomes commanded closed (or at its
    start, when the chunk is commanded closed from its first step: a keyframe start with the object
    already in the hand, which the arm carries away within the chunk), the imagined end effector
    ``p`` must be within ``|p_x - o_x| <= bx``, ``|p_y - o_y| <= by`` and
    ``p_z - o_z <= bz`` of the task's object ``o`` at the rollout's start (robot base frame, m;
    ``ImaginationEnv``'s ``start_objects``); otherwise the slot's grasp is a *miss* and cannot hold
    until the gripper is commanded open again. An unknown object position (NaN) is never a miss.

    **The place box** (``place_box_m = (r, z_min, z_max)``, m; release tasks only): the critic on
    imagined frames misses most real stacks (seed-0 check of 2026-12-07: 2 imagined against 26
    replayed; docs/measurements.md), while the imagined arm is within a few mm of the real one. So the
    release is also judged geometrically, as the grasp box judges the close: the end effector where
    the release chunk starts (the hand that lets go) must lie within ``r`` horizontally of the goal
    object's start position (``ImaginationEnv``'s ``start_goals``) and ``z_min..z_max`` above it. (The
    object's offset in the hand is not subtracted: read from the arm at the close it made the rule
    worse on recorded stacks, the hand moving while the fingers close; ``tests/test_place_rule.py``.)
    Only the first release after a hold is judged (the object has been let go: ``held`` is
    cleared), so an open hand that later drifts over the goal scores nothing. An unknown goal (NaN)
    never fails the box. Without a place box ``held`` persists and every
    later open chunk is a release (the critic decides where the object is).

    Args:
        tasks: the lift task names the rule applies to (the others: the critic alone).
        release_tasks: the placing task names (see above).
        gripper_dim: index of the gripper command in the action (``-1``: the last).
        grasp_box_m: ``(bx, by, bz)`` in m, or ``None`` (no geometric check).
        lifts_need_critic: ``False``: a lift's success is the rule alone (the critic's threshold
            still decides the release tasks and the tasks the rule does not name).
        release_open_steps: a release needs the gripper commanded open on the chunk's last
            ``release_open_steps`` control steps (capped at the chunk length ``H``). The fingers
            take about 11 steps to open: with 1, a release read at the end of the chunk in which
            the command turned open finds the real fingers still on the object (the sim's
            stacking success needs it let go); every imagined stacking success that failed in the
            sim on the seed-1 check of 2026-12-07 was that (docs/measurements.md).
        place_box_m: ``(r, z_min, z_max)`` in m, or ``None`` (no geometric check of the release).
        releases_need_critic: ``False``: a release task's success is the rule alone (needs a place box).
        start_holding_max_gap_m: a start whose real finger gap (proprio dims 7 - 8) is within
            ``gap_min_m..start_holding_max_gap_m`` already holds an object (a keyframe during a
            carry): its closed streak starts at ``closed_steps`` (``ImaginationEnv`` applies it at a
            reset). ``None``: every start begins with the streak at 0.

    Raises:
        ValueError: a task both a lift and a release task, a grasp box that is not 3 positive lengths,
            a place box that is not ``(r > 0, z_min < z_max)``, or ``releases_need_critic=False``
            without a place box.
    """

    def __init__(self, tasks: Sequence[str], closed_steps: int = 12, gap_min_m: float = 0.02,
                 rise_min_m: float = 0.055, gripper_dim: int = -1, release_tasks: Sequence[str] = (),
                 grasp_box_m: Sequence[float] | None = None, lifts_need_critic: bool = True,
                 release_open_steps: int = 1, place_box_m: Sequence[float] | None = None,
                 releases_need_critic: bool = True, start_holding_max_gap_m: float | None = None):
        self.tasks, self.release_tasks = set(tasks), set(release_tasks)
        if self.tasks & self.release_tasks:
            raise ValueError(f"tasks {sorted(self.tasks & self.release_tasks)} are both lifts and release tasks")
        self.closed_steps, self.gap_min_m, self.rise_min_m = int(closed_steps), float(gap_min_m), float(rise_min_m)
        self.gripper_dim = int(gripper_dim)
        if grasp_box_m is not None:
            box = [float(x) for x in grasp_box_m]
            if len(box) != 3 or min(box) <= 0 or not np.isfinite(box).all():
                raise ValueError(f"grasp_box_m must be 3 positive lengths (bx, by, bz) in m, got {list(grasp_box_m)}")
            grasp_box_m = np.array(box)
        self.grasp_box_m = grasp_box_m
        self.lifts_need_critic = bool(lifts_need_critic)
        if int(release_open_steps) < 1:
            raise ValueError(f"release_open_steps must be >= 1, got {release_open_steps}")
        self.release_open_steps = int(release_open_steps)
        if place_box_m is not None:
            box = [float(x) for x in place_box_m]
            if len(box) != 3 or not np.isfinite(box).all() or box[0] <= 0 or box[1] >= box[2]:
                raise ValueError(f"place_box_m must be (r > 0, z_min < z_max) in m, got {list(place_box_m)}")
            place_box_m = np.array(box)
        self.place_box_m = place_box_m
        self.releases_need_critic = bool(releases_need_critic)
        if not self.releases_need_critic and self.place_box_m is None:
            raise ValueError("releases_need_critic=False needs a place_box_m: without it nothing says where the "
                             "object was let go")
        if start_holding_max_gap_m is not None and not float(start_holding_max_gap_m) > self.gap_min_m:
            raise ValueError(f"start_holding_max_gap_m must exceed gap_min_m={self.gap_min_m}, got {start_holding_max_gap_m}")
        self.start_holding_max_gap_m = None if start_holding_max_gap_m is None else float(start_holding_max_gap_m)

    def applies(self, task_names: Sequence[str]) -> np.ndarray:
        return np.array([t in self.tasks or t in self.release_tasks for t in task_names], dtype=bool)

    def releases(self, task_names: Sequence[str]) -> np.ndarray:
        return np.array([t in self.release_tasks for t in task_names], dtype=bool)

    def lifts(self, task_names: Sequence[str]) -> np.ndarray:
        return np.array([t in self.tasks for t in task_names], dtype=bool)

    def alone(self, task_names: Sequence[str]) -> np.ndarray:
        """``bool (B,)``: slots whose success is the rule alone (``lifts_need_critic`` /
        ``releases_need_critic`` false)."""
        return ((self.lifts(task_names) & (not self.lifts_need_critic))
                | (self.releases(task_names) & (not self.releases_need_critic)))

    def starts_holding(self, proprio: torch.Tensor) -> np.ndarray:
        """``bool (B,)``: starts whose real proprio ``(B, D_s)`` shows the fingers on an object (gap within
        ``gap_min_m..start_holding_max_gap_m``); all ``False`` when that option is off."""
        gap = (proprio[:, 7] - proprio[:, 8]).double().numpy()
        if self.start_holding_max_gap_m is None:
            return np.zeros(len(gap), dtype=bool)
        return (gap >= self.gap_min_m) & (gap <= self.start_holding_max_gap_m)

    def place_miss(self, ee: np.ndarray, goals: np.ndarray) -> np.ndarray:
        """``bool (B,)``: the end effector ``ee`` ``(B, 3)`` (m) is outside the place box around ``goals``
        ``(B, 3)`` (m, robot base frame; NaN: unknown, never a miss). All ``False`` without a place box."""
        if self.place_box_m is None:
            return np.zeros(len(ee), dtype=bool)
        off, known = _offsets(ee, goals)
        r, z_min, z_max = self.place_box_m
        return known & ((np.hypot(off[:, 0], off[:, 1]) > r) | (off[:, 2] < z_min) | (off[:, 2] > z_max))

    def box_miss(self, ee: np.ndarray, objects: np.ndarray) -> np.ndarray:
        """``bool (B,)``: the end effector ``ee`` ``(B, 3)`` (m) is outside the grasp box around
        ``objects`` ``(B, 3)`` (m, robot base frame; a NaN row is never a miss). All ``False``
        without a grasp box."""
        if self.grasp_box_m is None:
            return np.zeros(len(ee), dtype=bool)
        off, known = _offsets(ee, objects)
        bx, by, bz = self.grasp_box_m
        return known & ((np.abs(off[:, 0]) > bx) | (np.abs(off[:, 1]) > by) | (off[:, 2] > bz))

    def update(self, closed: np.ndarray, z_low: np.ndarray, start: torch.Tensor, end: torch.Tensor,
               actions: torch.Tensor, held: np.ndarray, task_names: Sequence[str],
               missed: np.ndarray | None = None, objects: np.ndarray | None = None,
               goals: np.ndarray | None = None) -> np.ndarray:
        """Advance the slots' streaks ``closed`` (int, steps), ``z_low`` (m) and ``held`` (bool: an
        object was held at an earlier chunk end) in place over one chunk from proprio ``start`` to
        ``end`` (``(B, D_s)``) under ``actions`` ``(B, H, D_a)``; returns the rule's ``bool (B,)`` at
        the chunk's end (the release rule for the slots whose ``task_names`` are release tasks).
        With a grasp box, ``missed`` (bool ``(B,)``, in place: the current close is a miss) and
        ``objects`` (``(B, 3)`` m, the task's object at the rollout's start, NaN: unknown) apply it.
        With a place box, ``goals`` (``(B, 3)`` m, the goal object at the rollout's start, NaN: unknown)
        apply it."""
        g = (actions[..., self.gripper_dim] > 0).numpy()
        H = g.shape[1]
        z0, z1 = start[:, 2].double().numpy(), end[:, 2].double().numpy()
        trailing = _trailing_steps(g)        # steps commanded closed at the chunk's end
        whole = trailing == H
        was_open = closed == 0               # the previous chunk ended with the gripper commanded open
        fresh = was_open | ~whole            # the close began inside this chunk (or it is open)
        z_low[:] = np.where(whole & ~fresh, np.minimum(z_low, z1), np.minimum(z0, z1))
        closed[:] = np.where(whole, closed + H, trailing)
        gap = (end[:, 7] - end[:, 8]).double().numpy()
        holding = (closed >= self.closed_steps) & (gap >= self.gap_min_m)
        if missed is not None and objects is not None and self.grasp_box_m is not None:
            closes = g[:, -1] & (was_open | ~whole)    # commanded closed at the chunk's end, opened within or before it
            # judged at the chunk's end; a chunk commanded closed from its first step may also have closed
            # where it began (a keyframe start with the object already in the hand, carried away within the
            # chunk): a miss only when its start is off the object too
            miss = self.box_miss(end[:, :3].double().numpy(), objects)
            miss &= ~(whole & was_open) | self.box_miss(start[:, :3].double().numpy(), objects)
            missed[:] = np.where(closes, miss, missed & g[:, -1])
            holding &= ~missed
        lift = holding & (z1 - z_low >= self.rise_min_m)
        release = held & (_trailing_steps(~g) >= min(self.release_open_steps, H))
        if self.place_box_m is not None and goals is not None:
            placed = ~self.place_miss(start[:, :3].double().numpy(), goals)
            held &= ~release            # let go: only the first release after a hold is judged
            release &= placed
        held |= holding
        return np.where(self.releases(task_names), release, lift)


def start_obs(start: Start) -> Obs:
    """The observation a rollout starts from: the last frame of ``start.context`` (batch 1).

    Raises:
        ValueError: the ``Start`` has no context frames (imagination cannot start from a bare
            init state; reset a ``SimEnv`` to it and pass its observation as ``context``).
    """
    ctx = start.context
    if ctx is None:
        raise ValueError(f"Start for task {start.task_name!r} has no context frames; ImaginationEnv needs "
                         "real frames (use wmrl.rl.starts.starts_from_store(...) or put a SimEnv observation in Start.context)")
    last = ctx.index([ctx.batch_size - 1])
    return Obs(last.images, last.proprio, [start.instruction or (ctx.task[-1] if ctx.task else "")])


class ImaginationEnv:
    """``ChunkEnv`` in imagination (see the module docstring for the exact semantics).

    Args:
        world_model: a ``WorldModel`` (``init(Obs) -> state``, ``imagine(state, actions, generator)``).
            With the ``SlotStateWorldModel`` capability, resetting or finishing some slots leaves the
            others' state whole; without it the env re-``init``s every slot from its last observation.
        critic: a ``ProgressCritic``; ``evaluate(obs) -> (progress, success_prob)`` is used when
            present (one forward pass), else ``progress`` and ``success_prob``.
        num_envs: ``B``.
        max_chunks: chunk limit per episode (truncation).
        success_threshold: ``success_prob`` above which a chunk counts as a success frame.
        success_patience: a slot succeeds (terminates, gets the bonus) once ``success_prob`` has
            been above the threshold on this many consecutive chunks. The critic sees generated
            frames; a single frame that looks like success (a blurred or vanished arm) is common in
            long imagined rollouts, while a real success persists (the cube stays up).
        success_bonus, progress_scale: reward weights.
        auto_reset: see module docstring. next_start: ``slot -> Start`` for auto-resets.
        seed: seed of the ``torch.Generator`` for stochastic world models (``None``: unseeded).
        proprio_success: a :class:`ProprioLiftRule` (or ``None``): see the module docstring.
        halt_uncertainty: threshold on the world model's ``uncertainty`` (its units, m for the
            dynamics ensemble) above which a slot halts; ``None``: never.
        max_steps: ``task name -> int``: the task's control-step limit (``Suite.max_steps``); a slot
            truncates after the last chunk that fits whole within it. ``None``: ``max_chunks`` only.
        start_objects: ``Start -> float (3,) | None``: the position (m, robot base frame) of the
            start's task object, for the rule's grasp box (``sim.suite.Suite.object_position``
            reads it from the start's init state); ``None`` (or a ``None`` result): unknown, no box.
        start_goals: ``Start -> float (3,) | None``: the position (m, robot base frame) of the
            start's goal object, for the rule's place box (``sim.suite.Suite.goal_position``);
            ``None`` (or a ``None`` result): unknown, no place check.

    Raises:
        ValueError: bad sizes, or ``halt_uncertainty`` with a world model without the
            ``UncertainWorldModel`` capability.
    """

    def __init__(self, world_model: WorldModel, critic: ProgressCritic, num_envs: int, max_chunks: int = 10,
                 success_threshold: float = 0.5, success_bonus: float = 1.0, progress_scale: float = 1.0,
                 auto_reset: bool = True, success_patience: int = 1, next_start: Callable[[int], Start] | None = None,
                 seed: int | None = 0, action_dim: int | None = None, proprio_success: ProprioLiftRule | None = None,
                 halt_uncertainty: float | None = None, start_objects: Callable[[Start], object] | None = None,
                 max_steps: Callable[[str], int] | None = None, start_goals: Callable[[Start], object] | None = None):
        if int(num_envs) < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        if int(max_chunks) < 1:
            raise ValueError(f"max_chunks must be >= 1, got {max_chunks}")
        self.world_model = world_model
        self.critic = critic
        self.num_envs = int(num_envs)
        self.action_dim = int(action_dim if action_dim is not None else world_model.action_dim)
        self.chunk_size = world_model.chunk_size
        self.max_chunks = int(max_chunks)
        self.success_threshold = float(success_threshold)
        if int(success_patience) < 1:
            raise ValueError(f"success_patience must be >= 1, got {success_patience}")
        self.success_patience = int(success_patience)
        self._streak = np.zeros(self.num_envs, dtype=np.int64)
        self.success_bonus = float(success_bonus)
        self.progress_scale = float(progress_scale)
        self.auto_reset = bool(auto_reset)
        self.next_start = next_start
        self.generator = None if seed is None else torch.Generator().manual_seed(int(seed))
        self._starts: list[Start | None] = [None] * self.num_envs
        self._obs: Obs | None = None
        self._state = None
        self._progress = torch.zeros(self.num_envs)
        self._chunks = np.zeros(self.num_envs, dtype=np.int64)
        self._finished = np.zeros(self.num_envs, dtype=bool)
        self.proprio_success = proprio_success
        self._closed = np.zeros(self.num_envs, dtype=np.int64)
        self._z_low = np.zeros(self.num_envs)
        self._held = np.zeros(self.num_envs, dtype=bool)
        self.start_objects = start_objects
        self.max_steps = max_steps
        self._step_limit = np.full(self.num_envs, np.iinfo(np.int64).max, dtype=np.int64)
        self._objects = np.full((self.num_envs, 3), np.nan)
        self._missed = np.zeros(self.num_envs, dtype=bool)
        self.start_goals = start_goals
        self._goals = np.full((self.num_envs, 3), np.nan)
        self.grasp_misses = 0   # closes the grasp box judged misses (proprio_success.grasp_box_m)
        if isinstance(halt_uncertainty, str):
            raise ValueError(f"halt_uncertainty={halt_uncertainty!r}: give a number (m); 'calibrated' is resolved by wmrl "
                             "pipeline from the world model's report (heldout_horizons.halt_uncertainty_tau_m)")
        self._uncertain = isinstance(world_model, UncertainWorldModel)   # the declared capability, read once
        if halt_uncertainty is not None and not self._uncertain:
            raise ValueError(f"halt_uncertainty needs a world model with the UncertainWorldModel capability; "
                             f"{type(world_model).__name__} has none (e.g. worldmodel=dynamics)")
        self.halt_uncertainty = None if halt_uncertainty is None else float(halt_uncertainty)
        self._merges = isinstance(world_model, SlotStateWorldModel)   # the declared capability, read once
        self.halted = 0   # slots halted so far

    # ---------------------------------------------------------------- critic
    def _score(self, obs: Obs) -> tuple[torch.Tensor, torch.Tensor]:
        p, s = self.critic.evaluate(obs)
        return p.detach().float().cpu(), s.detach().float().cpu()

    # ---------------------------------------------------------------- resets
    def _set_slots(self, slots: Sequence[int], starts: Sequence[Start], current: Obs | None) -> Obs:
        firsts = [start_obs(s) for s in starts]
        first = Obs.cat(firsts)
        if current is None:
            obs = first
        else:
            parts = [current.index([b]) for b in range(self.num_envs)]
            for b, o in zip(slots, firsts):
                parts[b] = o
            obs = Obs.cat(parts)
        obs = Obs({k: v.cpu() for k, v in obs.images.items()}, obs.proprio.float().cpu(), obs.task)
        idx = torch.as_tensor(list(slots), dtype=torch.long)
        p, _ = self._score(first)
        self._progress[idx] = p
        for b, s in zip(slots, starts):
            self._starts[b] = s
            self._chunks[b] = 0
            self._streak[b] = 0
            self._closed[b] = 0
            self._held[b] = False
            self._missed[b] = False
            if self.max_steps is not None:
                self._step_limit[b] = int(self.max_steps(s.task_name))
            pos = None if self.start_objects is None else self.start_objects(s)
            self._objects[b] = np.nan if pos is None else np.asarray(pos, dtype=np.float64).reshape(3)
            wants_goal = self.proprio_success is None or s.task_name in self.proprio_success.release_tasks
            pos = None if self.start_goals is None or not wants_goal else self.start_goals(s)   # placing tasks only
            self._goals[b] = np.nan if pos is None else np.asarray(pos, dtype=np.float64).reshape(3)
            self._finished[b] = False
        if self.proprio_success is not None:     # a start already holding an object (a keyframe in a carry)
            proprio = first.proprio.float().cpu()
            holds = self.proprio_success.starts_holding(proprio)
            for j, b in enumerate(slots):
                if holds[j]:
                    self._closed[b] = self.proprio_success.closed_steps
                    self._z_low[b] = float(proprio[j, 2])
        self._obs = obs
        fresh = self.world_model.init(obs)
        if current is not None and self._state is not None and self._merges:
            mask = torch.zeros(self.num_envs, dtype=torch.bool)
            mask[idx] = True
            fresh = self.world_model.merge_states(self._state, mask, fresh)
        self._state = fresh
        return obs

    def counters(self) -> dict[str, int]:
        """``wmrl.kernel.interfaces.CountingEnv``: slots the uncertainty gate halted and closes the grasp
        box judged misses, since the env was built."""
        return {"halted": int(self.halted), "grasp_misses": int(self.grasp_misses)}

    def rng_streams(self) -> dict[str, torch.Generator]:
        """``wmrl.kernel.interfaces.RandomStreams``: the world model's sampling generator (none when unseeded)."""
        return {} if self.generator is None else {"imagination": self.generator}

    def reset(self, starts: list[Start]) -> Obs:
        """Reset every slot to ``starts[i]`` (each needs ``context`` frames). Raises ``ValueError``
        when ``len(starts) != num_envs`` or a start has no context."""
        if len(starts) != self.num_envs:
            raise ValueError(f"reset needs {self.num_envs} starts (one per slot), got {len(starts)}")
        return self._set_slots(range(self.num_envs), starts, None)

    def reset_slots(self, slots: Sequence[int], starts: Sequence[Start]) -> Obs:
        """Reset only ``slots`` (to ``starts``); returns the whole batch's current observation."""
        if len(slots) != len(starts):
            raise ValueError(f"reset_slots got {len(slots)} slots and {len(starts)} starts")
        if self._obs is None:
            raise RuntimeError("ImaginationEnv.reset_slots before reset: call reset(starts) first")
        for i in slots:
            if not 0 <= int(i) < self.num_envs:
                raise ValueError(f"slot {i} out of range for num_envs={self.num_envs}")
        return self._set_slots([int(i) for i in slots], starts, self._obs)

    # ---------------------------------------------------------------- step
    def step(self, actions: torch.Tensor) -> StepResult:
        """Imagine one action chunk per slot.

        Args:
            actions: ``float32 (B, H, D_a)``, finite; ``H`` must be the world model's chunk size.

        Raises:
            ValueError: wrong shape or non-finite values. RuntimeError: step before reset.
        """
        a = torch.as_tensor(actions, dtype=torch.float32)
        if a.ndim != 3 or a.shape[0] != self.num_envs or a.shape[2] != self.action_dim or a.shape[1] < 1:
            raise ValueError(f"ImaginationEnv.step expects actions (B={self.num_envs}, H, D_a={self.action_dim}), "
                             f"got shape {tuple(a.shape)}")
        if self.chunk_size is not None and a.shape[1] != self.chunk_size:
            raise ValueError(f"ImaginationEnv.step got chunks of H={a.shape[1]}; the world model predicts "
                             f"chunks of H={self.chunk_size}")
        if not torch.isfinite(a).all():
            raise ValueError("ImaginationEnv.step got non-finite actions (NaN or inf)")
        if self._obs is None:
            raise RuntimeError("ImaginationEnv.step before reset: call reset(starts) first")
        B, H = a.shape[:2]
        was_finished = self._finished.copy()
        running = torch.from_numpy(~was_finished)
        state, pred = self.world_model.imagine(self._state, a, generator=self.generator)
        pred = Obs({k: v.cpu() for k, v in pred.images.items()}, pred.proprio.float().cpu(), list(self._obs.task))
        prog, sprob = self._score(pred)
        above = (sprob > self.success_threshold) & running
        self._streak = np.where(above.numpy(), self._streak + 1, 0)
        succ = torch.from_numpy(self._streak >= self.success_patience) & running
        tasks = [s.task_name if s is not None else "" for s in self._starts]
        if self.proprio_success is not None:
            rule_ = self.proprio_success
            missed_before = self._missed.copy()
            rule = rule_.update(self._closed, self._z_low, self._obs.proprio, pred.proprio, a, held=self._held,
                                task_names=tasks, missed=self._missed, objects=self._objects,
                                goals=self._goals)
            self.grasp_misses += int((self._missed & ~missed_before & ~was_finished).sum())
            ruled = torch.from_numpy(rule_.applies(tasks))
            alone = torch.from_numpy(rule_.alone(tasks))
            succ = torch.where(ruled, succ & torch.from_numpy(rule), succ)
            succ = torch.where(alone, torch.from_numpy(rule) & running, succ)
        halted = torch.zeros(B, dtype=torch.bool)
        unc = self.world_model.uncertainty(state) if self._uncertain else None
        unc = None if unc is None else unc.detach().float().cpu()
        if self.halt_uncertainty is not None and unc is not None:
            halted = (unc > self.halt_uncertainty) & running & ~succ
            self.halted += int(halted.sum())
        # finished slots keep their last observation and get nothing
        keep = torch.from_numpy(was_finished)
        if keep.any():
            images = {k: torch.where(keep[:, None, None, None], self._obs.images[k], v) for k, v in pred.images.items()}
            pred = Obs(images, torch.where(keep[:, None], self._obs.proprio, pred.proprio), pred.task)
            if self._merges:
                state = self.world_model.merge_states(state, keep, self._state)
            else:
                state = self.world_model.init(pred)
        reward = self.progress_scale * (prog - self._progress) + self.success_bonus * succ.float()
        reward = torch.where(running & ~halted, reward, torch.zeros_like(reward))
        self._chunks += (~was_finished).astype(np.int64)
        term = succ.numpy() | halted.numpy()
        out_of_steps = (self._chunks + 1) * H > self._step_limit      # the next chunk would not fit
        trunc = (~term) & ((self._chunks >= self.max_chunks) | out_of_steps) & ~was_finished
        done = term | trunc
        nexec = np.where(was_finished, 0, H).astype(np.int64)
        self._progress = torch.where(running, prog, self._progress)
        self._finished |= done
        final_obs = pred
        self._obs, self._state = pred, state
        info = {"final_obs": final_obs, "finished": torch.from_numpy(was_finished),
                "episode_length": torch.from_numpy(self._chunks * H),
                "task_name": tasks, "progress": prog, "success_prob": sprob, "halted": halted}
        if unc is not None:
            info["uncertainty"] = unc
        obs = final_obs
        if self.auto_reset and done.any():
            slots = [int(b) for b in np.flatnonzero(done)]
            starts = [self.next_start(b) if self.next_start is not None else self._starts[b] for b in slots]
            obs = self._set_slots(slots, starts, final_obs)
        t = torch.from_numpy
        return StepResult(obs=obs, reward=reward.float(), terminated=t(term), truncated=t(trunc),
                          success=succ.clone(), steps_executed=t(nexec), info=info)
