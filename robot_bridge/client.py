"""Robot client: the robot's fixed-rate control loop fed by asynchronous action chunks.

Each control tick ``k`` (period ``1 / control_hz``, absolute schedule; a tick that overruns by
more than one period re-anchors the schedule and is counted in ``stats["overruns"]``, so a
simulator slower than real time runs at its own pace instead of racing to catch up):

1. observe; if the queued future (``ActionQueue.size(k)``) is at most the request threshold
   (``max(request_threshold, ceil(latency / dt) + latency_margin_steps)``) and no request is in
   flight, hand a chunk request to the sender thread (never blocks the tick), carrying the
   committed actions as the real-time-chunking prefix and the estimated delay in steps;
2. take the action for step ``k`` from the queue, or the robot's hold command when the queue is
   dry (counted as starvation);
3. clip it (:class:`robot_bridge.safety.SafetyFilter`) and apply it;
4. stop at once on e-stop; hold when the server has been silent (no message, heartbeats
   included) for ``silence_hold_s``, and stop when the watchdog fires after ``watchdog_s``.

A receiver thread merges arriving chunks into the queue (latency-aware: stale actions skipped)
and measures the observation-to-command latency of each chunk (arrival in the queue minus the
observation's capture time minus the server's reported inference time).
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, runtime_checkable

import numpy as np

from robot_bridge import messages as M
from robot_bridge.queue import ActionQueue
from robot_bridge.safety import SafetyFilter, SafetyLimits, Watchdog
from wmrl.types import Episode

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
        """``(proprio float32 (D_s,), camera -> uint8 (3, Hi, Wi) upright)``."""

    def apply(self, action: np.ndarray) -> None:
        """Execute one control step with command ``float32 (D_a,)`` (already clipped)."""

    def hold_action(self, last: np.ndarray | None) -> np.ndarray:
        """The command that holds the robot still, given the last command (or ``None``)."""

    def stop(self) -> None:
        """Stop now (brake / freeze); safe to call from any thread, more than once."""

    def success(self) -> bool:
        """Task success predicate on the current state."""


@dataclass
class ClientConfig:
    """Settings of :class:`RobotClient`.

    Attributes:
        control_hz: control rate (Hz).
        request_threshold: request the next chunk when at most this many actions are queued.
        latency_margin_steps: extra steps over the measured latency for the threshold.
        initial_latency_s: latency guess before the first chunk arrives.
        merge: ``"latency_aware"`` or ``"naive"`` (see ``robot_bridge.queue``).
        rtc_prefix: send committed actions as prefix when the server supports it.
        watchdog_s: stop when the server is silent this long.
        silence_hold_s: hold (stop consuming queued actions) when the server is silent this long
            (default ``watchdog_s / 2``; the server heart-beats every 0.1 s).
        ready_timeout_s: how long ``connect`` waits for ``Ready`` (the server's warm-up).
        request_timeout_s: re-request when a request is unanswered this long.
        max_steps: episode length limit (control steps).
        stop_on_success: end the episode when the success predicate holds.
    """

    control_hz: float = 20.0
    request_threshold: int = 8
    latency_margin_steps: int = 2
    initial_latency_s: float = 0.2
    merge: str = "latency_aware"
    rtc_prefix: bool = True
    watchdog_s: float = 0.5
    silence_hold_s: float | None = None
    ready_timeout_s: float = 30.0
    request_timeout_s: float = 2.0
    max_steps: int = 400
    stop_on_success: bool = True


@dataclass
class EpisodeResult:
    """Outcome of :meth:`RobotClient.run_episode`.

    ``episode`` is the record for the EpisodeStore (``extras``: ``t_cmd`` s since start,
    ``starved`` 0/1, ``clipped`` 0/1, ``cmd_latency_s`` obs-to-command latency of the action's
    chunk (NaN on hold), ``chunk_id``); ``failure_label``: ``""`` on success, else
    ``timeout`` | ``watchdog`` | ``estop`` | ``operator:<label>`` | ``critic``.
    """

    episode: Episode
    success: bool
    failure_label: str
    steps: int
    starved_after_first: int
    time_to_first_action_s: float
    latencies_s: list[float]
    round_trips_s: list[float]
    stopped_at_s: float | None
    stats: dict = field(default_factory=dict)


class RobotClient:
    """Runs episodes of ``robot`` with chunks from a policy server over ``transport``.

    Args:
        robot: a :class:`RobotInterface`.
        transport: a ``wmrl.interfaces.Transport`` connected to a ``PolicyServer``.
        config: :class:`ClientConfig`.
        safety: :class:`SafetyLimits` (default: the ``[-1, 1]`` command range).
        critic: optional ``(proprio, images) -> success probability`` used for the outcome when
            the success predicate is false (the label becomes ``critic`` when it disagrees).
    """

    def __init__(self, robot: RobotInterface, transport, config: ClientConfig | None = None,
                 safety: SafetyLimits | None = None, critic: Callable | None = None):
        self.robot = robot
        self.transport = transport
        self.cfg = config or ClientConfig()
        self.dt = 1.0 / self.cfg.control_hz
        self.safety = SafetyFilter(safety or SafetyLimits(), robot.action_dim)
        self.critic = critic
        self.queue = ActionQueue(robot.action_dim, self.cfg.merge)
        self.watchdog = Watchdog(self.cfg.watchdog_s)
        self.ready: M.pb.Ready | None = None
        self._ready_evt = threading.Event()
        self._estop = threading.Event()
        self._estop_reason = ""
        self._operator_label = ""
        self._link_down = threading.Event()
        self._closing = threading.Event()
        self._outbox: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._episode = 0
        self._next_step = 0
        self._outstanding: tuple[int, float] | None = None  # (request_id, sent at)
        self._request_id = 0
        self._latency_est = self.cfg.initial_latency_s
        self._latencies: list[float] = []
        self._round_trips: list[float] = []
        self._chunk_latency: dict[int, float] = {}
        self._chunk_ids: dict[int, int] = {}
        self.errors: list[tuple[str, str]] = []  # (code, message) received from the server
        self.rejected: list[str] = []  # messages from the server we rejected
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ connection
    def connect(self) -> M.pb.Ready:
        """Start the I/O threads, send ``Hello`` and wait for ``Ready`` (after server warm-up).

        Raises:
            TimeoutError: no ``Ready`` within ``ready_timeout_s``.
            ConnectionError: the server rejected the hello (e.g. action-dim mismatch).
        """
        self._threads = [threading.Thread(target=self._recv_loop, daemon=True, name="client-recv"),
                         threading.Thread(target=self._send_loop, daemon=True, name="client-send")]
        for t in self._threads:
            t.start()
        r = self.robot
        h, w = r.image_size
        self._outbox.put(M.Envelope(hello=M.pb.Hello(
            robot=type(r).__name__, action_dim=r.action_dim, state_dim=r.state_dim, cameras=list(r.cameras),
            control_hz=self.cfg.control_hz, image_height=h, image_width=w, task=r.task)))
        t0 = time.monotonic()
        while not self._ready_evt.wait(0.05):
            if self.errors and self.errors[-1][0] == "invalid":
                raise ConnectionError(f"server rejected the robot: {self.errors[-1][1]}")
            if self._link_down.is_set():
                raise ConnectionError("link to the policy server went down before Ready")
            if time.monotonic() - t0 > self.cfg.ready_timeout_s:
                raise TimeoutError(f"no Ready from the policy server within {self.cfg.ready_timeout_s} s")
        self.watchdog.kick()
        return self.ready

    def close(self) -> None:
        self._closing.set()
        self._outbox.put(None)
        for t in self._threads:
            t.join(timeout=1.0)
        try:
            self.transport.close()
        except Exception:  # pragma: no cover
            pass

    def _send_loop(self) -> None:
        while not self._closing.is_set():
            env = self._outbox.get()
            if env is None:
                return
            try:
                self.transport.send(env)
            except (ConnectionError, OSError) as e:
                log.warning("send failed, link down: %s", e)
                self._link_down.set()
                return
            except M.MessageError as e:
                log.error("not sent: %s", e)

    def _recv_loop(self) -> None:
        while not self._closing.is_set():
            try:
                env = self.transport.recv(timeout=0.05)
            except M.MessageError as e:
                self.rejected.append(str(e))
                self.watchdog.kick()  # the server is alive, it sent something
                self._outbox.put(M.make_error(e))
                with self._lock:
                    if self._outstanding and e.request_id == self._outstanding[0]:
                        self._outstanding = None
                continue
            except (ConnectionError, OSError):
                self._link_down.set()
                return
            if env is None:
                continue
            self.watchdog.kick()
            k = M.kind(env)
            if k == "chunk":
                self._on_chunk(env.chunk)
            elif k == "ready":
                self.ready = env.ready
                self._ready_evt.set()
            elif k == "estop":
                self.estop(f"server: {env.estop.reason}")
            elif k == "error":
                self.errors.append((env.error.code, env.error.message))
                with self._lock:
                    if self._outstanding and env.error.request_id == self._outstanding[0]:
                        self._outstanding = None

    def _on_chunk(self, c: M.pb.ActionChunk) -> None:
        t_arrive = M.now_ns()
        if c.episode != self._episode:
            return
        a = M.chunk_array(c)
        with self._lock:
            res = self.queue.insert(a, int(c.start_step), self._next_step)
            cid = res.chunk_id
            if self._outstanding and self._outstanding[0] == c.request_id:
                self._outstanding = None
        rt = (t_arrive - c.obs_stamp_ns) * 1e-9
        lat = rt - c.inference_s
        self._round_trips.append(rt)
        self._latencies.append(lat)
        self._chunk_latency[cid] = lat
        self._latency_est = 0.7 * self._latency_est + 0.3 * rt if self._latencies[:-1] else rt
        log.debug("chunk %d: start %d skipped %d latency %.2f ms", cid, c.start_step, res.skipped, lat * 1e3)

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
    def _threshold(self) -> int:
        return max(self.cfg.request_threshold,
                   math.ceil(self._latency_est / self.dt) + self.cfg.latency_margin_steps)

    def run_episode(self, episode: int = 0, max_steps: int | None = None) -> EpisodeResult:
        """Run one episode in real time (blocking) and return its record (also on faults)."""
        if self.ready is None:
            raise RuntimeError("call connect() before run_episode()")
        r = self.robot
        max_steps = max_steps or self.cfg.max_steps
        self._episode = episode
        self._next_step = 0
        self.queue.clear()
        self.safety.reset()
        self._outstanding = None
        self._operator_label = ""
        self._latencies, self._round_trips, self._chunk_latency = [], [], {}
        rec_img = {c: [] for c in r.cameras}
        rec_prop, rec_act, rec_t, rec_starve, rec_clip, rec_lat, rec_cid = [], [], [], [], [], [], []
        stats = {"overruns": 0, "requests": 0, "clip_flags": {}, "silent_holds": 0}
        hold_after = self.cfg.silence_hold_s if self.cfg.silence_hold_s is not None else self.cfg.watchdog_s / 2
        first_action_t = None
        starved_after = 0
        last_cmd = None
        failure = ""
        success = False
        stopped_at = None
        t0 = time.monotonic()
        self.watchdog.kick()
        step = 0
        try:
            tick = t0
            for step in range(max_steps):
                now = time.monotonic()
                if now < tick:
                    time.sleep(tick - now)
                elif now - tick > self.dt:  # a tick ran long (slow simulator): re-anchor, do not race
                    stats["overruns"] += 1
                    tick = now
                tick += self.dt
                if self._estop.is_set():
                    failure = "estop"
                    break
                if self.watchdog.expired():
                    r.stop()
                    stopped_at = time.monotonic() - t0
                    failure = "watchdog"
                    break
                if self._operator_label:
                    failure = f"operator:{self._operator_label}"
                    break
                proprio, images = r.observe()
                with self._lock:
                    qsize = self.queue.size(step)
                    out = self._outstanding
                    need = qsize <= self._threshold() and (
                        out is None or time.monotonic() - out[1] > self.cfg.request_timeout_s)
                    if need:
                        self._request_id += 1
                        self._outstanding = (self._request_id, time.monotonic())
                        prefix = (self.queue.committed(step) if (self.cfg.rtc_prefix and self.ready.supports_prefix)
                                  else None)
                        rid = self._request_id
                if need:
                    delay = min(len(prefix) if prefix is not None else 0,
                                math.ceil(self._latency_est / self.dt) + 1)
                    env = M.make_observation(episode=episode, step=step, proprio=proprio, images=images, task=r.task,
                                             request=True, request_id=rid, prefix_actions=prefix)
                    env.observation.delay_steps = delay
                    self._outbox.put(env)
                    stats["requests"] += 1
                with self._lock:
                    a, cid = self.queue.pop(step)
                    self._next_step = step + 1  # the first step a chunk arriving now can still fill
                if self.watchdog.silence_s() > hold_after:
                    a, cid = None, -1  # the server went quiet: hold, the watchdog will stop us
                    stats["silent_holds"] += 1
                starved = a is None
                if starved:
                    a = r.hold_action(last_cmd)
                    if first_action_t is not None:
                        starved_after += 1
                elif first_action_t is None:
                    first_action_t = time.monotonic() - t0
                cmd, flags = self.safety.clip(a, proprio, hold=r.hold_action(last_cmd))
                for f in flags:
                    stats["clip_flags"][f] = stats["clip_flags"].get(f, 0) + 1
                if self._estop.is_set():
                    failure = "estop"
                    break
                r.apply(cmd)
                last_cmd = cmd
                for c in r.cameras:
                    rec_img[c].append(images[c])
                rec_prop.append(proprio)
                rec_act.append(cmd)
                rec_t.append(time.monotonic() - t0)
                rec_starve.append(float(starved))
                rec_clip.append(float(bool(flags)))
                rec_lat.append(self._chunk_latency.get(cid, float("nan")) if not starved else float("nan"))
                rec_cid.append(cid)
                if self.cfg.stop_on_success and r.success():
                    success = True
                    break
                if getattr(r, "done", None) is not None and r.done():
                    success = bool(r.success())
                    failure = "" if success else "timeout"
                    break
            else:
                success = bool(r.success())
                failure = "" if success else "timeout"
        except KeyboardInterrupt:
            failure = "operator:interrupted"
            stats["interrupted"] = True
        finally:
            if failure in ("estop", "watchdog") or failure.startswith("operator"):
                r.stop()
                if stopped_at is None:
                    stopped_at = time.monotonic() - t0
        if self.critic is not None and not success and failure == "timeout" and rec_prop:
            p = float(self.critic(rec_prop[-1], {c: rec_img[c][-1] for c in r.cameras}))
            stats["critic_success_prob"] = p
            failure = "critic" if p < 0.5 else "timeout"
        if not success and not failure:
            failure = "unknown"
        try:
            self._outbox.put(M.Envelope(episode_end=M.pb.EpisodeEnd(episode=episode, success=success,
                                                                     failure_label=failure)))
        except Exception:  # pragma: no cover
            pass
        T = len(rec_act)
        D_s, D_a = r.state_dim, r.action_dim
        h, w = r.image_size
        ep = Episode(
            images={c: (np.stack(rec_img[c]).astype(np.uint8) if T else np.zeros((0, 3, h, w), np.uint8))
                    for c in r.cameras},
            proprio=np.stack(rec_prop).astype(np.float32) if T else np.zeros((0, D_s), np.float32),
            actions=np.stack(rec_act).astype(np.float32) if T else np.zeros((0, D_a), np.float32),
            rewards=np.zeros(T, np.float32) if not success else np.eye(1, T, T - 1, dtype=np.float32)[0],
            success=success, instruction=r.task, task_name=getattr(r, "task_name", ""),
            extras={"t_cmd": np.asarray(rec_t, np.float64), "starved": np.asarray(rec_starve, np.float32),
                    "clipped": np.asarray(rec_clip, np.float32), "cmd_latency_s": np.asarray(rec_lat, np.float64),
                    "chunk_id": np.asarray(rec_cid, np.int64)},
            info={"source": "robot_bridge", "episode": episode, "t0_monotonic_s": t0, "failure_label": failure,
                  "failure_source": _failure_source(failure), "control_hz": self.cfg.control_hz,
                  "merge": self.cfg.merge, "estop_reason": self._estop_reason,
                  "time_to_first_action_s": first_action_t, "stopped_at_s": stopped_at,
                  "starved_after_first": starved_after, "latency_p50_s": _q(self._latencies, 50),
                  "latency_p99_s": _q(self._latencies, 99), "round_trip_p50_s": _q(self._round_trips, 50),
                  "overruns": stats["overruns"]})
        return EpisodeResult(episode=ep, success=success, failure_label=failure, steps=T,
                             starved_after_first=starved_after,
                             time_to_first_action_s=first_action_t if first_action_t is not None else float("nan"),
                             latencies_s=list(self._latencies), round_trips_s=list(self._round_trips),
                             stopped_at_s=stopped_at, stats=stats)


def _q(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def _failure_source(label: str) -> str:
    if not label:
        return ""
    if label == "timeout":
        return "success_predicate"
    if label.startswith("operator"):
        return "operator"
    return label
