"""Worker processes that die with their parent.

:func:`worker_pool` is the ``ProcessPoolExecutor`` (spawn context) that collection and evaluation
use for ``workers=N``. Each worker asks the kernel to send it ``SIGKILL`` when the process that
started it dies (Linux ``prctl(PR_SET_PDEATHSIG)``), so a ``wmrl collect workers=2`` killed with
``kill -9`` leaves no worker computing on: the workers go at once, and with them the last holders of
multiprocessing's resource-tracker pipe, which then exits too. Where ``prctl`` is missing (not Linux)
the workers check every second whether their parent is gone and exit.

The same for ``wmrl`` commands run as child processes (``wmrl bench bridge`` starts ``wmrl serve``
and ``wmrl robot``): start them with ``env=child_env()``; ``wmrl.cli`` calls
:func:`die_with_parent_from_env` first thing, so a killed benchmark leaves no policy server behind.
``PR_SET_PDEATHSIG`` fires when the *thread* that started the child ends: start children from a
thread that lives as long as they should (the main thread).
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


PARENT_ENV = "WMRL_DIE_WITH_PARENT"


def child_env(env: dict | None = None) -> dict:
    """``env`` (default ``os.environ``) plus ``WMRL_DIE_WITH_PARENT=<this pid>``: the environment
    for a ``wmrl`` command that must die with this process (see :func:`die_with_parent_from_env`)."""
    return {**(os.environ if env is None else env), PARENT_ENV: str(os.getpid())}


def die_with_parent_from_env() -> None:
    """In a ``wmrl`` command started with :func:`child_env`: get ``SIGKILL`` when the parent dies
    (exit now if it is gone already). The variable is removed, so this command's own children do
    not inherit it. Started through a wrapper (e.g. a shell), it dies with the wrapper."""
    pid = os.environ.pop(PARENT_ENV, "")
    if not pid.isdigit():
        return
    parent = int(pid)
    if os.getppid() != parent:
        try:
            os.kill(parent, 0)
        except ProcessLookupError:
            os._exit(1)  # the parent died before this command got here
        parent = os.getppid()  # a wrapper between us: die with it
    _die_with_parent(parent)


def worker_pool(workers: int):
    """``ProcessPoolExecutor(workers)`` with spawned processes that die with this one."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    return ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_die_with_parent,
                               initargs=(os.getpid(),))
