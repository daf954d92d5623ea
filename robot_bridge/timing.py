"""Request timing of the robot client: when to ask for the next action chunk, from the measured
round trip, and what to do when no timing can keep the action queue fed.

Pure bookkeeping: no clock, no threads, no I/O. The caller (``robot_bridge.client.RobotClient``,
under its lock) passes the current time and the control step, so the tests drive it with a fake
clock.

Model (control period ``dt`` s, chunk length ``H`` steps, margin ``m`` steps). A chunk requested
with the observation of step ``k`` holds actions for steps ``k .. k+H-1``; it arrives after the
round trip ``L`` (observation capture to chunk in the queue, inference included) and can first
fill step ``k + R`` with ``R = floor(L / dt) + 1`` (the first tick after it arrived). The queue
(with the chunks in flight) holds actions up to step ``E``. A request is *due* at step ``k`` when
a chunk asked for now would be the last that still arrives before the actions run out:

    E + 1 - k <= max(request_threshold, R + m)

with ``E`` counting the chunks already in flight (``s_j + H - 1`` for a request sent at step
``s_j``), so requests go out every ``P = H - R - m`` steps and ``ceil(R / P)`` of them are in
flight at once when the round trip is longer than half a chunk. That is the schedule of
asynchronous inference (LeRobot 0.6.1 ``async_inference``, which asks when the queue falls below
a fraction of ``H``) with the threshold taken from the measured latency and with more than one
request in flight, as real-time chunking needs beyond ``H / 2`` of delay (Black et al. 2025,
"Real-Time Execution of Action Chunking Flow Policies", section 4). Never two requests for the
same step, at most ``max_inflight`` in flight, and an unanswered request stops counting after
``request_timeout_s``.

``R`` comes from :class:`LatencyEstimate` (a high order statistic of the recent round trips that
ignores one slow outlier); a request older than ``R + m`` steps is *overdue* and its chunk no
longer counts in ``E`` (it still counts in flight until answered or timed out), so a late chunk
or a rising latency makes the next request go out at once. Before the first measurement the client assumes the longest round trip it can
still keep up with (``H - m - 2`` steps: a request every 2 steps), unless ``initial_latency_s``
says otherwise, so a slow first chunk does not leave the robot without actions while a fast one
costs at most an extra request.

Keeping up needs ``P = H - R - m >= 1`` and ``ceil(R / P) <= max_inflight``. When the estimate
(with at least ``min_samples`` round trips, so a cold first call never decides it) says it
cannot, :meth:`RequestTimer.check_fallback` decides once per episode the configured safe
behaviour: ``hold`` (keep the rate; the robot holds its position on every tick without an
action, requests continue at ``max_inflight``) or ``slow`` (the control period is multiplied by
``slow_factor`` for the rest of the episode, which shortens ``R`` in steps). The decision is a
:class:`Fallback`, recorded in the episode.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass

FALLBACKS = ("hold", "slow")


@dataclass(frozen=True)
class TimingConfig:
    """Settings of :class:`RequestTimer` (see the module docstring).

    Attributes:
        chunk_size: ``H``, actions per chunk (the server's ``Ready.chunk_size``).
        margin_steps: ``m``, steps of safety between a chunk's expected arrival and the end of
            the queued actions.
        request_threshold: request at the latest when this many actions remain (a floor: at low
            latency it sets how often the robot re-plans).
        max_inflight: requests in flight at once (>= 1).
        request_timeout_s: an unanswered request stops counting as in flight after this long (s).
        initial_latency_s: round trip assumed before the first measurement (s); ``None``: the
            longest one the schedule can keep up with.
        fallback: ``"hold"`` or ``"slow"``, when no schedule can keep up.
        slow_factor: control period multiplier of ``fallback="slow"`` (> 1).
        min_samples: round trips measured before a fallback can be decided (>= 1).

    Raises:
        ValueError: an unknown ``fallback``, ``slow_factor <= 1``, ``max_inflight < 1``,
            ``chunk_size < 1`` or ``min_samples < 1``.
    """

    chunk_size: int = 16
    margin_steps: int = 1
    request_threshold: int = 8
    max_inflight: int = 4
    request_timeout_s: float = 2.0
    initial_latency_s: float | None = None
    fallback: str = "hold"
    slow_factor: float = 2.0
    min_samples: int = 3

    def __post_init__(self):
        if self.fallback not in FALLBACKS:
            raise ValueError(f"fallback must be one of {FALLBACKS}, got {self.fallback!r}")
        if not float(self.slow_factor) > 1.0:
            raise ValueError(f"slow_factor must be > 1 (the control period is multiplied by it), got {self.slow_factor}")
        for name in ("max_inflight", "chunk_size", "min_samples"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class LatencyEstimate:
    """Robust round-trip estimate (s): the second largest of the last ``window`` round trips (the
    only one while there is one), ``None`` before any.

    An order statistic near the top (about the 94th percentile of 16) requests early enough for
    nearly every chunk, and it ignores a single slow outlier (a cold first call, a scheduling
    hiccup): the estimate only rises once two round trips were that slow. It falls back once the
    slow ones have left the window.

    Args:
        window: round trips kept (>= 2).
    """

    def __init__(self, window: int = 16):
        if int(window) < 2:
            raise ValueError(f"latency window must hold >= 2 round trips, got {window}")
        self.recent: deque[float] = deque(maxlen=int(window))
        self.count = 0

    def add(self, round_trip_s: float) -> None:
        """Add one measured round trip (s); non-finite or negative values are ignored."""
        if math.isfinite(round_trip_s) and round_trip_s >= 0:
            self.recent.append(float(round_trip_s))
            self.count += 1

    @property
    def value_s(self) -> float | None:
        if not self.recent:
            return None
        s = sorted(self.recent)
        return s[-2] if len(s) >= 2 else s[-1]


@dataclass
class Request:
    """A request :meth:`RequestTimer.due` decided to send: its id, control step, the steps
    expected to run before its chunk arrives (``delay_steps``, the RTC delay, ``<= H``) and the
    requests then in flight, itself included."""

    request_id: int
    step: int
    delay_steps: int
    inflight: int


@dataclass
class Fallback:
    """The safe behaviour decided when the schedule cannot keep up.

    Attributes:
        mode: ``"hold"`` or ``"slow"``.
        step: control step of the decision.
        latency_s: the round-trip estimate that decided it (s).
        latency_steps: ``R`` at the rate before the decision.
        control_hz_before, control_hz_after: control rate before and after (Hz; equal for hold).
        keeps_up_after: whether the schedule keeps up at the rate after.
    """

    mode: str
    step: int
    latency_s: float
    latency_steps: int
    control_hz_before: float
    control_hz_after: float
    keeps_up_after: bool

    def as_dict(self) -> dict:
        return asdict(self)


class RequestTimer:
    """When to request the next chunk (see the module docstring); one per link, reset per episode.

    Args:
        config: :class:`TimingConfig`.
        estimate: the link's :class:`LatencyEstimate` (kept across episodes).
    """

    def __init__(self, config: TimingConfig, estimate: LatencyEstimate | None = None):
        self.cfg = config
        self.estimate = estimate or LatencyEstimate()
        self.dt = 0.05
        self.next_id = 0
        self.begin_episode(self.dt)

    def begin_episode(self, dt: float) -> None:
        """Forget the requests in flight and the fallback; control period ``dt`` (s)."""
        self.dt = float(dt)
        self.inflight: dict[int, tuple[int, float]] = {}  # request id -> (step, sent at s)
        self.last_step = -1
        self.fallback: Fallback | None = None
        self.timeouts = 0
        self.max_inflight_seen = 0

    # ------------------------------------------------------------------ latency in steps
    def steps_for(self, latency_s: float, dt: float | None = None) -> int:
        """``R = floor(latency / dt) + 1``: the first step after ``latency_s`` (s)."""
        return math.floor(latency_s / (dt or self.dt) + 1e-9) + 1

    def cold_steps(self) -> int:
        """``R`` assumed before the first measurement."""
        if self.cfg.initial_latency_s is not None:
            return self.steps_for(float(self.cfg.initial_latency_s))
        return max(1, self.cfg.chunk_size - self.cfg.margin_steps - 2)

    def latency_steps(self) -> int:
        """``R`` from the estimate (or the cold assumption before the first measurement)."""
        est = self.estimate.value_s
        return self.cold_steps() if est is None else self.steps_for(est)

    def overdue(self, sent_at: float, now: float) -> bool:
        """Whether a request sent at ``sent_at`` (s) should have been answered by ``now`` (s):
        older than ``R + m`` steps."""
        return now - sent_at > (self.latency_steps() + self.cfg.margin_steps) * self.dt

    def keeps_up(self, r: int) -> bool:
        """Whether requests every ``P = H - r - m`` steps, ``ceil(r / P)`` in flight, are possible."""
        p = self.cfg.chunk_size - r - self.cfg.margin_steps
        return p >= 1 and math.ceil(r / p) <= self.cfg.max_inflight

    # ------------------------------------------------------------------ requests
    def supply_end(self, queued_end: int, now: float) -> int:
        """The last step with an action queued (``queued_end``) or coming with a chunk in flight
        that is not overdue (a late chunk is not counted on: the next request goes out in time
        for the steps it would have filled)."""
        ends = [s + self.cfg.chunk_size - 1 for s, t in self.inflight.values() if not self.overdue(t, now)]
        return max([queued_end, *ends])

    def due(self, step: int, queued_end: int, now: float) -> Request | None:
        """The request to send at control step ``step`` (time ``now``, s) or ``None``.

        ``queued_end``: last step with a queued action (``step - 1`` when the queue is dry).
        The returned request counts as in flight until :meth:`answered` or its timeout.
        """
        for rid, (_, t) in list(self.inflight.items()):
            if now - t > self.cfg.request_timeout_s:
                del self.inflight[rid]
                self.timeouts += 1
        if step <= self.last_step or len(self.inflight) >= self.cfg.max_inflight:
            return None
        r = self.latency_steps()
        left = self.supply_end(queued_end, now) + 1 - step
        if left > max(self.cfg.request_threshold, r + self.cfg.margin_steps):
            return None
        self.next_id += 1
        self.inflight[self.next_id] = (step, now)
        self.last_step = step
        self.max_inflight_seen = max(self.max_inflight_seen, len(self.inflight))
        return Request(self.next_id, step, min(r, self.cfg.chunk_size), len(self.inflight))

    def answered(self, request_id: int) -> None:
        """A chunk or an error for ``request_id`` arrived (unknown ids are ignored)."""
        self.inflight.pop(request_id, None)

    # ------------------------------------------------------------------ fallback
    def check_fallback(self, step: int) -> Fallback | None:
        """Decide the fallback at ``step`` when the estimate (``>= min_samples`` round trips) says
        the schedule cannot keep up; once per episode. ``slow`` multiplies :attr:`dt`. Returns the
        new decision, else ``None``."""
        est = self.estimate.value_s
        if self.fallback is not None or est is None or len(self.estimate.recent) < self.cfg.min_samples:
            return None
        r = self.steps_for(est)
        if self.keeps_up(r):
            return None
        hz = 1.0 / self.dt
        dt_after = self.dt * (float(self.cfg.slow_factor) if self.cfg.fallback == "slow" else 1.0)
        self.fallback = Fallback(mode=self.cfg.fallback, step=int(step), latency_s=float(est), latency_steps=r,
                                 control_hz_before=hz, control_hz_after=1.0 / dt_after,
                                 keeps_up_after=self.keeps_up(self.steps_for(est, dt_after)))
        self.dt = dt_after
        return self.fallback
