"""Small random episodes and stores for tests and benchmarks (not training data)."""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np

from wmrl.kernel.storage.episode_store import EpisodeStore
from wmrl.kernel.types import PANDA_OSC_POSE, ActionSpace, Episode


def random_episode(T: int, cameras: Mapping[str, tuple[int, int]] | None = None, state_dim: int = 9,
                   action_dim: int = 7, seed: int = 0, success: bool = True, instruction: str = "lift the cube",
                   task_name: str = "lift", sim_state_dim: int | None = None) -> Episode:
    """A random :class:`Episode` of ``T`` steps: uint8 images ``(T, 3, Hi, Wi)``, proprio / actions
    drawn from a standard normal (actions clipped to [-1, 1]), rewards 0 except 1 at the end when
    ``success``."""
    cameras = {"agentview": (8, 8)} if cameras is None else dict(cameras)
    rng = np.random.default_rng(seed)
    rewards = np.zeros(T, np.float32)
    if success:
        rewards[-1] = 1.0
    return Episode(
        images={c: rng.integers(0, 256, (T, 3, h, w), dtype=np.uint8) for c, (h, w) in cameras.items()},
        proprio=rng.standard_normal((T, state_dim)).astype(np.float32),
        actions=np.clip(rng.standard_normal((T, action_dim)), -1, 1).astype(np.float32),
        rewards=rewards,
        success=success,
        instruction=instruction,
        task_name=task_name,
        sim_states=None if sim_state_dim is None else rng.standard_normal((T, sim_state_dim)),
        info={"seed": int(seed)},
    )


def random_store(path: str | os.PathLike, lengths: list[int] = (12, 7, 20),
                 cameras: Mapping[str, tuple[int, int]] | None = None, state_dim: int = 9, action_dim: int = 7,
                 action_space: ActionSpace | None = None, seed: int = 0) -> EpisodeStore:
    """A new store at ``path`` holding random episodes of the given lengths (odd ones failures)."""
    cameras = {"agentview": (8, 8)} if cameras is None else dict(cameras)
    asp = action_space or (PANDA_OSC_POSE if action_dim == 7 else ActionSpace(dim=action_dim))
    store = EpisodeStore.create(path, cameras=cameras, state_dim=state_dim, action_dim=action_dim, fps=20,
                                action_space=asp, embodiment="panda", source="synthetic", overwrite=True)
    for i, T in enumerate(lengths):
        store.append(random_episode(T, cameras, state_dim, action_dim, seed=seed + i, success=i % 2 == 0))
    return store
