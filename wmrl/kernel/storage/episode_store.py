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
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import math
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import zarr
from zarr.codecs import ZstdCodec

from wmrl.kernel.leftovers import temp_sibling
from wmrl.kernel.storage.errors import (
    EpisodeValidationError,
    StoreError,
    StoreExistsError,
    StoreFormatError,
)
from wmrl.kernel.storage.normalize import NormStats
from wmrl.kernel.types import ActionSpace, Episode

FORMAT_VERSION = 1
SUPPORTED_FORMAT_VERSIONS = (1,)
INDEX_FILE = "index.json"
LOCK_FILE = ".append.lock"
_META_ATTR = "wmrl"
_IMAGE_CHUNK_BYTES = 1 << 20


def _episode_name(i: int) -> str:
    return f"ep_{i:06d}"


def _first_bad_step(x: np.ndarray) -> int:
    bad = ~np.isfinite(x)
    return int(np.argwhere(bad)[0][0])


def _fsync_tree(path: Path) -> None:
    """fsync every file and folder under ``path`` (data on disk before the index names it)."""
    for root, _dirs, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(root))


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
        meta = self._root.attrs.get(_META_ATTR)
        if not isinstance(meta, dict):
            raise StoreFormatError(f"{self.path} is a zarr group but not an EpisodeStore "
                                   f"(no {_META_ATTR!r} attribute in zarr.json)")
        version = meta.get("format_version")
        if version not in SUPPORTED_FORMAT_VERSIONS:
            raise StoreFormatError(
                f"{self.path}: unknown EpisodeStore format_version {version!r}; this wmrl reads "
                f"versions {list(SUPPORTED_FORMAT_VERSIONS)}. Upgrade wmrl or re-import the data.")
        for key in ("cameras", "state_dim", "action_dim", "fps", "action_space"):
            if key not in meta:
                raise StoreFormatError(f"{self.path}: store metadata lacks {key!r} (corrupt zarr.json)")
        self._meta = meta
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
        if path.exists() and not overwrite:
            raise _exists_error(path)
        tmp = temp_sibling(path, "creating")
        try:
            root = zarr.open_group(str(tmp), mode="w", zarr_format=3)
            root.create_group("episodes")
            root.attrs[_META_ATTR] = meta
            _write_index(tmp, [], durable=durable)
            if durable:
                _fsync_tree(tmp)
            if overwrite and (path.exists() or path.is_symlink()):
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
            _rename_new(tmp, path)
            if durable:
                _fsync_dir(path.parent)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
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
        with self._append_lock():
            index = _read_index(self.path)
            i = len(index)
            name = _episode_name(i)
            ep_dir = self.path / "episodes" / name
            if ep_dir.exists():  # orphan of a killed append: never indexed, nobody reads it
                shutil.rmtree(ep_dir)
            try:
                self._write_episode_group(f"episodes/{name}", episode)
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
            self._clean_orphans()
        return i

    def _write_episode_group(self, group_path: str, ep: Episode) -> None:
        T = ep.length
        # attributes go in with the group: one zarr.json write instead of one per key
        g = self._root.create_group(group_path, attributes={
            "success": bool(ep.success),
            "instruction": str(ep.instruction),
            "task_name": str(ep.task_name),
            "info": ep.info or {},
            "length": int(T),
            "extras": sorted(ep.extras or {}),
            "has_sim_states": ep.sim_states is not None,
        })
        img_comp = [ZstdCodec(level=1)]
        if self._meta["cameras"]:
            ig = g.create_group("images")
            for cam, (h, w) in self._meta["cameras"].items():
                tc = max(1, min(T, _IMAGE_CHUNK_BYTES // (3 * h * w)))
                ig.create_array(cam, data=np.ascontiguousarray(ep.images[cam]), chunks=(tc, 3, h, w),
                                compressors=img_comp)
        g.create_array("proprio", data=np.asarray(ep.proprio, dtype=np.float32).reshape(T, self.state_dim))
        g.create_array("actions", data=np.asarray(ep.actions, dtype=np.float32))
        g.create_array("rewards", data=np.asarray(ep.rewards, dtype=np.float32).reshape(T))
        if ep.sim_states is not None:
            g.create_array("sim_states", data=np.asarray(ep.sim_states, dtype=np.float64))
        if ep.extras:
            xg = g.create_group("extras")
            for k, v in ep.extras.items():
                xg.create_array(k, data=np.ascontiguousarray(np.asarray(v)))

    def _clean_orphans(self) -> None:
        names = {e["name"] for e in self._index}
        ep_root = self.path / "episodes"
        for p in ep_root.iterdir():
            if p.is_dir() and p.name.startswith("ep_") and p.name not in names:
                shutil.rmtree(p, ignore_errors=True)
        for p in self.path.glob(f".{INDEX_FILE}.tmp-*"):  # temp index of a writer killed mid-commit
            p.unlink(missing_ok=True)

    @contextlib.contextmanager
    def _append_lock(self):
        with open(self.path / LOCK_FILE, "a+") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

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


def _store_meta(cameras: Mapping[str, tuple[int, int]], state_dim: int, action_dim: int, fps: float,
                action_space: ActionSpace | Mapping, embodiment: str, source: str, info: Mapping | None) -> dict:
    """The metadata of a new store (see :class:`EpisodeStore`), checked; :class:`StoreError` names the
    first inconsistent argument."""
    if isinstance(action_space, Mapping):
        action_space = ActionSpace.from_dict(dict(action_space))
    if int(action_space.dim) != int(action_dim):
        raise StoreError(f"action_dim={action_dim} but action_space.dim={action_space.dim}; "
                         "make them equal")
    if int(state_dim) < 0 or int(action_dim) <= 0:
        raise StoreError(f"need state_dim >= 0 and action_dim > 0, got {state_dim}, {action_dim}")
    if not (math.isfinite(float(fps)) and float(fps) > 0):
        raise StoreError(f"fps must be a positive number, got {fps!r}")
    cams: dict[str, list[int]] = {}
    for name, hw in dict(cameras).items():
        hw = [int(v) for v in hw]
        if len(hw) != 2 or min(hw) <= 0 or "/" in name or not name:
            raise StoreError(f"camera {name!r}: expected a name without '/' and (Hi, Wi) > 0, got {hw}")
        cams[str(name)] = hw
    if info is not None:
        try:
            json.dumps(dict(info))
        except TypeError as e:
            raise StoreError(f"store info is not JSON-serialisable: {e}") from None
    return {
        "format_version": FORMAT_VERSION,
        "cameras": cams,
        "state_dim": int(state_dim),
        "action_dim": int(action_dim),
        "fps": float(fps),
        "action_space": action_space.to_dict(),
        "embodiment": str(embodiment),
        "source": str(source),
        "info": dict(info or {}),
    }


def _exists_error(path: Path) -> StoreExistsError:
    return StoreExistsError(f"{path} already exists; pass overwrite=True to replace it or "
                            "EpisodeStore.open(path, mode='a') to append to it")


def _rename_new(tmp: Path, path: Path) -> None:
    """Rename the finished folder ``tmp`` to ``path``; :class:`StoreExistsError` when ``path`` is
    taken (by a process that created it first), other ``OSError`` s unchanged."""
    try:
        os.rename(tmp, path)
    except OSError as e:
        if e.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
            raise _exists_error(path) from None
        raise


def window_indices(T: int, t: int, n_obs: int, horizon: int, n_future: int = 0):
    """Index arrays of one window in an episode of ``T`` steps at step ``t``.

    Returns ``(obs_idx, obs_pad, act_idx, act_pad, fut_idx, fut_pad)``: ``obs_idx int64 (n_obs,)``
    = ``t-n_obs+1 .. t`` clipped at 0 (padding repeats step 0, ``obs_pad`` True there);
    ``act_idx (horizon,)`` = ``t .. t+horizon-1`` clipped at ``T-1`` (padding repeats the last
    action, ``act_pad`` True there); ``fut_idx (n_future,)`` = ``t+1 .. t+n_future`` clipped at
    ``T-1`` (``fut_pad`` True past the episode's last observation).
    """
    if n_obs < 1 or horizon < 1 or n_future < 0:
        raise ValueError(f"need n_obs >= 1, horizon >= 1, n_future >= 0; got {n_obs}, {horizon}, {n_future}")
    o = t + np.arange(-n_obs + 1, 1, dtype=np.int64)
    a = t + np.arange(horizon, dtype=np.int64)
    f = t + np.arange(1, n_future + 1, dtype=np.int64)
    return (np.maximum(o, 0), o < 0, np.minimum(a, T - 1), a >= T, np.minimum(f, T - 1), f >= T)


# ---------------------------------------------------------------------- index file
def _read_index(path: Path) -> list[dict]:
    p = path / INDEX_FILE
    if not p.is_file():
        raise StoreFormatError(f"{path}: missing {INDEX_FILE}; not an EpisodeStore or a corrupt one")
    try:
        d = json.loads(p.read_text())
        if d.get("format_version") not in SUPPORTED_FORMAT_VERSIONS:
            raise StoreFormatError(f"{p}: unknown EpisodeStore format_version {d.get('format_version')!r}; "
                                   f"this wmrl reads versions {list(SUPPORTED_FORMAT_VERSIONS)}")
        eps = d["episodes"]
        for e in eps:
            e["name"], e["length"]  # noqa: B018 - presence check
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise StoreFormatError(f"{p} is corrupt ({type(e).__name__}: {e})") from None
    return eps


def _write_index(path: Path, episodes: list[dict], durable: bool = True) -> None:
    """Atomically replace ``index.json`` (write a temp file, fsync it if ``durable``, os.replace,
    fsync the folder if ``durable``). os.replace alone is atomic for readers and process kills."""
    tmp = path / f".{INDEX_FILE}.tmp-{os.getpid()}"
    data = json.dumps({"format_version": FORMAT_VERSION, "episodes": episodes}, indent=1)
    with open(tmp, "w") as f:
        f.write(data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path / INDEX_FILE)
    if durable:
        _fsync_dir(path)


# ---------------------------------------------------------------------- validation
def _plain(x: Any) -> Any:
    """numpy / torch scalars and arrays inside ``info`` -> plain JSON types (others unchanged)."""
    if isinstance(x, Mapping):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().tolist()
    return x


def _coerce_episode(ep: Episode) -> Episode:
    """A shallow copy of ``ep`` with torch tensors as numpy arrays and ``info`` as plain JSON types
    (dtypes and shapes are left for :func:`_validate_episode` to judge)."""
    if not isinstance(ep, Episode):
        return ep

    def arr(x):
        return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else x

    return dataclasses.replace(
        ep,
        images={k: arr(v) for k, v in (ep.images or {}).items()},
        proprio=arr(ep.proprio), actions=arr(ep.actions), rewards=arr(ep.rewards),
        sim_states=arr(ep.sim_states), extras={k: arr(v) for k, v in (ep.extras or {}).items()},
        success=bool(ep.success.item()) if isinstance(ep.success, (torch.Tensor, np.ndarray))
        and ep.success.dtype in (torch.bool, np.bool_) and ep.success.ndim == 0 else ep.success,
        info=_plain(ep.info or {}),
    )


def _validate_episode(ep: Episode, meta: dict, index: int | None) -> None:
    def err(msg: str, key: str | None = None, step: int | None = None):
        return EpisodeValidationError(msg, episode=index, key=key, step=step)

    if not isinstance(ep, Episode):
        raise err(f"expected a wmrl.kernel.types.Episode, got {type(ep).__name__}")
    D_s, D_a = int(meta["state_dim"]), int(meta["action_dim"])

    def as_float(key: str, x, shape: tuple) -> np.ndarray:
        try:
            a = np.asarray(x)
        except Exception as e:  # noqa: BLE001 - anything that is not array-like
            raise err(f"not array-like ({e})", key) from None
        if a.dtype.kind not in "fiub":
            raise err(f"must hold numbers, got dtype {a.dtype}", key)
        if a.shape != shape:
            raise err(f"expected shape {shape}, got {a.shape}", key)
        if a.size and not np.isfinite(a).all():
            s = _first_bad_step(a)
            bad = a[s][~np.isfinite(a[s])] if a.ndim > 1 else a[s]
            raise err(f"holds non-finite values ({np.ravel(bad)[:3].tolist()}); remove or fix that step", key, s)
        return a

    acts = np.asarray(ep.actions)
    if acts.ndim != 2:
        raise err(f"expected shape (T, D_a={D_a}), got {acts.shape}", "actions")
    T = int(acts.shape[0])
    if T < 1:
        raise err("episode has no steps (T=0)", "actions")
    if acts.shape[1] != D_a:
        raise err(f"action dim {acts.shape[1]} does not match the store's action_dim={D_a} "
                  f"(actions must be (T, {D_a}))", "actions")
    as_float("actions", acts, (T, D_a))
    prop = np.asarray(ep.proprio)
    if prop.ndim == 2 and prop.shape[0] == T and prop.shape[1] != D_s:
        raise err(f"state dim {prop.shape[1]} does not match the store's state_dim={D_s}", "proprio")
    as_float("proprio", prop, (T, D_s))
    as_float("rewards", ep.rewards, (T,))
    if ep.sim_states is not None:
        s = np.asarray(ep.sim_states)
        if s.ndim != 2:
            raise err(f"expected (T={T}, S), got {s.shape}", "sim_states")
        as_float("sim_states", s, (T, s.shape[1]))
    cams = meta["cameras"]
    got = set((ep.images or {}).keys())
    if got != set(cams):
        missing, extra = sorted(set(cams) - got), sorted(got - set(cams))
        raise err(f"cameras do not match the store's {sorted(cams)}: missing {missing}, unexpected {extra}",
                  "images")
    for cam, (h, w) in cams.items():
        img = ep.images[cam]
        key = f"images/{cam}"
        if not isinstance(img, np.ndarray):
            raise err(f"must be a numpy array, got {type(img).__name__}", key)
        if img.dtype != np.uint8:
            raise err(f"must be uint8 RGB, got dtype {img.dtype} (convert with (x*255).round().astype(np.uint8))",
                      key)
        if img.shape != (T, 3, h, w):
            hint = " (channel-last? transpose to (T, 3, Hi, Wi))" if img.shape == (T, h, w, 3) else ""
            raise err(f"expected shape {(T, 3, h, w)}, got {img.shape}{hint}", key)
    for k, v in (ep.extras or {}).items():
        if not isinstance(k, str) or not k or "/" in k:
            raise err(f"extras keys must be non-empty strings without '/', got {k!r}", "extras")
        a = np.asarray(v)
        if a.ndim < 1 or a.shape[0] != T:
            raise err(f"must have leading dim T={T}, got shape {a.shape}", f"extras/{k}")
        if a.dtype.kind not in "fiub":
            raise err(f"must hold numbers or bools, got dtype {a.dtype}", f"extras/{k}")
    if not isinstance(ep.success, (bool, np.bool_)) and ep.success not in (0, 1):
        raise err(f"must be a bool, got {ep.success!r}", "success")
    for name, val in (("instruction", ep.instruction), ("task_name", ep.task_name)):
        if not isinstance(val, str):
            raise err(f"must be a str, got {type(val).__name__}", name)
    try:
        json.dumps(ep.info or {})
    except (TypeError, ValueError) as e:
        raise err(f"is not JSON-serialisable ({e}); use plain str/int/float/list/dict", "info") from None
