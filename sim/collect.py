"""Scripted-expert episodes from the training init states, as ``wmrl.kernel.types.Episode`` objects."""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

from sim.env import TaskEnv
from sim.expert import ScriptedExpert
from sim.suite import Suite, collect_seed
from wmrl.kernel.types import Episode


def collect_episode(env: TaskEnv, suite: Suite, task: str, i: int, noise: float, seed: int,
                    rotation_noise: float = 1.0, stop_on_success: bool = True) -> Episode:
    """Run the scripted expert on training init state ``i % N_train`` of ``task``.

    Returns an ``Episode`` with ``T`` steps: images ``uint8 (T, 3, Hi, Wi)`` per camera, proprio
    ``float32 (T, 9)``, actions ``float32 (T, D_a)`` (the env's control), rewards ``float32 (T,)``, sim_states
    ``float64 (T, 1 + nq + nv)`` (state before each action), and ``info`` = task, init_index,
    split="train", seed, noise, rotation_noise, failure ("" / "timeout" / "dropped"). ``noise`` and
    ``rotation_noise`` are the ``ScriptedExpert``'s. ``stop_on_success=False`` runs on past a
    success to the step limit (or a failure), as an imagined rollout does: ``rewards`` (1 at every
    successful step) then say when the task was done, ``success`` whether it ever was.
    """
    start = suite.train_start(task, i)
    spec = suite.task(task)
    ep_seed = collect_seed(seed, task, i)
    env.reset(spec, suite.init_state(task, "train", start.init_index))
    expert = ScriptedExpert(spec, noise, ep_seed, rotation_noise, env.control)
    imgs = {c: [] for c in env.cameras}
    prop, acts, rews, states = [], [], [], []
    success = terminated = ever = False
    while True:
        o = env.observe()
        for c in env.cameras:
            imgs[c].append(o["images"][c])
        prop.append(o["proprio"])
        states.append(env.sim_state())
        a = expert.act(env.privileged())
        r, success, terminated, truncated = env.step(a)
        acts.append(a)
        rews.append(r)
        ever = ever or success
        if not stop_on_success and success and not spec.failed(env.privileged()):
            terminated = False
            truncated = env.elapsed >= spec.max_steps
        if terminated or truncated:
            break
    success = ever
    failure = "" if success else ("dropped" if terminated else "timeout")
    return Episode(
        images={c: np.stack(v) for c, v in imgs.items()},
        proprio=np.stack(prop).astype(np.float32),
        actions=np.stack(acts).astype(np.float32),
        rewards=np.asarray(rews, np.float32),
        success=bool(success),
        instruction=spec.instruction,
        task_name=task,
        sim_states=np.stack(states),
        info={"task": task, "init_index": int(start.init_index), "split": "train", "seed": int(ep_seed),
              "noise": float(noise), "rotation_noise": float(rotation_noise), "failure": failure, "source": "scripted", "suite": suite.name},
    )


def collect_episodes(suite: Suite, episodes_per_task: int, noise: float = 0.0, seed: int = 0,
                     tasks: Sequence[str] | None = None, start_index: int = 0,
                     rotation_noise: float = 1.0, stop_on_success: bool = True) -> Iterator[Episode]:
    """Yield ``episodes_per_task`` expert episodes per task (task-major order), including failed
    ones (the critic needs them). Episode ``i`` of a task always uses train init state
    ``i % N_train`` and seed ``collect_seed(seed, task, i)``; ``start_index`` skips the first ones
    (to continue a collection)."""
    if episodes_per_task < 0:
        raise ValueError(f"episodes_per_task must be >= 0, got {episodes_per_task}")
    envs: dict[str, TaskEnv] = {}
    for task in (tasks or suite.task_names):
        scene = suite.task(task).scene
        if scene not in envs:
            envs[scene] = TaskEnv(scene, suite.cameras, suite.image_size, suite.render, suite.control)
        for i in range(start_index, episodes_per_task):
            yield collect_episode(envs[scene], suite, task, i, noise, seed, rotation_noise, stop_on_success)
