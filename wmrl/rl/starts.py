"""Start providers: where rollouts begin. A provider is a callable ``iteration -> list[Start]``
(``wmrl.kernel.types.Start``), drawn reproducibly from the iteration and a seed.

* :class:`InitStateStarts`: a task's stored init states (GRPO's training starts, the world-model
  refresher's real rollouts); :func:`all_starts`: every held-out init state once (evaluation);
* :func:`starts_from_store` / :class:`KeyframeStarts`: keyframes of stored episodes (imagined
  rollouts that begin mid-task, WoVR / World-Gymnast);
* :class:`ContextStarts`: any provider's starts with the real first frame and MuJoCo state read
  from the sim (imagination needs real frames); :class:`MixedStarts`: several providers in turn.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from wmrl.kernel.interfaces import SimStateEnv
from wmrl.kernel.types import Obs, Start
from wmrl.rl.rollout import batched_starts


class InitStateStarts:
    """Starts at a task's init states, ``per_task`` per iteration, drawn reproducibly from
    ``iteration`` and ``seed``.

    Args:
        tasks: task name -> instruction.
        n_init: number of init states of ``split`` per task (indices ``0..n_init-1``).
        per_task: starts per task per iteration.
        split: ``"train"`` (for training) or ``"eval"``.
        stream: extra integers of the draw's seed (``numpy.random.default_rng([seed, *stream,
            iteration])``), so that two users of one seed draw independent starts.
    """

    def __init__(self, tasks: dict, n_init: int, per_task: int, split: str = "train", seed: int = 0,
                 stream: Sequence[int] = ()):
        if not tasks:
            raise ValueError("InitStateStarts needs at least one task")
        if per_task < 1 or n_init < 1:
            raise ValueError(f"per_task and n_init must be >= 1, got {per_task}, {n_init}")
        self.tasks, self.n_init, self.per_task, self.split, self.seed = dict(tasks), int(n_init), int(per_task), split, int(seed)
        self.stream = [int(x) for x in stream]

    def __call__(self, iteration: int) -> list[Start]:
        rng = np.random.default_rng([self.seed, *self.stream, int(iteration)])
        out = []
        for name, instr in self.tasks.items():
            idx = rng.choice(self.n_init, size=self.per_task, replace=self.per_task > self.n_init)
            out += [Start(task_name=name, instruction=instr, init_index=int(i), split=self.split) for i in idx]  # type: ignore[arg-type]
        return out


def all_starts(tasks: dict, n: int, split: str = "eval") -> list[Start]:
    """Every init state ``0..n-1`` of ``split`` for each task (held-out evaluation starts)."""
    return [Start(task_name=t, instruction=i, init_index=k, split=split) for t, i in tasks.items() for k in range(n)]  # type: ignore[arg-type]


def starts_from_store(store, n: int, rng: np.random.Generator, episodes: Sequence[int] | None = None,
                      min_steps_left: int = 8, context: int = 1, first_steps: int | None = None,
                      success_fraction: float | None = None) -> list[Start]:
    """Keyframe starts: ``n`` (episode, step) pairs drawn uniformly over the steps of ``episodes``
    (default all) of an ``EpisodeStore`` with at least ``min_steps_left`` steps after them
    (``first_steps``: only among each episode's first ``first_steps`` steps; 1 = its first frame).

    ``success_fraction`` (``[0, 1]`` or ``None``): each draw first picks the successful episodes with
    this probability and the failed ones otherwise (then uniform over that class's steps), so the
    starts are not dominated by failed episodes, which run to the step limit and hold more steps;
    when one class has no steps the other is used. ``None``: uniform over all steps (one stream of
    draws, as before the option existed).

    Returns ``Start`` objects with ``context`` (the last ``context`` frames up to that step, padded
    by repeating step 0), ``episode``, ``step``, ``task_name``, ``instruction`` and, when stored,
    ``sim_state`` of that step (so the same start can be replayed in a ``SimEnv``).
    """
    eps = list(range(len(store))) if episodes is None else list(episodes)
    if not eps:
        raise ValueError("starts_from_store needs at least one episode")
    lengths = np.asarray(store.lengths)[eps]
    counts = np.maximum(lengths - min_steps_left, 0)
    if first_steps is not None:
        if int(first_steps) < 1:
            raise ValueError(f"first_steps must be >= 1 (or None), got {first_steps}")
        counts = np.minimum(counts, int(first_steps))
    if counts.sum() == 0:
        raise ValueError(f"no episode has more than min_steps_left={min_steps_left} steps")
    probs = counts / counts.sum()
    if success_fraction is not None:
        success_fraction = float(success_fraction)
        if not 0.0 <= success_fraction <= 1.0:
            raise ValueError(f"success_fraction must be in [0, 1] (or None), got {success_fraction}")
        won = np.asarray(store.successes)[eps]
        by_class = []
        for mask in (won, ~won):
            c = np.where(mask, counts, 0)
            by_class.append(c / c.sum() if c.sum() > 0 else probs)
    cache: dict[int, object] = {}
    out = []
    for _ in range(n):
        if success_fraction is None:
            k = int(rng.choice(len(eps), p=probs))
        else:
            k = int(rng.choice(len(eps), p=by_class[0 if rng.random() < success_fraction else 1]))
        t = int(rng.integers(0, counts[k]))
        i = eps[k]
        if i not in cache:
            cache[i] = store.episode(i)
        ep = cache[i]
        steps = [max(0, t - context + 1 + j) for j in range(context)]
        ctx = Obs(images={c: torch.from_numpy(np.asarray(v[steps])) for c, v in ep.images.items()},
                  proprio=torch.from_numpy(np.asarray(ep.proprio[steps], dtype=np.float32)),
                  task=[ep.instruction] * context)
        sim_state = None if ep.sim_states is None else np.asarray(ep.sim_states[t])
        out.append(Start(task_name=ep.task_name, instruction=ep.instruction, init_index=None, split="train",
                         sim_state=sim_state, context=ctx, episode=i, step=t))
    return out


class ContextStarts:
    """Wrap a start provider so every ``Start`` also carries the real first observation (``context``,
    1 frame) and the MuJoCo state of its init state, read once from the real sim and cached.
    Imagined rollouts then start from real frames, and online debiasing can run the same start in
    the sim."""

    def __init__(self, inner, sim_env):
        self.inner, self.sim_env, self.cache = inner, sim_env, {}

    def contextualize(self, starts: list[Start]) -> list[Start]:
        todo = [s for s in starts if (s.task_name, s.split, s.init_index) not in self.cache]
        b = self.sim_env.num_envs
        for i, padded in zip(range(0, len(todo), b), batched_starts(todo, b)):
            obs = self.sim_env.reset(padded)
            for j, s in enumerate(todo[i:i + b]):
                state = self.sim_env.sim_state(j) if isinstance(self.sim_env, SimStateEnv) else None
                self.cache[(s.task_name, s.split, s.init_index)] = (obs.index([j]), state)
        out = []
        for s in starts:
            ctx_obs, state = self.cache[(s.task_name, s.split, s.init_index)]
            out.append(Start(task_name=s.task_name, instruction=s.instruction, init_index=s.init_index, split=s.split,
                             sim_state=state, context=ctx_obs))
        return out

    def __call__(self, iteration: int) -> list[Start]:
        return self.contextualize(self.inner(iteration))


class KeyframeStarts:
    """Keyframe starts (:func:`starts_from_store`): ``per_task`` (episode, step) pairs of
    each task's stored episodes per iteration, drawn reproducibly from ``iteration`` and ``seed``,
    with the real frame of that step as context. Imagined rollouts then begin mid-task and stay
    short (WoVR / World-Gymnast keyframe-initialised rollouts). ``branch_chunks``: each start is a
    branch of that many chunks (``Start.max_chunks``; the chunk value bootstraps the rest,
    ``GRPOConfig.advantage="gae"``); ``None``: rollouts of GRPO's own length. ``success_fraction``:
    the share of keyframes drawn from successful episodes (:func:`starts_from_store`)."""

    def __init__(self, store_path, tasks: dict, per_task: int, seed: int = 0, min_steps_left: int = 8,
                 first_steps: int | None = None, branch_chunks: int | None = None,
                 success_fraction: float | None = None):
        from wmrl.kernel.storage import EpisodeStore

        self.store = EpisodeStore.open(store_path, mode="r")
        names = self.store.task_names
        self.by_task = {t: [i for i, n in enumerate(names) if n == t] for t in tasks}
        missing = [t for t, eps in self.by_task.items() if not eps]
        if missing:
            raise ValueError(f"keyframe store {store_path} has no episodes of tasks {missing}")
        self.per_task, self.seed, self.min_steps_left = int(per_task), int(seed), int(min_steps_left)
        self.first_steps = None if first_steps is None else int(first_steps)
        if branch_chunks is not None and int(branch_chunks) < 1:
            raise ValueError(f"branch_chunks must be >= 1 (or null), got {branch_chunks}")
        self.branch_chunks = None if branch_chunks is None else int(branch_chunks)
        self.success_fraction = None if success_fraction is None else float(success_fraction)

    def __call__(self, iteration: int) -> list[Start]:
        rng = np.random.default_rng([self.seed, 11, int(iteration)])
        out = [s for t, eps in self.by_task.items()
               for s in starts_from_store(self.store, self.per_task, rng, episodes=eps,
                                          min_steps_left=self.min_steps_left, first_steps=self.first_steps,
                                          success_fraction=self.success_fraction)]
        if self.branch_chunks is not None:
            out = [dataclasses.replace(s, max_chunks=self.branch_chunks) for s in out]
        return out


class MixedStarts:
    """Concatenates the starts of several providers (e.g. init states and keyframes)."""

    def __init__(self, *providers):
        self.providers = [p for p in providers if p is not None]

    def __call__(self, iteration: int) -> list[Start]:
        return [s for p in self.providers for s in p(iteration)]
