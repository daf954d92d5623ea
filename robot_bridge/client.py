"""Robot client: the robot's fixed-rate control loop fed by asynchronous action chunks.

Each control tick ``k`` (period ``1 / control_hz``, absolute schedule; a tick that overruns by
more than one period re-anchors the schedule and is counted in ``stats["overruns"]``, so a
simulator slower than real time runs at its own pace instead of racing to catch up):

1. observe; when :class:`robot_bridge.timing.RequestTimer` says a request is due (timed from the
   measured round trip so that its chunk arrives before the queued actions, those of the chunks
   in flight included, run out; more than one in flight when the round trip exceeds what the
   queue covers; never two for the same step), hand a chunk request to the sender thread (never
   blocks the tick), carrying the committed actions as the real-time-chunking prefix and the
   steps expected to run before its chunk arrives (``delay_steps``); the server continues its
   own record of the chunks in flight (``robot_bridge.plan``);
2. when the round-trip estimate says no request timing can keep up, decide the configured safe
   behaviour once per episode (``fallback``: ``hold`` the rate and hold the robot on ticks
   without an action, or ``slow`` the control rate by ``slow_factor``), recorded in the episode's
   ``info["fallback"]``;
3. take the action for step ``k`` from the queue, or the robot's hold command when the queue is
   dry (counted as starvation);
4. clip it (:class:`robot_bridge.safety.SafetyFilter`) and apply it;
5. stop at once on e-stop; hold when the server has been silent (no message, heartbeats
   included) for ``silence_hold_s``, and stop when the watchdog fires after ``watchdog_s``.

A receiver thread merges arriving chunks into the queue (latency-aware: stale actions skipped,
the newest observation wins) and measures each chunk's round trip (observation capture to
arrival in the queue; it feeds the timer's estimate) and its observation-to-command latency (the
round trip minus the server's reported time for it: transport, serialisation and scheduling).

Links. :meth:`RobotClient.connect` opens one link (transport, sender and receiver threads,
``Hello`` / ``Ready``); a link ends when the transport reports the peer gone, when the server
ends the session (``Error`` ``[busy]`` or ``[timeout]``), or after a watchdog stop. An episode
never resumes on a new link: the watchdog stops it (hold, then stop) and it is recorded as
``watchdog``; :meth:`RobotClient.connect_with_retry` then opens a new link through the
``transport_factory`` with exponential backoff (:class:`ReconnectPolicy`) before the next
episode. :func:`episode_ran` tells whether an episode ran to completion.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

import numpy as np

from robot_bridge import messages as M
from robot_bridge.client_config import ClientConfig
from robot_bridge.client_link import ServerLink, _Link
from robot_bridge.episode_log import EpisodeResult, StepLog, episode_ran, failure_source, percentile_or_none
from robot_bridge.queue import ActionQueue
from robot_bridge.reconnect import ReconnectPolicy, with_retry
from robot_bridge.safety import SafetyFilter, SafetyLimits, Watchdog
from robot_bridge.timing import Fallback, LatencyEstimate, RequestTimer

__all__ = ["ClientConfig", "EpisodeResult", "ReconnectPolicy", "RobotClient", "RobotInterface", "episode_ran",
           "with_retry"]

log = logging.getLogger("robot_bridge.client")


@runtime_checkable
class RobotInterface(Protocol):
    """What the client drives: a real arm, the MuJoCo arm node, or a test double.

    Attributes:
        action_dim: ``D_a``; state_dim: ``D_s``; cameras: camera names;
        image_size: ``(Hi, Wi)``; task: instruction; task_name: task id.
    """

    action_dim: int
    state_dim: int
    cameras: list[str]
    image_size: tuple[int, int]
    task: str
    task_name: str

    def observe(self) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """``(proprio float32 (D_s,), camera -> uint8 (3, Hi, Wi) upright)``. A robot that declares
        ``frames_on_demand = True`` also takes ``observe(images=False)`` (proprio only, ``{}``
        for the frames), which the client calls on the ticks without a chunk request when
        ``ClientConfig.frames == "requests"``."""

    def apply(self, action: np.ndarray) -> None:
        """Execute one control step with command ``float32 (D_a,)`` (already clipped)."""

    def hold_action(self, last: np.ndarray | None) -> np.ndarray:
        """The command that holds the robot still, given the last command (or ``None``)."""

    def stop(self) -> None:
        """Stop now (brake / freeze); safe to call from any thread, more than once (it may block
        while another thread is inside ``observe``/``apply``; never call it from a signal handler)."""

    def success(self) -> bool:
        """Task success predicate on the current state."""


class RobotClient(ServerLink):
    """Runs episodes of ``robot`` with chunks from a policy server over ``transport``.

    Args:
        robot: a :class:`RobotInterface`.
        transport: a ``wmrl.kernel.interfaces.Transport`` connected to a ``PolicyServer``, used by the
            first :meth:`connect`; ``None``: the first link comes from ``transport_factory``.
        config: :class:`ClientConfig`.
        safety: :class:`SafetyLimits` (default: the ``[-1, 1]`` command range).
        critic: optional ``(proprio, images) -> success probability`` used for the outcome when
            the success predicate is false (the label becomes ``critic`` when it disagrees).
        transport_factory: ``() -> Transport`` opening a new link to the server (raising
            ``ConnectionError`` when it cannot be reached); ``None``: no reconnection.
    """

    def __init__(self, robot: RobotInterface, transport=None, config: ClientConfig | None = None,
                 safety: SafetyLimits | None = None, critic: Callable | None = None,
                 transport_factory: Callable[[], Any] | None = None):
        if transport is None and transport_factory is None:
            raise ValueError("RobotClient needs a transport or a transport_factory")
        self.robot = robot
        self.transport = transport
        self.transport_factory = transport_factory
        self._unused = transport  # the given transport, until the first connect() takes it
        self.cfg = config or ClientConfig()
        if self.cfg.frames not in ("every_step", "requests"):
            raise ValueError(f"control.frames must be 'every_step' or 'requests', got {self.cfg.frames!r}")
        if self.cfg.frames == "requests" and not getattr(robot, "frames_on_demand", False):
            raise ValueError(f"control.frames=requests needs a robot that declares frames_on_demand (observe(images="
                             f"False)); {type(robot).__name__} does not: use control.frames=every_step")
        self.dt = 1.0 / self.cfg.control_hz
        self.safety = SafetyFilter(safety or SafetyLimits(), robot.action_dim)
        self.critic = critic
        self.queue = ActionQueue(robot.action_dim, self.cfg.merge)
        self.watchdog = Watchdog(self.cfg.watchdog_s)
        self.ready: M.pb.Ready | None = None
        self._estop = threading.Event()
        self._estop_reason = ""
        self._operator_label = ""
        self._link: _Link | None = None
        self._lock = threading.Lock()
        self._episode = 0
        self._next_step = 0
        self.timer: RequestTimer
        self._new_timer(16)  # checks the settings now; connect() makes the link's own for the server's H
        self._latencies: list[float] = []
        self._round_trips: list[float] = []
        self._chunk_latency: dict[int, float] = {}
        self._chunk_ids: dict[int, int] = {}
        self.errors: list[tuple[str, str]] = []  # (code, message) received from the server
        self.rejected: list[str] = []  # messages from the server we rejected

    # ------------------------------------------------------------------ operator / safety
    def estop(self, reason: str = "operator") -> None:
        """Emergency stop: the robot is stopped now (from any thread); the episode ends failed."""
        if not self._estop.is_set():
            self._estop_reason = reason
            self._estop.set()
        self.robot.stop()

    def flag_failure(self, label: str = "operator") -> None:
        """Operator flag: end the current episode as a failure with this label."""
        self._operator_label = label

    # ------------------------------------------------------------------ control loop
    def _new_timer(self, chunk_size: int) -> None:
        """A fresh request timer (cold latency estimate) for a new link (called by ``connect``)."""
        with self._lock:
            self.timer = RequestTimer(self.cfg.timing(chunk_size), LatencyEstimate(self.cfg.latency_window))

    def run_episode(self, episode: int = 0, max_steps: int | None = None) -> EpisodeResult:
        """Run one episode in real time (blocking) and return its record (also on faults)."""
        if self.ready is None:
            raise RuntimeError("call connect() before run_episode() (and again after drop_link())")
        r = self.robot
        max_steps = max_steps or self.cfg.max_steps
        self._begin_episode(episode)
        run = _Run(t0=time.monotonic(), log=StepLog(r.cameras),
                   hold_after=self.cfg.silence_hold_s if self.cfg.silence_hold_s is not None else self.cfg.watchdog_s / 2)
        self.watchdog.kick()
        try:
            tick = run.t0
            for step in range(max_steps):
                tick = self._wait_tick(tick, run.stats)
                if self._interrupted(run) or self._control_step(episode, step, run):
                    break
            else:
                run.success = bool(r.success())
                run.failure = "" if run.success else "timeout"
        except KeyboardInterrupt:
            run.failure = "operator:interrupted"
            run.stats["interrupted"] = True
        finally:
            if run.failure in ("estop", "watchdog") or run.failure.startswith("operator"):
                r.stop()
                if run.stopped_at is None:
                    run.stopped_at = time.monotonic() - run.t0
        return self._finish(episode, run)

    def _begin_episode(self, episode: int) -> None:
        self._episode = episode
        self._next_step = 0
        self.queue.clear()
        self.safety.reset()
        self.dt = 1.0 / self.cfg.control_hz
        with self._lock:
            self.timer.begin_episode(self.dt)
        self._operator_label = ""
        self._latencies, self._round_trips, self._chunk_latency = [], [], {}

    def _wait_tick(self, tick: float, stats: dict) -> float:
        """Sleep until ``tick`` (absolute schedule); a tick that ran long by more than a period
        (slow simulator) re-anchors the schedule instead of racing. Returns the next tick."""
        now = time.monotonic()
        if now < tick:
            time.sleep(tick - now)
        elif now - tick > self.dt:
            stats["overruns"] += 1
            tick = now
        return tick + self.dt

    def _interrupted(self, run: _Run) -> bool:
        """E-stop, watchdog (the robot is stopped now) or an operator's flag ends the episode."""
        if self._estop.is_set():
            run.failure = "estop"
        elif self.watchdog.expired():
            self.robot.stop()
            run.stopped_at = time.monotonic() - run.t0
            run.failure = "watchdog"
        elif self._operator_label:
            run.failure = f"operator:{self._operator_label}"
        return bool(run.failure)

    def _control_step(self, episode: int, step: int, run: _Run) -> bool:
        """Observe, request a chunk when due, apply the queued (or hold) command through the safety
        filter and record the step. Returns whether the episode ended."""
        r = self.robot
        if self.cfg.frames == "every_step":
            proprio, images = r.observe()
            self._request_if_due(episode, step, proprio, images, run.stats)
            fresh = True
        else:  # frames only where a request goes out (and at the first step): decide first, then observe
            due = self._due_request(step)
            fresh = due is not None or run.last_images is None
            proprio, images = r.observe(images=fresh)
            if fresh:
                run.last_images = images
            images = run.last_images
            if due is not None:
                with self._lock:  # in flight from now, not from before the frames were read
                    self.timer.sent(due[0].request_id, time.monotonic())
                self._send_request(episode, step, proprio, images, due, run.stats)
        self._check_fallback(step, run)
        with self._lock:
            a, cid = self.queue.pop(step)
            self._next_step = step + 1  # the first step a chunk arriving now can still fill
        if self.watchdog.silence_s() > run.hold_after:
            a, cid = None, -1  # the server went quiet: hold, the watchdog will stop us
            run.stats["silent_holds"] += 1
        starved = a is None
        if starved:
            a = r.hold_action(run.last_cmd)
            if run.first_action_t is not None:
                run.starved_after += 1
        elif run.first_action_t is None:
            run.first_action_t = time.monotonic() - run.t0
        cmd, flags = self.safety.clip(a, proprio, hold=r.hold_action(run.last_cmd))
        for f in flags:
            run.stats["clip_flags"][f] = run.stats["clip_flags"].get(f, 0) + 1
        if self._estop.is_set():
            run.failure = "estop"
            return True
        r.apply(cmd)
        run.last_cmd = cmd
        run.log.append(images, proprio, cmd, time.monotonic() - run.t0, starved, bool(flags),
                       self._chunk_latency.get(cid, float("nan")) if not starved else float("nan"), cid, fresh)
        if self.cfg.stop_on_success and r.success():
            run.success = True
            return True
        if getattr(r, "done", None) is not None and r.done():
            run.success = bool(r.success())
            run.failure = "" if run.success else "timeout"
            return True
        return False

    def _request_if_due(self, episode: int, step: int, proprio, images, stats: dict) -> None:
        """Hand a chunk request to the sender thread when the timer says it is due (with the
        committed actions as the RTC prefix and the steps expected to run before its chunk
        arrives as ``delay_steps``; both only when the server does real-time chunking)."""
        due = self._due_request(step)
        if due is not None:
            self._send_request(episode, step, proprio, images, due, stats)

    def _due_request(self, step: int):
        """``(request, RTC prefix or None, whether RTC is on)`` when the timer says a request is due now, else ``None``."""
        with self._lock:
            req = self.timer.due(step, step + self.queue.size(step) - 1, time.monotonic())
            if req is None:
                return None
            rtc = self.cfg.rtc_prefix and self.ready.supports_prefix and self.cfg.merge == "latency_aware"
            prefix = self.queue.committed(step, self.timer.cfg.chunk_size) if rtc else None
        return req, prefix, rtc

    def _send_request(self, episode: int, step: int, proprio, images, due, stats: dict) -> None:
        req, prefix, rtc = due
        env = M.make_observation(episode=episode, step=step, proprio=proprio, images=images, task=self.robot.task,
                                 request=True, request_id=req.request_id, prefix_actions=prefix)
        env.observation.delay_steps = req.delay_steps if rtc else 0
        self._post(env)
        stats["requests"] += 1

    def _check_fallback(self, step: int, run: _Run) -> None:
        """Take the timer's fallback decision (once per episode): ``slow`` lengthens the control
        period from the next tick on; the decision goes into the episode record."""
        with self._lock:
            fb = self.timer.check_fallback(step)
        if fb is None:
            return
        self.dt = 1.0 / fb.control_hz_after
        run.fallback = fb
        log.warning("round trip %.0f ms (%d steps), %.0f ms of server time per request: no request timing keeps "
                    "chunks of %d at %.3g Hz coming (up to %d in flight); fallback %s (%.3g Hz from step %d)",
                    fb.latency_s * 1e3, fb.latency_steps, fb.compute_s * 1e3, self.timer.cfg.chunk_size,
                    fb.control_hz_before, self.timer.cfg.max_inflight, fb.mode, fb.control_hz_after, step)

    def _finish(self, episode: int, run: _Run) -> EpisodeResult:
        """The outcome (the critic's verdict on a timeout), ``EpisodeEnd`` to the server, the record."""
        r = self.robot
        success, failure, stats, log_ = run.success, run.failure, run.stats, run.log
        if self.critic is not None and not success and failure == "timeout" and log_.proprio:
            p = float(self.critic(log_.proprio[-1], {c: log_.images[c][-1] for c in r.cameras}))
            stats["critic_success_prob"] = p
            failure = "critic" if p < 0.5 else "timeout"
        if not success and not failure:
            failure = "unknown"
        self._post(M.Envelope(episode_end=M.pb.EpisodeEnd(episode=episode, success=success, failure_label=failure)))
        ep = log_.episode(r, success, info={
            "source": "robot_bridge", "episode": episode, "t0_monotonic_s": run.t0, "failure_label": failure,
            "failure_source": failure_source(failure), "control_hz": self.cfg.control_hz,
            "merge": self.cfg.merge, "estop_reason": self._estop_reason,
            "time_to_first_action_s": run.first_action_t, "stopped_at_s": run.stopped_at,
            "starved_after_first": run.starved_after, "latency_p50_s": percentile_or_none(self._latencies, 50),
            "latency_p99_s": percentile_or_none(self._latencies, 99),
            "round_trip_p50_s": percentile_or_none(self._round_trips, 50), "overruns": stats["overruns"],
            "fallback": run.fallback.mode if run.fallback else "",
            "fallback_decision": run.fallback.as_dict() if run.fallback else None,
            "control_hz_effective": 1.0 / self.dt, "max_inflight": self.timer.cfg.max_inflight})
        with self._lock:
            stats["inflight_max"] = self.timer.max_inflight_seen
            stats["request_timeouts"] = self.timer.timeouts
        stats["fallback"] = run.fallback.as_dict() if run.fallback else None
        first = run.first_action_t
        return EpisodeResult(episode=ep, success=success, failure_label=failure, steps=len(log_),
                             starved_after_first=run.starved_after,
                             time_to_first_action_s=first if first is not None else float("nan"),
                             latencies_s=list(self._latencies), round_trips_s=list(self._round_trips),
                             stopped_at_s=run.stopped_at, stats=stats)


@dataclass
class _Run:
    """State of the episode :meth:`RobotClient.run_episode` is running."""

    t0: float
    log: StepLog
    hold_after: float
    stats: dict = field(default_factory=lambda: {"overruns": 0, "requests": 0, "clip_flags": {}, "silent_holds": 0})
    first_action_t: float | None = None
    starved_after: int = 0
    last_cmd: np.ndarray | None = None
    failure: str = ""
    success: bool = False
    stopped_at: float | None = None
    fallback: Fallback | None = None
    last_images: dict | None = None
