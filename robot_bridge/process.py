"""Process-level latency settings for the bridge's processes (robot node, policy server)."""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger("robot_bridge.process")


def tune_process(nice: int | None = None, switch_interval_s: float | None = 0.001) -> dict:
    """Apply latency settings to the current process; returns what was applied.

    Args:
        nice: niceness to set (negative = scheduled before ordinary processes, as control
            processes of real robots are; needs privileges: a refusal is logged and reported,
            not raised). ``None``: unchanged.
        switch_interval_s: Python's GIL switch interval (default 5 ms). A shorter one lets the
            bridge's I/O threads take the GIL sooner while another thread computes. ``None``:
            unchanged.
    """
    out: dict = {}
    if switch_interval_s is not None:
        sys.setswitchinterval(float(switch_interval_s))
        out["switch_interval_s"] = sys.getswitchinterval()
    if nice is not None:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, int(nice))
            out["nice"] = os.getpriority(os.PRIO_PROCESS, 0)
        except (PermissionError, OSError) as e:
            log.warning("could not set niceness %s: %s", nice, e)
            out["nice_error"] = str(e)
    return out
