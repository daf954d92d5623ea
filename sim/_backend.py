"""Import MuJoCo and robosuite without needing (or creating) a GL context.

``import mujoco`` raises at import time when ``MUJOCO_GL`` holds an unknown value, and robosuite
overwrites ``MUJOCO_GL`` with ``"egl"`` when it is imported (``robosuite.macros.MUJOCO_GPU_RENDERING``).
Physics must work whatever ``MUJOCO_GL`` says, and rendering must fail with a message naming it, so
this module records the user's ``MUJOCO_GL`` first, imports both libraries with a neutral value
when needed, and restores the variable afterwards. ``requested_gl()`` returns what the user asked for.
"""

from __future__ import annotations

import logging
import os
import sys

_UNSET = object()
_REQUESTED = os.environ.get("MUJOCO_GL", None)
_MUJOCO_VALID = ("", "enable", "enabled", "on", "true", "1", "glfw", "glx", "egl", "osmesa",
                 "disable", "disabled", "off", "false", "0")

_mods: dict = {}


def requested_gl() -> str | None:
    """The ``MUJOCO_GL`` value the process started with (``None`` when unset)."""
    return _REQUESTED


def _import():
    if _mods:
        return _mods
    before = os.environ.get("MUJOCO_GL", None)
    bad = before is not None and before.lower().strip() not in _MUJOCO_VALID
    if bad:
        os.environ["MUJOCO_GL"] = "disable"
    try:
        import mujoco  # noqa: F401
        import robosuite  # noqa: F401
        from robosuite.utils import binding_utils  # noqa: F401  (this is where robosuite edits MUJOCO_GL)
    finally:
        if before is None:
            os.environ.pop("MUJOCO_GL", None)
        else:
            os.environ["MUJOCO_GL"] = before
    # robosuite logs every controller-config load at INFO; keep warnings only
    logging.getLogger("robosuite_logs").setLevel(logging.WARNING)
    _mods["mujoco"] = sys.modules["mujoco"]
    _mods["robosuite"] = sys.modules["robosuite"]
    return _mods


def mujoco():
    """The ``mujoco`` module, imported safely (see module docstring)."""
    return _import()["mujoco"]


def robosuite():
    """The ``robosuite`` module, imported safely (see module docstring)."""
    return _import()["robosuite"]
