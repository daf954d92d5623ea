"""LIBERO-style Panda tabletop suite on robosuite: tasks, stored init states, scripted experts and
the batched chunk environment ``SimEnv``.

Importing ``sim`` loads neither MuJoCo nor robosuite and never creates a GL context; the names below
are imported on first use. See ``sim.suite.Suite`` for the entry point.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "Suite": "sim.suite", "DEFAULT_TASKS": "sim.suite", "TASKS": "sim.tasks", "TaskSpec": "sim.tasks",
    "get_task": "sim.tasks", "SimEnv": "sim.env", "TaskEnv": "sim.env", "ScriptedExpert": "sim.expert",
    "ExpertActor": "sim.expert", "RenderSettings": "sim.render", "collect_episodes": "sim.collect",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'sim' has no attribute {name!r}")
