"""Temporary folders left behind by killed writers.

wmrl writes a folder ``target`` atomically by building it in a hidden sibling named
``.<target name>.<kind>-<pid>`` or ``.<target name>.<kind>-<pid>-<thread id>`` (``kind`` e.g.
``tmp`` or ``old`` for checkpoints, ``partial`` for imports and exports, ``creating`` for a new
EpisodeStore; the thread id keeps threads of one process apart) and renaming it into place. A writer
killed with ``SIGKILL`` never reaches its clean-up, so the sibling stays; the next writer of the
same target finds it here by its name and removes it when the process ``<pid>`` is no longer
running (a folder of a live process is another writer's work in progress and is left alone).
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import threading
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger("wmrl.kernel.leftovers")


def pid_alive(pid: int) -> bool:
    """Whether a process with id ``pid`` is running (``os.kill(pid, 0)``; a process of another user,
    which we may not signal, counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def dead_writer_leftovers(target: str | os.PathLike, kinds: Iterable[str],
                          own_are_leftovers: bool = False) -> list[tuple[str, Path]]:
    """The siblings ``.<target name>.<kind>-<pid>[-<thread id>]`` of ``target`` whose writer is not
    running.

    Args:
        target: the folder the writers build (it need not exist; its parent may be missing).
        kinds: the ``<kind>`` words to look for; other names are ignored.
        own_are_leftovers: also return this process's own folders (for callers whose writes of one
            target never overlap within a process, so that a folder of ours is from an interrupted
            earlier write); by default they are kept, like those of any live process.

    Returns:
        ``(kind, path)`` pairs, in no particular order. Nothing is removed.
    """
    target = Path(target)
    kinds = set(kinds)
    if not target.parent.is_dir():
        return []
    out = []
    for p in target.parent.glob(f".{glob.escape(target.name)}.*-*"):
        kind, _, rest = p.name[len(target.name) + 2:].partition("-")
        pid, _, thread = rest.partition("-")
        if kind not in kinds or not pid.isdigit() or not (thread == "" or thread.isdigit()):
            continue
        if int(pid) == os.getpid():
            if own_are_leftovers:
                out.append((kind, p))
        elif not pid_alive(int(pid)):
            out.append((kind, p))
    return out


def remove_dead_writer_leftovers(target: str | os.PathLike, kinds: Iterable[str]) -> list[Path]:
    """Remove the folders (or files) :func:`dead_writer_leftovers` finds for ``target`` (this
    process's own are kept); return the removed paths. Removal errors are ignored (another cleaner
    may be removing the same folder)."""
    removed = []
    for _kind, p in dead_writer_leftovers(target, kinds):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(p)
        log.warning("removed %s, left by a killed writer of %s", p, target)
    return removed


def temp_sibling(target: str | os.PathLike, kind: str) -> Path:
    """The folder ``.<target name>.<kind>-<our pid>-<our thread id>`` in which to build ``target``
    before renaming it into place (so that threads and processes writing one target at once never
    share it), cleared first: the leftovers of that kind of dead writers of ``target`` are removed
    (:func:`remove_dead_writer_leftovers`) and so is an earlier one of this thread. The parent folder
    is created; the returned folder itself does not exist."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_writer_leftovers(target, (kind,))
    tmp = target.with_name(f".{target.name}.{kind}-{os.getpid()}-{threading.get_native_id()}")
    if tmp.is_dir() and not tmp.is_symlink():
        shutil.rmtree(tmp)
    elif tmp.exists() or tmp.is_symlink():
        tmp.unlink()
    return tmp
