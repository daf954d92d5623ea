"""Worker processes that die with their parent.

:func:`worker_pool` is the ``ProcessPoolExecutor`` (spawn context) that collection and evaluation
use for ``workers=N``. Each worker asks the kernel to send it ``SIGKILL`` when the process that
started it dies (Linux ``prctl(PR_SET_PDEATHSIG)``), so a ``wmrl collect workers=2`` killed with
``kill -9`` leaves no worker computing on: the workers go at once, and with them the last holders of
multiprocessing's resource-tracker pipe, which then exits too. Where ``prctl`` is missing (not Linux)
the workers check every second whether their parent is gone and exit.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time

PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    """Worker initializer: arrange to be killed when ``parent`` (the pool's creator) dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0:
            if os.getppid() != parent:       # the parent died before prctl took effect
                os._exit(1)
            return
    except (OSError, AttributeError):
        pass

    def watch():
        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(1.0)

    threading.Thread(target=watch, daemon=True, name="wmrl-parent-watch").start()


def worker_pool(workers: int):
    """``ProcessPoolExecutor(workers)`` with spawned processes that die with this one."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    return ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_die_with_parent,
                               initargs=(os.getpid(),))
