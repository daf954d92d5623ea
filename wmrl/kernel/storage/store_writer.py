"""Crash-safe writing of an :class:`~wmrl.kernel.storage.EpisodeStore`: fsync helpers, the atomic
index replacement, the creation of a new store folder, one episode's zarr group, and the append lock.

The order that makes appends crash-safe (see ``episode_store.py``): the episode group is written
(and fsynced when ``durable``), then :func:`_write_index` commits it by ``os.replace`` of
``index.json``. A new store is built in a hidden sibling and renamed into place by
:func:`_create_store_folder`. Errors: :class:`~wmrl.kernel.storage.errors.StoreExistsError` when the
path of a new store is taken; other ``OSError`` s pass through unchanged.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import zarr
from zarr.codecs import ZstdCodec

from wmrl.kernel.leftovers import temp_sibling
from wmrl.kernel.storage.errors import StoreExistsError
from wmrl.kernel.storage.store_layout import (
    _IMAGE_CHUNK_BYTES,
    _META_ATTR,
    FORMAT_VERSION,
    INDEX_FILE,
    LOCK_FILE,
)
from wmrl.kernel.types import Episode


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



@contextlib.contextmanager
def building_folder(target: Path, kind: str) -> Iterator[Path]:
    """Yield the hidden sibling ``.<name>.<kind>-<pid>-<thread>`` of ``target`` to build it in
    (:func:`wmrl.kernel.leftovers.temp_sibling`: leftovers of dead writers are removed first, the
    folder itself does not exist yet) and remove what is left of it on exit: all of it after an
    error, nothing once the caller has renamed it into place. Errors of the body pass through."""
    tmp = temp_sibling(target, kind)
    try:
        yield tmp
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _create_store_folder(path: Path, meta: dict, overwrite: bool, durable: bool) -> None:
    """Build an empty store with metadata ``meta`` in a hidden sibling of ``path`` and rename it to
    ``path`` (replacing an existing one when ``overwrite``); see :meth:`EpisodeStore.create`.

    Raises:
        StoreExistsError: ``path`` exists (or was created meanwhile) and ``overwrite`` is false.
    """
    if path.exists() and not overwrite:
        raise _exists_error(path)
    with building_folder(path, "creating") as tmp:
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


def _write_episode_group(root: zarr.Group, meta: dict, group_path: str, ep: Episode) -> None:
    """Write the validated episode ``ep`` as the zarr group ``group_path`` of ``root`` (arrays listed
    in ``episode_store.py``: images uint8 zstd-compressed in chunks of about 1 MiB, proprio/actions/
    rewards float32, sim_states float64, extras as given)."""
    T = ep.length
    state_dim = int(meta["state_dim"])
    # attributes go in with the group: one zarr.json write instead of one per key
    g = root.create_group(group_path, attributes={
        "success": bool(ep.success),
        "instruction": str(ep.instruction),
        "task_name": str(ep.task_name),
        "info": ep.info or {},
        "length": int(T),
        "extras": sorted(ep.extras or {}),
        "has_sim_states": ep.sim_states is not None,
    })
    img_comp = [ZstdCodec(level=1)]
    if meta["cameras"]:
        ig = g.create_group("images")
        for cam, (h, w) in meta["cameras"].items():
            tc = max(1, min(T, _IMAGE_CHUNK_BYTES // (3 * h * w)))
            ig.create_array(cam, data=np.ascontiguousarray(ep.images[cam]), chunks=(tc, 3, h, w),
                            compressors=img_comp)
    g.create_array("proprio", data=np.asarray(ep.proprio, dtype=np.float32).reshape(T, state_dim))
    g.create_array("actions", data=np.asarray(ep.actions, dtype=np.float32))
    g.create_array("rewards", data=np.asarray(ep.rewards, dtype=np.float32).reshape(T))
    if ep.sim_states is not None:
        g.create_array("sim_states", data=np.asarray(ep.sim_states, dtype=np.float64))
    if ep.extras:
        xg = g.create_group("extras")
        for k, v in ep.extras.items():
            xg.create_array(k, data=np.ascontiguousarray(np.asarray(v)))


def _clean_orphans(path: Path, names: set[str]) -> None:
    """Remove episode groups of ``path`` not in ``names`` (the indexed ones) and temp index files of
    writers killed mid-commit."""
    ep_root = path / "episodes"
    for p in ep_root.iterdir():
        if p.is_dir() and p.name.startswith("ep_") and p.name not in names:
            shutil.rmtree(p, ignore_errors=True)
    for p in path.glob(f".{INDEX_FILE}.tmp-*"):  # temp index of a writer killed mid-commit
        p.unlink(missing_ok=True)


@contextlib.contextmanager
def _append_lock(path: Path):
    """Hold the exclusive ``fcntl`` lock on ``path/.append.lock`` (one appender at a time)."""
    with open(path / LOCK_FILE, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
