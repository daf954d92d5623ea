"""Crash-safe episode store on zarr v3.

Layout of a store folder ``PATH``::

    PATH/zarr.json                      root group; attribute "wmrl" = store metadata (see meta)
    PATH/index.json                     committed episodes, replaced atomically (os.replace)
    PATH/episodes/ep_000000/...         one zarr group per episode:
        images/<camera>   uint8   (T, 3, Hi, Wi)
        proprio           float32 (T, D_s)
        actions           float32 (T, D_a)
        rewards           float32 (T,)
        sim_states        float64 (T, S)          (optional)
        extras/<key>      any     (T, ...)        (optional)
        attributes: success, instruction, task_name, info

Crash safety: an append validates the whole episode first (nothing is written for bad input),
then writes the episode into its own group, and only then commits it by atomically replacing
``index.json``. Readers list only indexed episodes, so a writer killed at any moment (SIGKILL
included) leaves every earlier episode readable and the store shows only complete episodes; the
orphan group of the killed append is removed by the next append. Appends take an exclusive
``fcntl`` lock on ``PATH/.append.lock``, so several processes may append to one store; any number
of readers may open it meanwhile (call :meth:`EpisodeStore.refresh` to see newer episodes). A new
store is built in a hidden sibling ``.<name>.creating-<pid>-<thread>`` and renamed to ``PATH`` when complete,
so ``PATH`` is a whole store or absent, and processes (or threads) racing
:meth:`EpisodeStore.open_or_create` on one new path end with one store that they all append to.

The pieces live in sibling modules: ``store_layout.py`` (format constants, metadata schema, index
file, :func:`window_indices`), ``store_validation.py`` (episode checks before a write) and
``store_writer.py`` (fsync, atomic index replacement, new store folders, episode groups, append lock).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np
import zarr

from wmrl.kernel.storage.errors import (
    EpisodeValidationError,  # noqa: F401 - re-exported: raised by validate / append
    StoreError,
    StoreExistsError,
    StoreFormatError,
)
from wmrl.kernel.storage.normalize import NormStats
from wmrl.kernel.storage.store_layout import (
    _META_ATTR,
    FORMAT_VERSION,
    SUPPORTED_FORMAT_VERSIONS,
    _check_meta,
    _episode_name,
    _read_index,
    _store_meta,
    window_indices,
)
from wmrl.kernel.storage.store_validation import _coerce_episode, _validate_episode
from wmrl.kernel.storage.store_writer import (
    _append_lock,
    _clean_orphans,
    _create_store_folder,
    _fsync_tree,
    _write_episode_group,
    _write_index,
)
from wmrl.kernel.types import ActionSpace, Episode

__all__ = ["EpisodeStore", "FORMAT_VERSION", "SUPPORTED_FORMAT_VERSIONS", "window_indices"]


class EpisodeStore:
    """A folder of recorded episodes (zarr v3) with training windows and normalisation stats.

    Use :meth:`create` for a new store and :meth:`open` for an existing one; do not call the
    constructor directly.

    Metadata (``store.meta``, JSON): ``cameras`` ({name: [Hi, Wi]}), ``state_dim`` (``D_s``),
    ``action_dim`` (``D_a``), ``fps`` (control steps per second), ``action_space``
    (:meth:`wmrl.kernel.types.ActionSpace.to_dict`: delta/absolute, frame, gripper sign, range),
    ``embodiment`` (e.g. ``"panda"``), ``source`` (e.g. ``"scripted"``, ``"robomimic"``), ``info``
    (free JSON), ``format_version``.

    Errors: :class:`StoreError` (missing folder, wrong mode), :class:`StoreExistsError` (creating
    over an existing folder),
    :class:`StoreFormatError` (not a store, corrupt index, unknown ``format_version``),
    :class:`EpisodeValidationError` (an appended episode that does not fit; nothing is written).
    All subclass ``ValueError``.
    """

    def __init__(self, path: Path, mode: Literal["r", "a"], _token: object = None, durable: bool = True):
        if _token is not _OPEN_TOKEN:
            raise TypeError("use EpisodeStore.create(...) or EpisodeStore.open(...)")
        self.path = Path(path)
        self.mode = mode
        self.durable = bool(durable)
        self._root = zarr.open_group(str(self.path), mode="r" if mode == "r" else "r+")
        self._meta = _check_meta(self.path, self._root.attrs.get(_META_ATTR))
        self._index: list[dict] = []
        self.refresh()

    # ------------------------------------------------------------------ construction
    @classmethod
    def create(cls, path: str | os.PathLike, cameras: Mapping[str, tuple[int, int]], state_dim: int,
               action_dim: int, fps: float, action_space: ActionSpace | Mapping, embodiment: str = "",
               source: str = "", info: Mapping | None = None, overwrite: bool = False,
               durable: bool = True) -> "EpisodeStore":
        """Create an empty store (opened in mode ``"a"``).

        The store is built in a hidden sibling folder ``.<name>.creating-<pid>-<thread>`` and renamed to
        ``path`` when complete, so ``path`` appears whole or not at all: a process that opens it
        never finds a half-made store, and of several processes (or threads) creating one path at
        once exactly one succeeds (the others get :class:`StoreExistsError`). Sibling folders left by creators
        killed mid-way are removed.

        Args:
            path: folder to create.
            cameras: camera name -> ``(Hi, Wi)`` in pixels (may be empty for image-free stores).
            state_dim: ``D_s``; action_dim: ``D_a`` (must equal ``action_space.dim``).
            fps: control frequency in Hz.
            action_space: how actions are read (delta/absolute, frame, gripper sign).
            embodiment, source: free strings recorded in the metadata.
            info: extra JSON metadata.
            overwrite: replace an existing folder at ``path`` (otherwise :class:`StoreExistsError`).
            durable: fsync each episode's files before committing it, so that a committed
                episode also survives a power loss (process kills are survived either way).

        Raises:
            StoreExistsError: ``path`` exists (or was created by another process meanwhile) and
                ``overwrite`` is false.
            StoreError: inconsistent dims, bad fps, camera names or sizes, non-JSON ``info``.
        """
        path = Path(path)
        meta = _store_meta(cameras, state_dim, action_dim, fps, action_space, embodiment, source, info)
        _create_store_folder(path, meta, overwrite, durable)
        return cls(path, "a", _OPEN_TOKEN, durable=durable)

    @classmethod
    def open(cls, path: str | os.PathLike, mode: Literal["r", "a"] = "r", durable: bool = True) -> "EpisodeStore":
        """Open an existing store for reading (``"r"``) or appending (``"a"``; ``durable`` as in
        :meth:`create`)."""
        path = Path(path)
        if mode not in ("r", "a"):
            raise StoreError(f"mode must be 'r' or 'a', got {mode!r}")
        if not path.is_dir():
            raise StoreError(f"no EpisodeStore at {path} (folder missing); create one with EpisodeStore.create")
        if not (path / "zarr.json").is_file():
            raise StoreFormatError(f"{path} is not an EpisodeStore (no zarr.json)")
        return cls(path, mode, _OPEN_TOKEN, durable=durable)

    @classmethod
    def open_or_create(cls, path: str | os.PathLike, **create_kwargs: Any) -> "EpisodeStore":
        """Open ``path`` for appending if it is a store, else create it with ``create_kwargs`` (see
        :meth:`create`). Safe for several processes or threads at once: one creates the store, the
        others open that one.

        Raises:
            StoreError: the existing store has other cameras, dims or action space than requested,
                or ``create_kwargs`` are invalid.
            StoreFormatError: ``path`` exists but is not an EpisodeStore.
        """
        path = Path(path)
        if not path.exists():
            try:
                return cls.create(path, **create_kwargs)
            except StoreExistsError:
                pass  # another process created it meanwhile: open theirs
        store = cls.open(path, mode="a", durable=create_kwargs.get("durable", True))
        want = {
            "cameras": {k: [int(v) for v in hw] for k, hw in dict(create_kwargs.get("cameras", {})).items()},
            "state_dim": int(create_kwargs.get("state_dim", store.state_dim)),
            "action_dim": int(create_kwargs.get("action_dim", store.action_dim)),
        }
        asp = create_kwargs.get("action_space")
        if asp is not None:
            want["action_space"] = (ActionSpace.from_dict(dict(asp)) if isinstance(asp, Mapping) else asp).to_dict()
        for k, v in want.items():
            if store.meta[k] != v:
                raise StoreError(f"{path}: existing store has {k}={store.meta[k]!r}, requested {v!r}; "
                                 "use another path")
        return store

    # ------------------------------------------------------------------ metadata
    @property
    def meta(self) -> dict:
        """Store metadata (a copy), see the class docstring."""
        return json.loads(json.dumps(self._meta))

    @property
    def cameras(self) -> dict[str, tuple[int, int]]:
        return {k: (int(v[0]), int(v[1])) for k, v in self._meta["cameras"].items()}

    @property
    def state_dim(self) -> int:
        return int(self._meta["state_dim"])

    @property
    def action_dim(self) -> int:
        return int(self._meta["action_dim"])

    @property
    def fps(self) -> float:
        return float(self._meta["fps"])

    @property
    def action_space(self) -> ActionSpace:
        return ActionSpace.from_dict(self._meta["action_space"])

    def refresh(self) -> "EpisodeStore":
        """Re-read the index (a reader sees episodes committed since it opened)."""
        self._index = _read_index(self.path)
        return self

    def __len__(self) -> int:
        return len(self._index)

    @property
    def lengths(self) -> np.ndarray:
        """``int64 (N,)`` number of steps of each episode."""
        return np.asarray([e["length"] for e in self._index], dtype=np.int64)

    @property
    def successes(self) -> np.ndarray:
        """``bool (N,)`` success flag of each episode (read from the index, no array I/O)."""
        return np.asarray([bool(e["success"]) for e in self._index], dtype=bool)

    @property
    def task_names(self) -> list[str]:
        return [str(e.get("task_name", "")) for e in self._index]

    @property
    def instructions(self) -> list[str]:
        return [str(e.get("instruction", "")) for e in self._index]

    def __repr__(self) -> str:
        return (f"EpisodeStore({str(self.path)!r}, mode={self.mode!r}, episodes={len(self)}, "
                f"steps={int(self.lengths.sum())}, cameras={list(self._meta['cameras'])})")

    # ------------------------------------------------------------------ writing
    def validate(self, episode: Episode, index: int | None = None) -> None:
        """Check ``episode`` against the store without writing; raise :class:`EpisodeValidationError`
        naming episode, key and step of the first problem."""
        _validate_episode(_coerce_episode(episode), self._meta, index)

    def append(self, episode: Episode) -> int:
        """Validate, write and commit one episode; return its index.

        Crash-safe (see the module docstring). Raises :class:`EpisodeValidationError` for an episode
        that does not fit the store (nothing is written) and :class:`StoreError` in mode ``"r"``.
        """
        if self.mode != "a":
            raise StoreError(f"{self.path} is open read-only; use EpisodeStore.open(path, mode='a') to append")
        episode = _coerce_episode(episode)
        _validate_episode(episode, self._meta, len(self._index))
        with _append_lock(self.path):
            index = _read_index(self.path)
            i = len(index)
            name = _episode_name(i)
            ep_dir = self.path / "episodes" / name
            if ep_dir.exists():  # orphan of a killed append: never indexed, nobody reads it
                shutil.rmtree(ep_dir)
            try:
                _write_episode_group(self._root, self._meta, f"episodes/{name}", episode)
                if self.durable:
                    _fsync_tree(ep_dir)
            except BaseException:  # e.g. disk full or KeyboardInterrupt: drop the uncommitted group
                shutil.rmtree(ep_dir, ignore_errors=True)
                raise
            entry = {
                "name": name,
                "length": int(episode.length),
                "success": bool(episode.success),
                "task_name": str(episode.task_name),
                "instruction": str(episode.instruction),
            }
            _write_index(self.path, index + [entry], durable=self.durable)
            self._index = index + [entry]
            _clean_orphans(self.path, {e["name"] for e in self._index})
        return i

    # ------------------------------------------------------------------ reading
    def _check_index(self, i: int) -> int:
        n = len(self._index)
        if not isinstance(i, (int, np.integer)) or isinstance(i, bool):
            raise StoreError(f"episode index must be an int, got {type(i).__name__}")
        i = int(i)
        if i >= n and self.mode == "r":  # committed by a writer since we last looked?
            n = len(self.refresh())
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"episode {i} out of range: {self.path} holds {n} episodes")
        return i

    def _group(self, i: int) -> zarr.Group:
        name = self._index[i]["name"]
        try:
            return self._root[f"episodes/{name}"]
        except KeyError:
            raise StoreFormatError(f"{self.path}: indexed episode {i} ({name}) is missing on disk") from None

    def episode(self, i: int, cameras: list[str] | None = None, images: bool = True) -> Episode:
        """Read episode ``i`` (negative indices count from the end) as an :class:`Episode`.

        Args:
            cameras: subset of cameras to read (default all); ``images=False`` reads none.
        """
        i = self._check_index(i)
        g = self._group(i)
        attrs = dict(g.attrs)
        cams = [] if not images else (list(self._meta["cameras"]) if cameras is None else list(cameras))
        for c in cams:
            if c not in self._meta["cameras"]:
                raise StoreError(f"unknown camera {c!r}; the store has {list(self._meta['cameras'])}")
        imgs = {c: g[f"images/{c}"][:] for c in cams}
        extras = {k: g[f"extras/{k}"][:] for k in attrs.get("extras", [])}
        return Episode(
            images=imgs,
            proprio=g["proprio"][:],
            actions=g["actions"][:],
            rewards=g["rewards"][:],
            success=bool(attrs["success"]),
            instruction=str(attrs["instruction"]),
            task_name=str(attrs.get("task_name", "")),
            sim_states=g["sim_states"][:] if attrs.get("has_sim_states") else None,
            extras=extras,
            info=dict(attrs.get("info") or {}),
        )

    def array(self, i: int, key: str) -> np.ndarray:
        """One array of episode ``i``: ``"proprio"``, ``"actions"``, ``"rewards"``, ``"sim_states"``,
        ``"images/<camera>"`` or ``"extras/<key>"``."""
        i = self._check_index(i)
        g = self._group(i)
        try:
            return g[key][:]
        except KeyError:
            raise StoreError(f"episode {i} has no array {key!r}") from None

    def window(self, i: int, t: int, n_obs: int = 1, horizon: int = 1, n_future: int = 0,
               cameras: list[str] | None = None) -> dict[str, Any]:
        """Training window at episode ``i``, step ``t`` (read from disk; see
        :class:`wmrl.kernel.storage.WindowDataset` for the fast in-memory version and the key table)."""
        i = self._check_index(i)
        T = int(self._index[i]["length"])
        if not 0 <= int(t) < T:
            raise IndexError(f"step {t} out of range for episode {i} of length {T}")
        g = self._group(i)
        cams = list(self._meta["cameras"]) if cameras is None else list(cameras)
        obs_idx, obs_pad, act_idx, act_pad, fut_idx, fut_pad = window_indices(T, int(t), n_obs, horizon, n_future)
        lo, hi = int(obs_idx.min()), int(obs_idx.max()) + 1
        alo, ahi = int(act_idx.min()), int(act_idx.max()) + 1
        out: dict[str, Any] = {}
        out["images"] = {c: g[f"images/{c}"][lo:hi][obs_idx - lo] for c in cams}
        prop = g["proprio"]
        out["proprio"] = prop[lo:hi][obs_idx - lo]
        out["obs_pad"] = obs_pad
        out["actions"] = g["actions"][alo:ahi][act_idx - alo]
        out["rewards"] = g["rewards"][alo:ahi][act_idx - alo]
        out["action_pad"] = act_pad
        if n_future > 0:
            flo, fhi = int(fut_idx.min()), int(fut_idx.max()) + 1
            out["future_images"] = {c: g[f"images/{c}"][flo:fhi][fut_idx - flo] for c in cams}
            out["future_proprio"] = prop[flo:fhi][fut_idx - flo]
            out["future_pad"] = fut_pad
        e = self._index[i]
        out.update(instruction=e["instruction"], task_name=e["task_name"], success=bool(e["success"]),
                   episode=i, step=int(t), length=T)
        return out

    def stats(self, keys: tuple[str, ...] = ("proprio", "actions"),
              episodes: list[int] | None = None) -> NormStats:
        """Normalisation statistics over all steps of ``episodes`` (default all; pass the training
        split to keep validation episodes out), per key (see :class:`NormStats`)."""
        idx = list(range(len(self))) if episodes is None else [self._check_index(i) for i in episodes]
        if not idx:
            raise StoreError(f"{self.path}: no episodes selected; cannot compute normalisation statistics")
        data = {k: np.concatenate([self.array(i, k) for i in idx]) for k in keys}
        return NormStats.from_data(data)


_OPEN_TOKEN = object()
