"""When and how often the robot (re)opens its link to the policy server: :class:`ReconnectPolicy`
(exponential backoff) and :func:`with_retry`. Used by ``robot_bridge.client.RobotClient`` and
``wmrl robot``.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

log = logging.getLogger("robot_bridge.client")


@dataclass
class ReconnectPolicy:
    """When and how often :meth:`RobotClient.connect_with_retry` tries to (re)open the link to the
    policy server: at start, after the server went away, or when it answered ``[busy]``.

    Attributes:
        attempts: tries after the first failed one (0: give up at once).
        backoff_s: wait before the first retry (s); each further wait doubles ...
        backoff_max_s: ... up to this (s).
        give_up_after_s: no retry starts later than this after the first failure (s); ``None``:
            only ``attempts`` bounds the retries.

    Raises:
        ValueError: a negative ``attempts`` or wait, or ``backoff_max_s < backoff_s``.
    """

    attempts: int = 8
    backoff_s: float = 0.5
    backoff_max_s: float = 5.0
    give_up_after_s: float | None = 60.0

    def __post_init__(self):
        if self.attempts < 0 or self.backoff_s < 0 or self.backoff_max_s < self.backoff_s:
            raise ValueError(f"ReconnectPolicy needs attempts >= 0 and 0 <= backoff_s <= backoff_max_s, got "
                             f"attempts={self.attempts}, backoff_s={self.backoff_s}, backoff_max_s={self.backoff_max_s}")
        if self.give_up_after_s is not None and self.give_up_after_s < 0:
            raise ValueError(f"give_up_after_s must be >= 0 s or None, got {self.give_up_after_s}")

    def wait_s(self, retry: int) -> float:
        """Wait before retry number ``retry`` (0-based): ``min(backoff_s * 2**retry, backoff_max_s)``."""
        return min(self.backoff_s * 2.0 ** min(retry, 60), self.backoff_max_s)


def with_retry(fn: Callable[[], Any], policy: ReconnectPolicy | None = None, stop: threading.Event | None = None):
    """``fn()`` retried per ``policy`` (default: no retry) while ``stop`` is not set, after a
    ``ConnectionError`` or ``TimeoutError``; each failed try is logged in one line (what failed,
    when the next try is). Returns what ``fn`` returned.

    Raises:
        ConnectionError: the last failure (with the number of tries when there were several),
            once the policy gives up or ``stop`` was set.
    """
    pol = policy or ReconnectPolicy(attempts=0)
    t_first = None
    retry = 0
    while True:
        try:
            return fn()
        except (ConnectionError, TimeoutError) as e:
            err = str(e)
        now = time.monotonic()
        t_first = now if t_first is None else t_first
        wait = pol.wait_s(retry)
        late = pol.give_up_after_s is not None and now + wait - t_first > pol.give_up_after_s
        if retry >= pol.attempts or late or (stop is not None and stop.is_set()):
            tries = f"; gave up after {retry + 1} attempts in {now - t_first:.1f} s" if retry else ""
            raise ConnectionError(err + tries)
        retry += 1
        log.warning("%s; retry %d of %d in %.1f s", err, retry, pol.attempts, wait)
        if stop is not None:
            stop.wait(wait)
        else:
            time.sleep(wait)
