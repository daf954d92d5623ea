"""In-memory chunk windows for world-model and critic training.

Episodes (``wmrl.kernel.types.Episode``, e.g. from ``wmrl.kernel.storage.EpisodeStore``) are concatenated into
flat arrays once, so that sampling a batch of windows is a few numpy gathers (no per-item Python
loop). A *chunk window* at step ``t`` of an episode of ``T`` steps is

* ``frames``: the cameras at ``t`` stacked on channels, ``uint8 (B, 3 * n_cam, Hi, Wi)``;
* ``proprio``: ``float32 (B, D_s)`` at ``t``;
* ``actions``: ``float32 (B, H, D_a)``, the actions ``t .. t+H-1``;
* ``next_frames`` / ``next_proprio``: the observation at ``t + H`` (after the chunk);
* ``prev_proprio``: ``float32 (B, D_s)`` at ``t - 1`` (at ``t`` for ``t = 0``: the arm at rest).

A *proprio path* (:meth:`EpisodeFrames.sample_paths`, for the proprio dynamics) is the proprio at
``t - 1 .. t + T`` and the actions ``t .. t + T - 1``, with no frames.

Only windows with ``t + H <= T - 1`` exist (no padding is ever imagined).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import torch

from wmrl.kernel.types import Episode, Obs


def heldout_episodes(n: int, heldout_every: int) -> tuple[list[int], list[int]]:
    """Deterministic train / held-out split by episode index.

    Episode ``i`` is held out when ``i % heldout_every == heldout_every - 1`` (so every
    ``heldout_every``-th episode, reproducible and independent of any seed).

    Returns:
        ``(train_indices, heldout_indices)``.

    Raises:
        ValueError: ``heldout_every < 2`` or no episode would be left on either side.
    """
    if heldout_every < 2:
        raise ValueError(f"heldout_every must be >= 2, got {heldout_every}")
    held = [i for i in range(n) if i % heldout_every == heldout_every - 1]
    train = [i for i in range(n) if i % heldout_every != heldout_every - 1]
    if not train or not held:
        raise ValueError(
            f"{n} episodes with heldout_every={heldout_every} leave {len(train)} train and "
            f"{len(held)} held-out episodes; record more episodes or lower heldout_every"
        )
    return train, held


def stack_cameras(images: dict[str, torch.Tensor], cameras: Sequence[str]) -> torch.Tensor:
    """Stack cameras on channels: ``uint8 (B, 3, Hi, Wi)`` each -> ``(B, 3 * n_cam, Hi, Wi)``.

    Raises:
        KeyError: a camera is missing (names the ones present).
        ValueError: cameras differ in resolution.
    """
    missing = [c for c in cameras if c not in images]
    if missing:
        raise KeyError(f"cameras {missing} missing from the observation, which has {sorted(images)}")
    shapes = {tuple(images[c].shape[-2:]) for c in cameras}
    if len(shapes) != 1:
        raise ValueError(f"all cameras must share one resolution to be predicted jointly, got {shapes}; "
                         "record them at one size")
    return torch.cat([images[c] for c in cameras], dim=1)


def split_cameras(stacked: torch.Tensor, cameras: Sequence[str]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`stack_cameras`."""
    return {c: stacked[:, 3 * i: 3 * i + 3] for i, c in enumerate(cameras)}


@dataclass
class Windows:
    """A batch of chunk windows (see the module docstring for shapes)."""

    frames: torch.Tensor
    proprio: torch.Tensor
    actions: torch.Tensor
    next_frames: torch.Tensor
    next_proprio: torch.Tensor
    episode: torch.Tensor
    step: torch.Tensor
    prev_proprio: torch.Tensor | None = None


class EpisodeFrames:
    """Episodes held in memory as flat arrays, with chunk-window and frame sampling.

    Args:
        episodes: ``Episode`` objects (all with the same cameras, resolution, ``D_s`` and ``D_a``).
        cameras: camera names to keep, in stacking order (default: the first episode's, sorted
            with ``agentview`` first).
        episode_ids: ids to report for each episode (default ``0..N-1``), e.g. store indices.

    Raises:
        ValueError: no episodes, or episodes disagree on cameras / shapes.
    """

    def __init__(self, episodes: Sequence[Episode], cameras: Sequence[str] | None = None,
                 episode_ids: Sequence[int] | None = None):
        if not episodes:
            raise ValueError("EpisodeFrames needs at least one episode; the store or list given is empty")
        if cameras is None:
            cameras = sorted(episodes[0].images, key=lambda c: (c != "agentview", c))
        self.cameras = list(cameras)
        imgs, prop, act = [], [], []
        self.lengths = np.array([e.length for e in episodes], dtype=np.int64)
        for k, e in enumerate(episodes):
            missing = [c for c in self.cameras if c not in e.images]
            if missing:
                raise ValueError(f"episode {k} lacks cameras {missing} (has {sorted(e.images)})")
            imgs.append(np.concatenate([np.asarray(e.images[c]) for c in self.cameras], axis=1))
            prop.append(np.asarray(e.proprio, dtype=np.float32))
            act.append(np.asarray(e.actions, dtype=np.float32))
        shapes = {i.shape[1:] for i in imgs}
        if len(shapes) != 1:
            raise ValueError(f"episodes disagree on stacked image shape: {shapes}")
        self.images = np.concatenate(imgs)                     # uint8 (N_steps, 3*n_cam, Hi, Wi)
        self.proprio = np.concatenate(prop)                    # float32 (N_steps, D_s)
        self.actions = np.concatenate(act)                     # float32 (N_steps, D_a)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(np.int64)
        self.success = np.array([bool(e.success) for e in episodes])
        self.instructions = [e.instruction for e in episodes]
        self.task_names = [e.task_name for e in episodes]
        self.rewards = [np.asarray(e.rewards, dtype=np.float32) for e in episodes]
        self.episode_ids = np.asarray(list(episode_ids) if episode_ids is not None else range(len(episodes)),
                                      dtype=np.int64)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_store(cls, store, indices: Iterable[int] | None = None,
                   cameras: Sequence[str] | None = None) -> "EpisodeFrames":
        """Load episodes ``indices`` (default all) of a ``wmrl.kernel.storage.EpisodeStore``."""
        idx = list(range(len(store))) if indices is None else list(indices)
        return cls([store.episode(i) for i in idx], cameras=cameras, episode_ids=idx)

    # ------------------------------------------------------------------ properties
    @property
    def num_episodes(self) -> int:
        return len(self.lengths)

    @property
    def image_size(self) -> tuple[int, int]:
        return int(self.images.shape[2]), int(self.images.shape[3])

    @property
    def state_dim(self) -> int:
        return int(self.proprio.shape[1])

    @property
    def action_dim(self) -> int:
        return int(self.actions.shape[1])

    # ------------------------------------------------------------------ windows
    def window_starts(self, horizon: int) -> tuple[np.ndarray, np.ndarray]:
        """All valid ``(episode_pos, t)`` with ``t + horizon <= T - 1``, as two int64 arrays."""
        eps, ts = [], []
        for k, T in enumerate(self.lengths):
            n = int(T) - horizon
            if n > 0:
                eps.append(np.full(n, k))
                ts.append(np.arange(n))
        if not eps:
            raise ValueError(f"no episode is longer than the chunk length H={horizon}; "
                             f"lengths are {self.lengths.tolist()}")
        return np.concatenate(eps).astype(np.int64), np.concatenate(ts).astype(np.int64)

    def gripper_switch_starts(self, horizon: int, gripper_dim: int = -1,
                              closing_only: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """The windows of :meth:`window_starts` inside which the commanded gripper (action dim
        ``gripper_dim``; > 0 closed) switches: from open (<= 0, or the episode's start) to closed, and
        with ``closing_only=False`` also from closed to open. Two int64 arrays, possibly empty."""
        eps, ts = self.window_starts(horizon)
        closed = self.actions[:, gripper_dim] > 0
        steps = ts[:, None] + np.arange(horizon)[None]
        idx = self.offsets[eps][:, None] + steps
        before = np.where(steps > 0, closed[np.maximum(idx - 1, 0)], False)   # open before the first step
        switch = closed[idx] & ~before
        if not closing_only:
            switch |= ~closed[idx] & before
        keep = switch.any(1)
        return eps[keep], ts[keep]

    def windows(self, ep: np.ndarray, t: np.ndarray, horizon: int) -> Windows:
        """Gather windows at episode positions ``ep`` and steps ``t`` (int arrays of length B)."""
        ep = np.asarray(ep, dtype=np.int64)
        t = np.asarray(t, dtype=np.int64)
        if np.any(t + horizon > self.lengths[ep] - 1):
            raise ValueError("window runs past the end of its episode; use window_starts(horizon)")
        g = self.offsets[ep] + t
        act_idx = g[:, None] + np.arange(horizon)[None]
        return Windows(
            frames=torch.from_numpy(self.images[g]),
            proprio=torch.from_numpy(self.proprio[g]),
            actions=torch.from_numpy(self.actions[act_idx]),
            next_frames=torch.from_numpy(self.images[g + horizon]),
            next_proprio=torch.from_numpy(self.proprio[g + horizon]),
            episode=torch.from_numpy(ep),
            step=torch.from_numpy(t),
            prev_proprio=self.proprio_before(ep, t),
        )

    def proprio_before(self, ep: np.ndarray, t: np.ndarray) -> torch.Tensor:
        """``float32 (B, D_s)``: the proprio one step before step ``t`` of episode positions ``ep``
        (at ``t`` itself for ``t = 0``: the arm at rest), the velocity a dynamics model carries."""
        t = np.asarray(t, dtype=np.int64)
        return torch.from_numpy(self.proprio[self.offsets[np.asarray(ep, dtype=np.int64)] + t - (t > 0)])

    def sample_windows(self, batch_size: int, horizon: int, rng: np.random.Generator) -> Windows:
        eps, ts = self.window_starts(horizon)
        pick = rng.integers(0, len(eps), size=batch_size)
        return self.windows(eps[pick], ts[pick], horizon)

    def sample_paths(self, batch_size: int, steps: int, rng: np.random.Generator) -> dict[str, torch.Tensor]:
        """``batch_size`` random proprio paths of ``steps`` control steps (module docstring):
        ``{"proprio": float32 (B, steps + 2, D_s), "actions": float32 (B, steps, D_a)}``, starting at
        ``t >= 1`` with ``t + steps <= T - 1``.

        Raises:
            ValueError: no episode has more than ``steps + 1`` steps.
        """
        n = self.lengths - steps - 1    # starts t = 1 .. T - 1 - steps per episode
        ok = np.flatnonzero(n > 0)
        if len(ok) == 0:
            raise ValueError(f"no episode is longer than {steps + 1} steps (lengths {self.lengths.tolist()}); "
                             "shorten the dynamics' unrolled window")
        ep = ok[rng.integers(0, len(ok), size=batch_size)]
        t = 1 + (rng.random(batch_size) * n[ep]).astype(np.int64)
        g = self.offsets[ep] + t
        return {"proprio": torch.from_numpy(self.proprio[g[:, None] - 1 + np.arange(steps + 2)[None]]),
                "actions": torch.from_numpy(self.actions[g[:, None] + np.arange(steps)[None]])}

    # ------------------------------------------------------------------ frames (critic)
    def frame_labels(self, success_tail: int, fail_progress: float) -> tuple[np.ndarray, np.ndarray]:
        """Per-step critic targets over all steps (flat, aligned with ``self.images``).

        Progress of a successful episode rises linearly with time, ``t / (T - 1)`` (RISE-style
        progress from time); of a failed episode ``fail_progress * t / (T - 1)``. The success label
        is 1 on the last ``success_tail`` steps of successful episodes and 0 elsewhere.

        Returns:
            ``progress float32 (N_steps,)`` in [0, 1] and ``success float32 (N_steps,)`` in {0, 1}.
        """
        prog, succ = [], []
        for k, T in enumerate(self.lengths):
            frac = np.arange(T, dtype=np.float32) / max(int(T) - 1, 1)
            s = np.zeros(T, dtype=np.float32)
            if self.success[k]:
                prog.append(frac)
                s[max(0, int(T) - success_tail):] = 1.0
            else:
                prog.append(fail_progress * frac)
            succ.append(s)
        return np.concatenate(prog), np.concatenate(succ)

    def obs_at(self, ep: int, t: int) -> Obs:
        """The stored observation at step ``t`` of episode position ``ep`` as a batch-1 ``Obs``."""
        g = int(self.offsets[ep] + t)
        img = torch.from_numpy(self.images[g: g + 1])
        return Obs(images=split_cameras(img, self.cameras), proprio=torch.from_numpy(self.proprio[g: g + 1]),
                   task=[self.instructions[ep]])

    def step_index(self, ep: int, t: int) -> int:
        return int(self.offsets[ep] + t)
