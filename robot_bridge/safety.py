"""Safety layer of the robot client: command clipping and the server watchdog.

Every command goes through :meth:`SafetyFilter.clip` before it reaches the robot:

* command limits: each action dimension clipped to ``[low, high]`` (the controller's range, or
  joint limits for joint-position robots);
* rate (velocity) limit: the change from the previous command is at most ``max_delta`` per step
  and dimension (``inf``: off);
* workspace: for delta end-effector actions (``OSC_POSE`` delta, ``mode="delta"``), the
  end-effector position the command would reach, ``proprio[pos_index] + pos_scale * action[:3]``,
  is kept inside the box ``[workspace_low, workspace_high]`` (m, robot base frame); the translation
  is shortened so that the target lies on the box. For absolute end-effector targets
  (``mode="absolute"``, e.g. ``suite=ee``'s ``(x, y, z, yaw, gripper)``) the target itself,
  ``action[pos_dims]`` (m), is clipped to the box.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class SafetyLimits:
    """Limits applied to every command (see module docstring).

    Attributes:
        low, high: per-dimension command range (``D_a`` values or a scalar).
        max_delta: largest change between consecutive commands per dimension (scalar or ``D_a``);
            ``None`` disables the rate limit.
        workspace_low, workspace_high: ``(3,)`` end-effector box in m, or ``None`` (off).
        pos_index: index of the end-effector x in ``proprio`` (``D_s = 9`` Panda layout: 0).
        pos_dims: indices of the action's x, y, z translation.
        pos_scale: metres per unit of translation action (robosuite OSC_POSE ``output_max``: 0.05;
            delta mode only).
        mode: ``"delta"`` (translation relative to the current pose, scaled by ``pos_scale``) or
            ``"absolute"`` (translation = target position in m), as the robot's ``ActionSpace.mode``.
    """

    low: float | list[float] = -1.0
    high: float | list[float] = 1.0
    max_delta: float | list[float] | None = None
    workspace_low: list[float] | None = None
    workspace_high: list[float] | None = None
    pos_index: int = 0
    pos_dims: list[int] = field(default_factory=lambda: [0, 1, 2])
    pos_scale: float = 0.05
    mode: str = "delta"


class SafetyFilter:
    """Clips commands to :class:`SafetyLimits`; remembers the previous command for the rate limit.

    ``clip(action (D_a,), proprio (D_s,) | None) -> (clipped float32 (D_a,), flags)``, ``flags`` a
    set of the limits that were active (``"range"``, ``"rate"``, ``"workspace"``, ``"nonfinite"``).
    A non-finite command is replaced by ``hold``.
    """

    def __init__(self, limits: SafetyLimits, action_dim: int):
        self.limits = limits
        self.action_dim = action_dim
        self.low = np.broadcast_to(np.asarray(limits.low, np.float32), (action_dim,)).copy()
        self.high = np.broadcast_to(np.asarray(limits.high, np.float32), (action_dim,)).copy()
        if np.any(self.low > self.high):
            raise ValueError(f"SafetyLimits.low must be <= high, got {self.low} / {self.high}")
        if limits.mode not in ("delta", "absolute"):
            raise ValueError(f"SafetyLimits.mode must be 'delta' or 'absolute', got {limits.mode!r}")
        self.max_delta = (None if limits.max_delta is None else
                          np.broadcast_to(np.asarray(limits.max_delta, np.float32), (action_dim,)).copy())
        self.ws = None
        if limits.workspace_low is not None and limits.workspace_high is not None:
            self.ws = (np.asarray(limits.workspace_low, np.float64), np.asarray(limits.workspace_high, np.float64))
        self.prev: np.ndarray | None = None

    def reset(self) -> None:
        self.prev = None

    def clip(self, action: np.ndarray, proprio: np.ndarray | None = None,
             hold: np.ndarray | None = None) -> tuple[np.ndarray, set[str]]:
        a = np.asarray(action, dtype=np.float32).reshape(-1).copy()
        if a.shape[0] != self.action_dim:
            raise ValueError(f"command has {a.shape[0]} values, the robot takes D_a={self.action_dim}")
        flags: set[str] = set()
        if not np.isfinite(a).all():
            flags.add("nonfinite")
            a = np.zeros_like(a) if hold is None else np.asarray(hold, np.float32).copy()
        c = np.clip(a, self.low, self.high)
        if not np.array_equal(c, a):
            flags.add("range")
        a = c
        if self.max_delta is not None and self.prev is not None:
            c = np.clip(a, self.prev - self.max_delta, self.prev + self.max_delta)
            if not np.array_equal(c, a):
                flags.add("rate")
            a = c
        if self.ws is not None and self.limits.mode == "absolute":
            dims = self.limits.pos_dims
            t = a[dims].astype(np.float64)
            c = np.clip(t, *self.ws)
            if not np.array_equal(c, t):
                a[dims] = c.astype(np.float32)
                flags.add("workspace")
        elif self.ws is not None and proprio is not None:
            lo, hi = self.ws
            i0 = self.limits.pos_index
            pos = np.asarray(proprio, np.float64)[i0:i0 + 3]
            dims = self.limits.pos_dims
            d = a[dims].astype(np.float64) * self.limits.pos_scale
            target = pos + d
            if np.any(target < lo) or np.any(target > hi):
                # per-axis: never move further out of the box; inside, stop on its face
                d_new = np.clip(target, np.minimum(lo, pos), np.maximum(hi, pos)) - pos
                a[dims] = (d_new / self.limits.pos_scale).astype(np.float32)
                flags.add("workspace")
        self.prev = a.copy()
        return a, flags


class Watchdog:
    """Fires when nothing was heard from the server for ``timeout_s`` seconds.

    ``kick()`` on every received message; ``expired()`` is checked every control tick.
    """

    def __init__(self, timeout_s: float, clock=time.monotonic):
        if timeout_s <= 0:
            raise ValueError(f"watchdog timeout must be > 0 s, got {timeout_s}")
        self.timeout_s = float(timeout_s)
        self.clock = clock
        self.last = clock()

    def kick(self) -> None:
        self.last = self.clock()

    def silence_s(self) -> float:
        return self.clock() - self.last

    def expired(self) -> bool:
        return self.silence_s() > self.timeout_s
