"""What a policy-server session has already planned for its robot: the actions of every chunk it
computed in the current episode, by control step, so that a request sent while earlier ones are
still in flight continues them (real-time chunking with overlapping requests).

Why the server and not the robot. With more than one request in flight (``robot_bridge.timing``)
the robot asks for chunk ``k+1`` before chunk ``k`` has arrived: its committed actions (the RTC
prefix it sends) lack chunk ``k``'s, which will have replaced part of its queue by the time
chunk ``k+1`` arrives. The server computed chunk ``k`` itself, before chunk ``k+1`` (one session
computes its requests in order), so it knows every action the robot's queue will hold once the
chunks in flight are in. The robot's queue is the overlay of the chunks it received, the newest
observation winning per step (``robot_bridge.queue``); this record is the same overlay of the
chunks the server computed, a superset. The prefix a request is answered with is therefore, from
its step on, the recorded action where there is one and the robot's committed action otherwise
(contiguous, at most ``H``); the RTC delay (``delay_steps``, the steps the robot expects to run
before the chunk arrives) freezes its first actions. The chunks' own frozen actions equal the
prefix they were given, so the record stays what the robot will execute as long as each chunk
arrives within its delay (the robot estimates the delay from a high quantile of its round trips).

A request of another episode, or of a step not after the session's previous request (a robot
never sends two requests for the same step), starts a new record.
"""

from __future__ import annotations

import numpy as np

from robot_bridge.queue import StepOverlay


class SessionPlan:
    """Per-step record of the actions a session computed for the current episode.

    ``compose`` and ``record`` are called by the session's one compute thread, in request order.
    """

    def __init__(self):
        self.episode: int | None = None
        self.last_step = -1
        self._steps = StepOverlay()  # the overlay of the chunks computed this episode, newest observation per step
        self.mismatches = 0  # committed actions of the robot that differed from the record

    def _begin(self, episode: int, step: int) -> None:
        if episode != self.episode or step <= self.last_step:
            self.episode = episode
            self._steps.clear()
        self.last_step = step
        self._steps.drop_before(step)

    def compose(self, episode: int, step: int, committed: np.ndarray | None, horizon: int) -> np.ndarray | None:
        """The prefix ``float32 (P, D_a)`` a request of ``episode`` at control ``step`` continues:
        for steps ``step, step+1, ...`` the recorded action, else the robot's ``committed``
        action (``float32 (P_r, D_a)`` for steps ``step ..``, or ``None``), contiguous, at most
        ``horizon``. ``None`` when there is none."""
        self._begin(int(episode), int(step))
        n_c = 0 if committed is None else len(committed)
        out = []
        for i in range(int(horizon)):
            a = self._steps.actions.get(step + i)
            if a is not None:
                if i < n_c and not np.allclose(committed[i], a, atol=1e-5):
                    self.mismatches += 1
            elif i < n_c:
                a = np.asarray(committed[i], np.float32)
            else:
                break
            out.append(a)
        return np.stack(out).astype(np.float32) if out else None

    def record(self, episode: int, start_step: int, actions: np.ndarray) -> None:
        """Record a computed chunk ``float32 (H, D_a)`` for steps ``start_step ..`` of ``episode``
        (after :meth:`compose` of its request); a step keeps the action of the newest chunk."""
        if int(episode) != self.episode:
            return
        self._steps.put(np.asarray(actions, np.float32), int(start_step))
