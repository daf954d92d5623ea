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
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

import numpy as np

from robot_bridge import messages as M
from robot_bridge.queue import ActionQueue
from robot_bridge.safety import SafetyFilter, SafetyLimits, Watchdog
from wmrl.kernel.types import Episode

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
        hello_retry_s: ``connect`` sends ``Hello`` again after this long while nothing at all was
            heard from the server (a ROS 2 server that was discovered only after the first
            ``Hello``, e.g. restarted, never saw it; a server answers a repeated ``Hello`` with
            the same ``Ready``).
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
    hello_retry_s: float = 1.0
    request_timeout_s: float = 2.0
    max_steps: int = 400
    stop_on_success: bool = True


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


def episode_ran(label: str) -> bool:
    """Whether an episode with this failure label ran to completion: a success (``""``), a task
    failure (``timeout``, ``critic``) or an operator's verdict (``operator:<label>``); not one cut
    short by the watchdog, an e-stop or an interruption (``operator:interrupted``)."""
    if label in ("", "timeout", "critic"):
        return True
    return label.startswith("operator:") and label != "operator:interrupted"


class _Link:
    """One connection to the policy server: its transport, outbox and I/O threads."""

    def __init__(self, transport):
        self.transport = transport
        self.outbox: queue.Queue = queue.Queue()
        self.closing = threading.Event()
        self.down = threading.Event()
        self.ready = threading.Event()
        self.heard = threading.Event()  # any message (or a rejected one) came from the server
        self.ready_msg: M.pb.Ready | None = None
        self.ended = ""  # the server's reason when it ended the session ([busy], [timeout])
        self.end_reason = ""  # the transport's, when it reported the peer gone
        self.threads: list[threading.Thread] = []


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
        self._outstanding: tuple[int, float] | None = None  # (request_id, sent at)
        self._request_id = 0
        self._latency_est = self.cfg.initial_latency_s
        self._latencies: list[float] = []
        self._round_trips: list[float] = []
        self._chunk_latency: dict[int, float] = {}
        self._chunk_ids: dict[int, int] = {}
        self.errors: list[tuple[str, str]] = []  # (code, message) received from the server
        self.rejected: list[str] = []  # messages from the server we rejected

    # ------------------------------------------------------------------ connection
    @property
    def link_up(self) -> bool:
        """A link is open, ``Ready`` was received, neither side ended it and the server has not
        been silent for longer than the watchdog allows."""
        return (self._link is not None and self.ready is not None and not self._link.down.is_set()
                and not self.watchdog.expired())

    def connect(self) -> M.pb.Ready:
        """Open a link (the given transport the first time, else one from ``transport_factory``),
        send ``Hello`` and wait for ``Ready`` (after the server's warm-up). A link still open is
        closed first.

        Raises:
            TimeoutError: no ``Ready`` within ``ready_timeout_s``.
            ConnectionError: the server cannot be reached, rejected the hello (e.g. action-dim
                mismatch), is busy, or the link went down before ``Ready``.
        """
        self.drop_link()
        transport, self._unused = self._unused, None
        if transport is None:
            if self.transport_factory is None:
                raise ConnectionError("the link to the policy server is closed and this RobotClient has no "
                                      "transport_factory to open another")
            transport = self.transport_factory()
        self.transport = transport
        self._link = link = _Link(transport)
        link.threads = [threading.Thread(target=self._recv_loop, args=(link,), daemon=True, name="client-recv"),
                        threading.Thread(target=self._send_loop, args=(link,), daemon=True, name="client-send")]
        for t in link.threads:
            t.start()
        try:
            self.ready = self._handshake(link)
        except BaseException:
            self.drop_link()
            raise
        self.watchdog.kick()
        return self.ready

    def _handshake(self, link: _Link) -> M.pb.Ready:
        r = self.robot
        h, w = r.image_size
        n_err = len(self.errors)
        hello = M.Envelope(hello=M.pb.Hello(
            robot=type(r).__name__, action_dim=r.action_dim, state_dim=r.state_dim, cameras=list(r.cameras),
            control_hz=self.cfg.control_hz, image_height=h, image_width=w, task=r.task))
        link.outbox.put(hello)
        t0 = t_hello = time.monotonic()
        while not link.ready.wait(0.05):
            if not link.heard.is_set() and time.monotonic() - t_hello > self.cfg.hello_retry_s:
                link.outbox.put(hello)
                t_hello = time.monotonic()
            invalid = [m for c, m in self.errors[n_err:] if c == "invalid"]
            if invalid:
                raise ConnectionError(f"server rejected the robot: {invalid[0]}")
            if link.down.is_set():
                raise ConnectionError(f"policy server ended the session: {link.ended}" if link.ended else
                                      f"link to the policy server went down before Ready "
                                      f"({link.end_reason or 'no reason given'})")
            if time.monotonic() - t0 > self.cfg.ready_timeout_s:
                raise TimeoutError(f"no Ready from the policy server within {self.cfg.ready_timeout_s} s")
        return link.ready_msg

    def connect_with_retry(self, policy: ReconnectPolicy | None = None,
                           stop: threading.Event | None = None) -> M.pb.Ready:
        """:meth:`connect`, retried per ``policy`` (default: no retry) while ``stop`` is not set
        (:func:`with_retry`).

        Raises:
            ConnectionError: the last failure, once the policy gives up (or ``stop`` was set).
        """
        return with_retry(self.connect, policy, stop)

    def drop_link(self) -> None:
        """Close the current link (threads and transport); the next :meth:`connect` opens another."""
        link, self._link = self._link, None
        self.ready = None
        if link is None:
            return
        link.closing.set()
        link.outbox.put(None)
        for t in link.threads:
            t.join(timeout=1.0)
        try:
            link.transport.close()
        except Exception:  # pragma: no cover
            pass

    def close(self) -> None:
        """Close the link (and the given transport if no link was opened with it)."""
        self.drop_link()
        if self._unused is not None:
            self._unused.close()
            self._unused = None

    def _post(self, env: M.Envelope) -> None:
        """Hand ``env`` to the sender thread of the current link (dropped when there is none)."""
        link = self._link
        if link is not None:
            link.outbox.put(env)

    def _send_loop(self, link: _Link) -> None:
        while not link.closing.is_set():
            env = link.outbox.get()
            if env is None:
                return
            try:
                link.transport.send(env)
            except M.MessageError as e:
                log.error("not sent: %s", e)
            except Exception as e:  # ConnectionError, OSError, or a transport torn down under the sender
                log.warning("send failed, link down: %s", e)
                link.down.set()
                return

    def _recv_loop(self, link: _Link) -> None:
        while not link.closing.is_set():
            try:
                env = link.transport.recv(timeout=0.05)
            except M.MessageError as e:
                self.rejected.append(str(e))
                link.heard.set()
                self.watchdog.kick()  # the server is alive, it sent something
                link.outbox.put(M.make_error(e))
                with self._lock:
                    if self._outstanding and e.request_id == self._outstanding[0]:
                        self._outstanding = None
                continue
            except (ConnectionError, OSError) as e:
                link.end_reason = str(e)
                link.down.set()
                return
            if env is None:
                continue
            link.heard.set()
            self.watchdog.kick()
            self._on_message(link, env)

    def _on_message(self, link: _Link, env: M.Envelope) -> None:
        k = M.kind(env)
        if k == "chunk":
            self._on_chunk(env.chunk)
        elif k == "ready":
            link.ready_msg = env.ready
            link.ready.set()
        elif k == "estop":
            self.estop(f"server: {env.estop.reason}")
        elif k == "error":
            self.errors.append((env.error.code, env.error.message))
            if env.error.code in ("busy", "timeout"):  # the server ended this session
                link.ended = f"[{env.error.code}] {env.error.message}"
                link.down.set()
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
            raise RuntimeError("call connect() before run_episode() (and again after drop_link())")
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
                    self._post(env)
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
        self._post(M.Envelope(episode_end=M.pb.EpisodeEnd(episode=episode, success=success, failure_label=failure)))
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
