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


# robosuite warns at import about optional packages for other robots (GR1's whole-body IK, the
# robosuite_models robot zoo), which the Panda scenes here do not use, and recommends writing a private
# macro file into its own install (setup_macros.py), which wmrl does not need (sim/_backend handles
# MUJOCO_GL itself).
_IRRELEVANT_WARNINGS = ("Could not import robosuite_models", "Could not load the mink-based whole-body IK",
                        "No private macro file found",
                        "It is recommended to use a private macro file", "robosuite/scripts/setup_macros.py")


class _DropIrrelevant(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not any(s in msg for s in _IRRELEVANT_WARNINGS)


def _quiet_robosuite_logger() -> logging.Logger:
    """robosuite's logger prints through its own console handler *and* propagates to the root logger
    (Hydra's console and log file), so every message appeared twice. ``_import`` keeps the propagation
    (one line, also in the run's log file) and drops robosuite's console handler
    (:func:`_drop_robosuite_console`); this adds the filter of :data:`_IRRELEVANT_WARNINGS`."""
    lg = logging.getLogger("robosuite_logs")
    if not any(isinstance(f, _DropIrrelevant) for f in lg.filters):
        lg.addFilter(_DropIrrelevant())
    return lg


def _drop_robosuite_console(lg: logging.Logger) -> None:
    for h in list(lg.handlers):
        if type(h) is logging.StreamHandler:   # robosuite's console handler (a FileHandler, if any, stays)
            lg.removeHandler(h)


def _import():
    if _mods:
        return _mods
    lg = _quiet_robosuite_logger()      # before the import: the warnings are logged while importing
    propagate, lg.propagate = lg.propagate, False   # while robosuite's own console handler exists
    logging.getLogger("OpenGL").setLevel(logging.WARNING)   # PyOpenGL logs "No OpenGL_accelerate" etc. at INFO
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
        _drop_robosuite_console(lg)
        lg.propagate = propagate
    # robosuite logs every controller-config load at INFO; keep warnings only
    lg.setLevel(logging.WARNING)
    _mods["mujoco"] = sys.modules["mujoco"]
    _mods["robosuite"] = sys.modules["robosuite"]
    return _mods


def mujoco():
    """The ``mujoco`` module, imported safely (see module docstring)."""
    return _import()["mujoco"]


def robosuite():
    """The ``robosuite`` module, imported safely (see module docstring)."""
    return _import()["robosuite"]
