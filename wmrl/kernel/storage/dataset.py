"""Training windows over an :class:`EpisodeStore` as a ``torch.utils.data.Dataset``, and a masked
loss that ignores padded targets.

Window at (episode ``e``, step ``t``) of an episode with ``T`` steps (``0 <= t < T``; every step is
a valid sample):

==================  ==========================  ==================================================
key                 dtype / shape               meaning
==================  ==========================  ==================================================
``images[cam]``     uint8 ``(n_obs, 3, Hi, Wi)``  observations ``t-n_obs+1 .. t`` (oldest first);
                                                before step 0 they repeat step 0
``proprio``         float32 ``(n_obs, D_s)``    same steps
``obs_pad``         bool ``(n_obs,)``           True where the history left the episode
``actions``         float32 ``(H, D_a)``        action chunk ``t .. t+H-1``; past ``T-1`` repeats
                                                the last action
``rewards``         float32 ``(H,)``            rewards of the same steps (same padding)
``action_pad``      bool ``(H,)``               True past the episode end
``future_images``   uint8 ``(F, 3, Hi, Wi)``    only with ``n_future=F > 0``: observations
                                                ``t+1 .. t+F`` (repeat step ``T-1`` past the end)
``future_proprio``  float32 ``(F, D_s)``        same steps
``future_pad``      bool ``(F,)``               True past the last observation
``instruction``     str                         language instruction
``task_name``       str                         task id
``success``         bool                        episode success flag
``episode``         int64                       episode index in the store
``step``            int64                       ``t``
``length``          int64                       ``T``
==================  ==========================  ==================================================

Use :func:`masked_mse` with ``action_pad`` (or :func:`wmrl.kernel.tensors.masked_mean` with ``~action_pad``) so that padded targets do not
enter a loss (Diffusion Policy and LeRobot train with the same ``action_is_pad`` mask).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset
from tqdm import tqdm

from wmrl.kernel.storage.episode_store import EpisodeStore, window_indices
from wmrl.kernel.tensors import expand_keep, masked_mean


class WindowDataset(Dataset):
    """All (episode, step) windows of a store, as torch tensors (see the module docstring).

    Args:
        store: the :class:`EpisodeStore` (or a path to one).
        n_obs: observation history length (>= 1).
        horizon: action chunk length ``H`` (>= 1).
        n_future: number of future observations to return (0: none).
        cameras: cameras to load (default all; ``[]`` for none).
        episodes: subset of episode indices (e.g. a train split); default all.
        in_memory: load every array once into contiguous numpy arrays (fast pure-numpy indexing,
            recommended for the small datasets here); otherwise each item is read from zarr.

    ``len(ds)`` is the number of steps of the selected episodes; ``ds[k]`` one window;
    :meth:`get_batch` a whole batch at once (vectorised, in-memory only).
    """

    def __init__(self, store: EpisodeStore | str, n_obs: int = 1, horizon: int = 1, n_future: int = 0,
                 cameras: Sequence[str] | None = None, episodes: Sequence[int] | None = None,
                 in_memory: bool = True, progress: bool = False):
        if not isinstance(store, EpisodeStore):
            store = EpisodeStore.open(store, mode="r")
        window_indices(1, 0, n_obs, horizon, n_future)  # validates the sizes
        self.store = store
        self.n_obs, self.horizon, self.n_future = int(n_obs), int(horizon), int(n_future)
        self.cameras = list(store.cameras) if cameras is None else list(cameras)
        for c in self.cameras:
            if c not in store.cameras:
                raise ValueError(f"unknown camera {c!r}; the store has {list(store.cameras)}")
        self.episodes = np.arange(len(store), dtype=np.int64) if episodes is None else \
            np.asarray([store._check_index(int(e)) for e in episodes], dtype=np.int64)
        lengths = store.lengths[self.episodes] if len(self.episodes) else np.zeros(0, np.int64)
        self.lengths = lengths
        self.offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)  # into flat arrays
        # sample k -> (position p in self.episodes, step t)
        self._pos = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
        self._t = np.arange(int(lengths.sum()), dtype=np.int64) - self.offsets[self._pos]
        self.in_memory = bool(in_memory)
        idx = store._index
        self._instr = [idx[e]["instruction"] for e in self.episodes]
        self._task = [idx[e]["task_name"] for e in self.episodes]
        self._succ = np.asarray([bool(idx[e]["success"]) for e in self.episodes], dtype=bool)
        if self.in_memory:
            it = tqdm(self.episodes, desc="loading windows", disable=not progress)
            parts: dict[str, list[np.ndarray]] = {"proprio": [], "actions": [], "rewards": []}
            imgs: dict[str, list[np.ndarray]] = {c: [] for c in self.cameras}
            for e in it:
                for k in parts:
                    parts[k].append(store.array(int(e), k))
                for c in self.cameras:
                    imgs[c].append(store.array(int(e), f"images/{c}"))
            cat = (lambda xs, shape, dt: np.concatenate(xs) if xs else np.zeros(shape, dt))
            self._proprio = cat(parts["proprio"], (0, store.state_dim), np.float32)
            self._actions = cat(parts["actions"], (0, store.action_dim), np.float32)
            self._rewards = cat(parts["rewards"], (0,), np.float32)
            self._images = {c: cat(imgs[c], (0, 3, *store.cameras[c]), np.uint8) for c in self.cameras}

    def __len__(self) -> int:
        return int(self._t.shape[0])

    def index_of(self, k: int) -> tuple[int, int]:
        """(episode index in the store, step) of sample ``k``."""
        return int(self.episodes[self._pos[k]]), int(self._t[k])

    def _flat_indices(self, ks: np.ndarray):
        """Vectorised window indices into the flat in-memory arrays for samples ``ks (B,)``."""
        pos, t = self._pos[ks], self._t[ks]
        start, T = self.offsets[pos][:, None], self.lengths[pos][:, None]
        tt = t[:, None]
        o = tt + np.arange(-self.n_obs + 1, 1)[None]
        a = tt + np.arange(self.horizon)[None]
        f = tt + np.arange(1, self.n_future + 1)[None]
        return (start + np.maximum(o, 0), o < 0, start + np.minimum(a, T - 1), a >= T,
                start + np.minimum(f, T - 1), f >= T, pos, t)

    def get_batch(self, ks: Sequence[int] | np.ndarray | torch.Tensor) -> dict[str, Any]:
        """Windows of samples ``ks`` stacked with a leading batch dim ``B`` (in-memory only);
        ``instruction`` and ``task_name`` are lists of ``B`` strings."""
        if not self.in_memory:
            items = [self[int(k)] for k in np.asarray(ks).reshape(-1)]
            return torch.utils.data.default_collate(items)
        ks = np.asarray(ks, dtype=np.int64).reshape(-1)
        n = len(self)
        if ks.size and (ks.min() < -n or ks.max() >= n):
            raise IndexError(f"sample index out of range for a dataset of {n} windows")
        ks = np.where(ks < 0, ks + n, ks)
        oi, op, ai, ap, fi, fp, pos, t = self._flat_indices(ks)
        out: dict[str, Any] = {
            "images": {c: torch.from_numpy(v[oi]) for c, v in self._images.items()},
            "proprio": torch.from_numpy(self._proprio[oi]),
            "obs_pad": torch.from_numpy(op),
            "actions": torch.from_numpy(self._actions[ai]),
            "rewards": torch.from_numpy(self._rewards[ai]),
            "action_pad": torch.from_numpy(ap),
        }
        if self.n_future:
            out["future_images"] = {c: torch.from_numpy(v[fi]) for c, v in self._images.items()}
            out["future_proprio"] = torch.from_numpy(self._proprio[fi])
            out["future_pad"] = torch.from_numpy(fp)
        out["instruction"] = [self._instr[p] for p in pos]
        out["task_name"] = [self._task[p] for p in pos]
        out["success"] = torch.from_numpy(self._succ[pos])
        out["episode"] = torch.from_numpy(self.episodes[pos])
        out["step"] = torch.from_numpy(t.copy())
        out["length"] = torch.from_numpy(self.lengths[pos])
        return out

    def __getitem__(self, k: int) -> dict[str, Any]:
        k = int(k)
        n = len(self)
        if not -n <= k < n:
            raise IndexError(f"window {k} out of range for a dataset of {n} windows")
        k %= n
        if self.in_memory:
            b = self.get_batch([k])
            return {key: ({c: v[0] for c, v in val.items()} if isinstance(val, dict) else val[0])
                    for key, val in b.items()}
        e, t = self.index_of(k)
        w = self.store.window(e, t, self.n_obs, self.horizon, self.n_future, cameras=self.cameras)
        out: dict[str, Any] = {}
        for key, val in w.items():
            if isinstance(val, dict):
                out[key] = {c: torch.from_numpy(np.ascontiguousarray(v)) for c, v in val.items()}
            elif isinstance(val, np.ndarray):
                out[key] = torch.from_numpy(np.ascontiguousarray(val))
            elif isinstance(val, (bool, int)) and key in ("success", "episode", "step", "length"):
                out[key] = torch.tensor(val)
            else:
                out[key] = val
        return out

    def sample_batch(self, batch_size: int, generator: torch.Generator | None = None) -> dict[str, Any]:
        """A batch of ``batch_size`` windows drawn uniformly with replacement."""
        ks = torch.randint(0, len(self), (int(batch_size),), generator=generator)
        return self.get_batch(ks.numpy())


def masked_mse(pred: torch.Tensor, target: torch.Tensor, pad_mask: torch.Tensor) -> torch.Tensor:
    """Mean squared error over non-padded entries.

    Args:
        pred, target: float ``(B, H, D)`` (any trailing dims).
        pad_mask: bool ``(B, H)`` (a prefix of ``pred.shape``), True where the target is padding
            (``action_pad`` / ``future_pad`` of a window).

    Padded targets are replaced by ``pred.detach()`` before the difference, so their value (1e6,
    inf, NaN) changes neither the loss nor the gradient.
    """
    if pred.shape != target.shape:
        raise ValueError(f"pred {tuple(pred.shape)} and target {tuple(target.shape)} differ in shape")
    pad = torch.as_tensor(pad_mask, device=pred.device)
    if pad.dtype != torch.bool:
        raise ValueError(f"pad_mask must be bool (True = padded), got {pad.dtype}")
    keep = ~pad
    target = torch.where(expand_keep(keep, pred), target, pred.detach())
    return masked_mean((pred - target) ** 2, keep)
