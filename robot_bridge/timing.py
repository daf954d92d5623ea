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

with ``E`` counting the chunks in flight (``s_j + H - 1`` for a request sent at step ``s_j``), so
requests go out every ``P = H - max(request_threshold, R + m)`` steps and ``ceil(R / P)`` of them
are in flight at once when the round trip is longer than what is left. That is the schedule of
asynchronous inference (LeRobot 0.6.1 ``async_inference``, which asks when the queue falls below
a fraction of ``H``) with the threshold taken from the measured latency and more than one request
in flight, as real-time chunking needs beyond ``H / 2`` of delay (Black et al. 2025, "Real-Time
Execution of Action Chunking Flow Policies", section 4). Never two requests for the same step, at
most ``max_inflight`` in flight, and an unanswered request stops counting after
``request_timeout_s``. A request older than ``R + m`` steps is *overdue*: its chunk no longer
counts in ``E``, so a late chunk makes the next request go out in time for the steps it would
have filled.

``L`` is :class:`LatencyEstimate` (a high order statistic of the recent round trips that ignores
one slow outlier) of the round trips *as with an idle server*: each chunk reports the part of its
server time spent waiting behind other requests (``ActionChunk.queue_s``), which is left out, so
requests in flight on a server that computes one at a time do not inflate the estimate. Each chunk
also reports how long it held the policy (``compute_s``; ``S``: the same order statistic). A
server that computes one request at a time finishes the requests in flight at
``A_j = max(t_j + L, A_{j-1} + S)`` (``A_0`` the last arrival); a request is held back while it
would only wait there (``now + L < A_last + S``), so no standing queue builds. Before the first
measurement ``L`` is twice the age of the oldest request in flight (a wait that has lasted ``a``
is as likely to end before ``2a`` as after: the median of Gott's 1993 "delta t" argument;
``initial_latency_s`` can say more), so a second request goes out early enough when the first
one takes long (a round trip of up to ``~0.65 H`` steps leaves no gap), without a burst of
requests that a server computing one at a time would have to work off.

Keeping up needs ``P = H - R - m >= 1``, ``ceil(R / P) <= max_inflight`` and ``P >= ceil(S / dt)``
(a policy that computes for more than ``H / 2`` steps on one GPU cannot keep up whatever the
timing: one chunk per ``S`` of which ``H - R`` actions are still ahead). When the estimate (with at
least ``min_samples`` round trips, so a cold first call never decides it) says it cannot,
:meth:`RequestTimer.check_fallback` decides once per episode the configured safe behaviour:
``hold`` (keep the rate; the robot holds its position on every tick without an action, requests
continue) or ``slow`` (the control period is multiplied by ``slow_factor`` for the rest of the
episode, which shortens ``R`` and ``S`` in steps). The decision is a :class:`Fallback`, recorded
in the episode.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass

FALLBACKS = ("hold", "slow")
COLD_INFLIGHT = 3  # requests in flight before the first round trip is measured


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
        initial_latency_s: round trip assumed before the first measurement (s); ``None``: only
            twice the age of the oldest request in flight.
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
        compute_s: the estimate of the server's time per request ``S`` (s).
        control_hz_before, control_hz_after: control rate before and after (Hz; equal for hold).
        keeps_up_after: whether the schedule keeps up at the rate after.
    """

    mode: str
    step: int
    latency_s: float
    latency_steps: int
    compute_s: float
    control_hz_before: float
    control_hz_after: float
    keeps_up_after: bool

    def as_dict(self) -> dict:
        return asdict(self)


class RequestTimer:
    """When to request the next chunk (see the module docstring); one per link, reset per episode.

    Args:
        config: :class:`TimingConfig`.
        estimate: the link's round-trip :class:`LatencyEstimate` (kept across episodes).
        service: the link's estimate of the server's time per request (``compute_s``).
    """

    def __init__(self, config: TimingConfig, estimate: LatencyEstimate | None = None,
                 service: LatencyEstimate | None = None):
        self.cfg = config
        self.estimate = estimate or LatencyEstimate()
        self.service = service or LatencyEstimate(self.estimate.recent.maxlen)
        self.dt = 0.05
        self.next_id = 0
        self.last_arrival: float | None = None  # time the last chunk arrived (s)
        self.begin_episode(self.dt)

    def begin_episode(self, dt: float) -> None:
        """Forget the requests in flight and the fallback; control period ``dt`` (s)."""
        self.dt = float(dt)
        self.inflight: dict[int, tuple[int, float]] = {}  # request id -> (step, sent at s)
        self.last_step = -1
        self.fallback: Fallback | None = None
        self.timeouts = 0
        self.max_inflight_seen = 0

    # ------------------------------------------------------------------ measurements
    def measured(self, round_trip_s: float, queue_s: float = 0.0, compute_s: float = 0.0,
                 now: float | None = None) -> None:
        """A chunk arrived at ``now`` (s), ``round_trip_s`` after its observation, of which it
        waited ``queue_s`` for the server and held the policy ``compute_s`` (s, as it reports)."""
        self.estimate.add(round_trip_s - min(max(queue_s, 0.0), round_trip_s))
        self.service.add(compute_s)
        if now is not None:
            self.last_arrival = now

    def sent(self, request_id: int, now: float) -> None:
        """The request ``request_id`` actually left at ``now`` (s): when the observation is read
        after :meth:`due` decided (frames read only for requests), its time in flight counts from
        here, or a slow observation would make it look overdue."""
        if request_id in self.inflight:
            self.inflight[request_id] = (self.inflight[request_id][0], now)

    def answered(self, request_id: int) -> None:
        """A chunk or an error for ``request_id`` arrived (unknown ids are ignored)."""
        self.inflight.pop(request_id, None)

    # ------------------------------------------------------------------ latency in steps
    def steps_for(self, latency_s: float, dt: float | None = None) -> int:
        """``R = floor(latency / dt) + 1``: the first step after ``latency_s`` (s)."""
        return math.floor(latency_s / (dt or self.dt) + 1e-9) + 1

    def latency_s(self, now: float) -> float:
        """``L`` (s): the estimate; before the first measurement ``initial_latency_s`` (or 0), at
        least twice the age of the oldest request in flight."""
        est = self.estimate.value_s
        if est is not None:
            return est
        oldest = min((t for _, t in self.inflight.values()), default=now)
        return max(float(self.cfg.initial_latency_s or 0.0), 2.0 * (now - oldest))

    def service_steps(self, dt: float | None = None) -> int:
        """``ceil(S / dt)``: the fewest steps between requests the server serves without a queue."""
        s = self.service.value_s
        return 0 if s is None else math.ceil(s / (dt or self.dt) - 1e-9)

    def server_free_at(self, now: float) -> float:
        """When the server is expected to be done with the requests in flight (s): ``A_last + S``."""
        lat, s = self.latency_s(now), self.service.value_s or 0.0
        a = self.last_arrival if self.last_arrival is not None else -math.inf
        for _, t in sorted(self.inflight.values()):
            a = max(t + lat, a + s)
        return a + s

    def keeps_up(self, r: int, s: int = 0) -> bool:
        """Whether requests every ``P = H - r - m`` steps, ``ceil(r / P)`` in flight, are possible on
        a server that serves one per ``s`` steps."""
        p = self.cfg.chunk_size - r - self.cfg.margin_steps
        return p >= max(1, s) and math.ceil(r / p) <= self.cfg.max_inflight

    # ------------------------------------------------------------------ requests
    def overdue(self, sent_at: float, now: float) -> bool:
        """Whether a request sent at ``sent_at`` (s) should have been answered by ``now`` (s):
        older than ``R + m`` steps."""
        return now - sent_at > (self.steps_for(self.latency_s(now)) + self.cfg.margin_steps) * self.dt

    def supply_end(self, queued_end: int, now: float) -> int:
        """The last step with an action queued (``queued_end``) or coming with a chunk in flight
        that is not overdue."""
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
        cap = self.cfg.max_inflight if self.estimate.value_s is not None else min(self.cfg.max_inflight, COLD_INFLIGHT)
        if step <= self.last_step or len(self.inflight) >= cap:
            return None
        lat = self.latency_s(now)
        r = self.steps_for(lat)
        if self.supply_end(queued_end, now) + 1 - step > max(self.cfg.request_threshold, r + self.cfg.margin_steps):
            return None
        if self.inflight and now + lat < self.server_free_at(now):
            return None  # it would wait behind the requests in flight: later, with a fresher observation
        self.next_id += 1
        self.inflight[self.next_id] = (step, now)
        self.last_step = step
        self.max_inflight_seen = max(self.max_inflight_seen, len(self.inflight))
        return Request(self.next_id, step, min(r, self.cfg.chunk_size), len(self.inflight))

    # ------------------------------------------------------------------ fallback
    def check_fallback(self, step: int) -> Fallback | None:
        """Decide the fallback at ``step`` when the estimate (``>= min_samples`` round trips) says
        the schedule cannot keep up; once per episode. ``slow`` multiplies :attr:`dt`. Returns the
        new decision, else ``None``."""
        est = self.estimate.value_s
        if self.fallback is not None or est is None or len(self.estimate.recent) < self.cfg.min_samples:
            return None
        r = self.steps_for(est)
        if self.keeps_up(r, self.service_steps()):
            return None
        hz = 1.0 / self.dt
        dt_after = self.dt * (float(self.cfg.slow_factor) if self.cfg.fallback == "slow" else 1.0)
        self.fallback = Fallback(mode=self.cfg.fallback, step=int(step), latency_s=float(est), latency_steps=r,
                                 compute_s=self.service.value_s or 0.0, control_hz_before=hz,
                                 control_hz_after=1.0 / dt_after,
                                 keeps_up_after=self.keeps_up(self.steps_for(est, dt_after),
                                                              self.service_steps(dt_after)))
        self.dt = dt_after
        return self.fallback
