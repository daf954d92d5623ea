"""One robot connection of a ``robot_bridge.server.PolicyServer`` (a *session*): its receive loop,
inference worker, delivery and heartbeat threads, per-session counters and the hello / idle
timeouts; and :class:`SessionLimits`, how the server shares its policy among connections.

Requests of a session are computed one at a time in the order they came (the inference worker),
each continuing the session's record of the chunks it computed before (``robot_bridge.plan``:
the RTC prefix of a request whose ``delay_steps > 0``); the delivery thread sends each chunk when
its injected delay is over (``PolicyServer.delay_mode="latency"``: delays of requests in flight
overlap) or at once (``"compute"``: the delay was spent holding the policy). A chunk's
``inference_s`` is the server-side time from its request's arrival to its sending, ``compute_s``
the time it held the policy, ``queue_s`` what waiting for the server added to ``inference_s``
(``inference_s`` minus what it would have been with the server idle: ``max(injected delay,
compute_s)`` in latency mode, ``compute_s`` in compute mode).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from robot_bridge import messages as M
from robot_bridge.plan import SessionPlan

if TYPE_CHECKING:
    from robot_bridge.server import PolicyServer

log = logging.getLogger("robot_bridge.server")

Envelope = M.Envelope


@dataclass(frozen=True)
class SessionLimits:
    """How :meth:`PolicyServer.serve_endpoint` shares one policy among robot connections.

    Attributes:
        max_sessions: robots served at once (>= 1).
        on_busy: what a connection beyond ``max_sessions`` gets: ``"reject"``, an ``Error``
            ``[busy]`` naming the limit, then the connection is closed; ``"queue"``, it waits
            until a session ends (its ``Hello`` is answered then).
        hello_timeout_s: a connection that has sent no ``Hello`` within this many seconds of
            its session's start is ended with ``[timeout]`` (``None``: no limit).
        idle_timeout_s: a session that received nothing but heartbeats for this many seconds
            is ended with ``[timeout]`` (``None``: no limit).

    Raises:
        ValueError: ``max_sessions < 1``, an unknown ``on_busy``, or a timeout ``<= 0``.
    """

    max_sessions: int = 4
    on_busy: str = "reject"
    hello_timeout_s: float | None = 5.0
    idle_timeout_s: float | None = 30.0

    def __post_init__(self):
        if int(self.max_sessions) < 1:
            raise ValueError(f"max_sessions must be >= 1, got {self.max_sessions}")
        if self.on_busy not in ("reject", "queue"):
            raise ValueError(f"on_busy must be 'reject' or 'queue', got {self.on_busy!r}")
        for name in ("hello_timeout_s", "idle_timeout_s"):
            v = getattr(self, name)
            if v is not None and not float(v) > 0:
                raise ValueError(f"{name} must be > 0 s or null, got {v}")


class Session:
    """One robot connection of a :class:`robot_bridge.server.PolicyServer`: receive loop (this thread), inference
    worker and heartbeat threads, per-session counters and timeouts."""

    def __init__(self, server: PolicyServer, transport, idle_timeout_s: float | None,
                 hello_timeout_s: float | None):
        self.server = server
        self.transport = transport
        self.idle_timeout_s = idle_timeout_s
        self.hello_timeout_s = hello_timeout_s
        self.work: queue.Queue = queue.Queue()
        self.done = threading.Event()
        self.send_lock = threading.Lock()
        self.stats = {"requests": 0, "chunks": 0, "rejected": 0, "errors_sent": 0}
        self.said_hello = False
        self.ready: Envelope | None = None  # the answer to this session's Hello, once warmed up
        self.plan = SessionPlan()
        self._outbox: list[tuple] = []  # heap of (due, seq, chunk, received at, server time if idle)
        self._outbox_cv = threading.Condition()
        self._seq = itertools.count()

    def send(self, env: Envelope) -> None:
        with self.send_lock:
            self.transport.send(env)

    def error(self, code: str, message: str, request_id: int = 0) -> None:
        self.send(M.make_error(code, message, request_id))
        self._count(errors_sent=1)

    def _count(self, **inc) -> None:
        for k, v in inc.items():
            self.stats[k] += v
        self.server.count(**inc)

    def run(self) -> dict:
        threads = [threading.Thread(target=self._worker, daemon=True, name="server-worker"),
                   threading.Thread(target=self._deliver, daemon=True, name="server-delivery"),
                   threading.Thread(target=self._heartbeat, daemon=True, name="server-heartbeat")]
        for t in threads:
            t.start()
        t0 = time.monotonic()
        try:
            ended = self._receive(t0)
        finally:
            self.done.set()
            for t in threads:
                t.join(timeout=1.0)
        if ended.startswith("timeout"):
            log.warning("session %s", ended)
        return {**self.stats, "duration_s": time.monotonic() - t0, "ended": ended,
                "prefix_mismatches": self.plan.mismatches}

    def _receive(self, t0: float) -> str:
        """The receive loop; returns why the session ended."""
        srv = self.server
        last = t0
        while not self.done.is_set():
            if srv._stop.is_set():
                return "stopped"
            try:
                env = self.transport.recv(timeout=0.05)
            except M.MessageError as e:  # answered; not activity (a stream of garbage still times out)
                self._count(rejected=1)
                log.warning("rejected message: %s", e)
                self._reply(self.error, e.code, e.detail, e.request_id)
                env = None
            except ConnectionError:
                return "peer"
            now = time.monotonic()
            if env is not None and M.kind(env) != "heartbeat":
                last = now
                self._handle(env)
            why = self._timed_out(now, t0, last)
            if why:
                self._reply(self.error, "timeout", f"session ended: {why}")
                return f"timeout: {why}"
        return "peer"

    def _reply(self, fn, *args) -> None:
        """``fn(*args)`` (a send); a link that went down ends the session."""
        try:
            fn(*args)
        except (ConnectionError, OSError):
            self.done.set()

    def _timed_out(self, now: float, t0: float, last: float) -> str:
        if self.hello_timeout_s is not None and not self.said_hello and now - t0 > self.hello_timeout_s:
            return f"no Hello within hello_timeout_s={self.hello_timeout_s:g} s"
        if self.idle_timeout_s is not None and now - last > self.idle_timeout_s:
            return f"nothing but heartbeats for idle_timeout_s={self.idle_timeout_s:g} s"
        return ""

    def _handle(self, env: Envelope) -> None:
        srv = self.server
        k = M.kind(env)
        if k == "hello":
            hl = env.hello
            if hl.action_dim and hl.action_dim != srv.action_dim:
                self._reply(self.error, "invalid", f"robot takes D_a={hl.action_dim} but the policy outputs "
                                                   f"D_a={srv.action_dim}; serve a policy for this robot")
                return
            if self.ready is None:  # a repeated Hello (the robot heard nothing yet) gets the same Ready
                self.said_hello = True
                self.ready = Envelope(ready=M.pb.Ready(action_dim=srv.action_dim, chunk_size=srv.chunk_size,
                                                       supports_prefix=srv.supports_prefix, warmup_s=srv.warmup(hl)))
            self._reply(self.send, self.ready)
        elif k == "observation":
            o = env.observation
            if not o.request:
                return
            try:  # again with the policy's D_a and H (the transport may not know them)
                M.validate_observation(o, srv.limits)
            except M.MessageError as e:
                self._count(rejected=1)
                self._reply(self.error, e.code, e.detail, e.request_id)
                return
            self._count(requests=1)
            self.work.put((o, time.perf_counter()))
        elif k == "estop":
            log.warning("robot reported e-stop: %s", env.estop.reason)
        elif k == "error":
            log.warning("robot reported error: %s", env.error.message)
        elif k != "episode_end":
            self._reply(self.error, "invalid", f"a policy server does not accept {k!r} messages")

    def _worker(self) -> None:
        """Compute the requests in order; each chunk goes to the delivery thread."""
        srv = self.server
        while not self.done.is_set():
            try:
                o, t_recv = self.work.get(timeout=0.05)
            except queue.Empty:
                continue
            try:
                prefix, delay = self._prefix(o)
                latency = srv.delay_mode == "latency"
                a, compute_s = srv.infer_timed(o, prefix=prefix, delay=delay, pad=not latency)
                if srv.supports_prefix:
                    self.plan.record(o.episode, o.step, a)
                env = M.make_chunk(actions=a, start_step=o.step, episode=o.episode, obs_stamp_ns=o.stamp_ns,
                                   request_id=o.request_id, compute_s=compute_s)
                injected = srv.injected_delay_s() if latency else 0.0
                self._schedule(t_recv + injected, env, t_recv, max(injected, compute_s))
            except Exception as e:  # policy failure: report it, keep serving
                log.exception("inference failed")
                self._reply(self.error, "internal", f"inference failed: {e}", o.request_id)

    def _prefix(self, o: M.pb.Observation):
        """``(prefix float32 (P, D_a) or None, delay)`` to answer ``o`` with: with ``delay_steps > 0``
        the session's record continued by the robot's committed actions (``SessionPlan.compose``),
        else the request's own prefix; ``None`` when the policy does no real-time chunking."""
        srv = self.server
        if not srv.supports_prefix:
            return None, 0
        own = M.observation_arrays(o)[2]
        if o.delay_steps > 0:
            prefix = self.plan.compose(o.episode, o.step, own, srv.chunk_size)
            return prefix, min(int(o.delay_steps), 0 if prefix is None else len(prefix))
        return own, 0

    def _schedule(self, due: float, env: Envelope, t_recv: float, idle_s: float) -> None:
        """Send ``env`` at ``due`` (``perf_counter`` s); ``idle_s``: its server time had it found
        the server idle (the rest is reported as ``queue_s``)."""
        with self._outbox_cv:
            heapq.heappush(self._outbox, (due, next(self._seq), env, t_recv, idle_s))
            self._outbox_cv.notify()

    def _deliver(self) -> None:
        """Send each computed chunk at its due time (``time.perf_counter`` s), earliest first."""
        srv = self.server
        while not self.done.is_set():
            with self._outbox_cv:
                wait = 0.05 if not self._outbox else self._outbox[0][0] - time.perf_counter()
                if wait > 0:
                    self._outbox_cv.wait(min(wait, 0.05))
                    continue
                _, _, env, t_recv, idle_s = heapq.heappop(self._outbox)
            dt = time.perf_counter() - t_recv
            env.chunk.inference_s = dt
            env.chunk.queue_s = max(0.0, dt - idle_s)
            try:
                self.send(env)
            except (ConnectionError, OSError):
                self.done.set()
                return
            with srv._stats_lock:
                srv.stats["inference_s"].append(dt)
            self._count(chunks=1)

    def _heartbeat(self) -> None:
        while not self.done.wait(self.server.heartbeat_s):
            try:
                self.send(Envelope(heartbeat=M.pb.Heartbeat(stamp_ns=M.now_ns())))
            except Exception:
                self.done.set()
