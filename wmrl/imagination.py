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
* ``auto_reset=True``: only finished slots restart (from ``next_start(slot)``, by default their last
  ``Start``), ``info["final_obs"]`` keeps the observation before the reset; ``auto_reset=False``:
  finished slots stay finished (no reward, ``steps_executed == 0``, ``info["finished"]``) until
  :meth:`reset_slots`.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from wmrl.kernel.interfaces import ProgressCritic, WorldModel
from wmrl.kernel.types import Obs, Start, StepResult


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
            If it has ``index(state, idx)``-free states, the env re-initialises from observations
            when slots reset.
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
    """

    def __init__(self, world_model: WorldModel, critic: ProgressCritic, num_envs: int, max_chunks: int = 10,
                 success_threshold: float = 0.5, success_bonus: float = 1.0, progress_scale: float = 1.0,
                 auto_reset: bool = True, success_patience: int = 1, next_start: Callable[[int], Start] | None = None,
                 seed: int | None = 0, action_dim: int | None = None):
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

    # ---------------------------------------------------------------- critic
    def _score(self, obs: Obs) -> tuple[torch.Tensor, torch.Tensor]:
        p, s = self.critic.evaluate(obs)
        return p.detach().float().cpu(), s.detach().float().cpu()

    # ---------------------------------------------------------------- resets
    def _set_slots(self, slots: Sequence[int], starts: Sequence[Start], current: Obs | None) -> Obs:
        firsts = [start_obs(s) for s in starts]
        if current is None:
            obs = Obs.cat(firsts)
        else:
            parts = [current.index([b]) for b in range(self.num_envs)]
            for b, o in zip(slots, firsts):
                parts[b] = o
            obs = Obs.cat(parts)
        obs = Obs({k: v.cpu() for k, v in obs.images.items()}, obs.proprio.float().cpu(), obs.task)
        idx = torch.as_tensor(list(slots), dtype=torch.long)
        p, _ = self._score(Obs.cat(firsts))
        self._progress[idx] = p
        for b, s in zip(slots, starts):
            self._starts[b] = s
            self._chunks[b] = 0
            self._streak[b] = 0
            self._finished[b] = False
        self._obs = obs
        self._state = self.world_model.init(obs)
        return obs

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
        # finished slots keep their last observation and get nothing
        keep = torch.from_numpy(was_finished)
        if keep.any():
            images = {k: torch.where(keep[:, None, None, None], self._obs.images[k], v) for k, v in pred.images.items()}
            pred = Obs(images, torch.where(keep[:, None], self._obs.proprio, pred.proprio), pred.task)
            state = self.world_model.init(pred)
        reward = self.progress_scale * (prog - self._progress) + self.success_bonus * succ.float()
        reward = torch.where(running, reward, torch.zeros_like(reward))
        self._chunks += (~was_finished).astype(np.int64)
        term = succ.numpy().copy()
        trunc = (~term) & (self._chunks >= self.max_chunks) & ~was_finished
        done = term | trunc
        nexec = np.where(was_finished, 0, H).astype(np.int64)
        self._progress = torch.where(running, prog, self._progress)
        self._finished |= done
        final_obs = pred
        self._obs, self._state = pred, state
        info = {"final_obs": final_obs, "finished": torch.from_numpy(was_finished),
                "episode_length": torch.from_numpy(self._chunks * H),
                "task_name": [s.task_name if s is not None else "" for s in self._starts],
                "progress": prog, "success_prob": sprob}
        obs = final_obs
        if self.auto_reset and done.any():
            slots = [int(b) for b in np.flatnonzero(done)]
            starts = [self.next_start(b) if self.next_start is not None else self._starts[b] for b in slots]
            obs = self._set_slots(slots, starts, final_obs)
        t = torch.from_numpy
        return StepResult(obs=obs, reward=reward.float(), terminated=t(term), truncated=t(trunc),
                          success=succ.clone(), steps_executed=t(nexec), info=info)
