"""Policy server: answers every chunk request of a robot client with an action chunk.

Differences from LeRobot 0.6.1 async inference, by design:
every request is answered (no observation is dropped as "too similar"); the policy is warmed up
(one dummy inference of the robot's shapes) before ``Ready`` is sent, so the first real request
is not cold; inference runs in a worker thread so the connection keeps receiving, heart-beating
and rejecting bad messages while the policy thinks; the first action of a chunk is not dropped
(the client skips exactly the actions that are stale, see ``robot_bridge.queue``); protobuf only.

Sessions. :meth:`PolicyServer.serve` serves one robot connection (a *session*: its own request
queue, inference worker computing its requests in order, a delivery thread sending each chunk
when its injected delay is over, its record of the chunks computed (``robot_bridge.plan``),
heartbeat and timeouts; see ``robot_bridge.session``); :meth:`PolicyServer.serve_endpoint` accepts
connections from a transport endpoint (``GrpcServer``, the ROS 2 server endpoint) and serves up
to :attr:`SessionLimits.max_sessions` of them at once, each in its own thread, so a client that
only sends heartbeats never delays another robot's ``Ready``. Inference of all sessions runs on
the one policy, one call at a time. A connection beyond ``max_sessions`` is answered with an
``Error`` ``[busy]`` and closed, or waits for a free session (``on_busy="queue"``). A session
that sends no ``Hello`` within ``hello_timeout_s``, or nothing but heartbeats for
``idle_timeout_s``, is ended with an ``Error`` ``[timeout]``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import numpy as np
import torch

from robot_bridge import messages as M
from robot_bridge.session import Session, SessionLimits
from wmrl.kernel.types import Obs

log = logging.getLogger("robot_bridge.server")

Envelope = M.Envelope
DELAY_MODES = ("latency", "compute")
_OWN = object()  # infer_timed: the request's own prefix


def obs_from_message(o: M.pb.Observation) -> Obs:
    """Batch-1 ``wmrl.kernel.types.Obs`` from an observation message."""
    proprio, images, _ = M.observation_arrays(o)
    return Obs(images={k: torch.from_numpy(np.ascontiguousarray(v))[None] for k, v in images.items()},
               proprio=torch.from_numpy(proprio)[None], task=[o.task])


class PolicyServer:
    """Serves a chunking policy to robot clients, one session per transport connection.

    Args:
        policy: ``wmrl.kernel.interfaces.Policy`` (``sample(Obs) -> PolicySample`` with actions
            ``(1, H, D_a)``). Requests carrying a prefix are answered by
            ``policy.sample(obs, generator, prefix=, delay=)`` (real-time chunking, done by the
            policy: e.g. ``policies.rtc``) when ``rtc`` and ``policy.supports_rtc``; the server
            only passes the committed actions (controller units) and the delay in steps.
        inference_delay_s: injected delay per request (benchmarks: simulate a large policy or a
            slow link); 0 = off. See ``delay_mode``.
        delay_jitter_s: uniform extra delay in ``[0, delay_jitter_s]``.
        delay_mode: ``"latency"``: a chunk is sent ``inference_delay_s`` after its request was
            received (or when computed, if later); the policy itself runs at once, so requests in
            flight overlap their delays, as on a remote or pipelined (batching) inference server
            or over a slow network. ``"compute"``: the delay pads the policy call and holds the
            policy, so requests take turns, as one GPU busy for that long; then one chunk comes
            per ``inference_delay_s`` at best, and beyond ``H / 2`` of delay no request timing
            keeps the robot fed (the client's fallback decides).
        heartbeat_s: period of ``Heartbeat`` messages (the client's watchdog listens to them).
        limits: what is accepted from the robot (``action_dim`` and ``chunk_size`` are set from
            the policy).
        seed: generator seed for sampling.
        rtc: answer prefixed requests with real-time chunking (when the policy supports it).

    Requests with ``delay_steps > 0`` are answered with a chunk that continues the session's
    record of what it already computed for the robot (``robot_bridge.plan.SessionPlan``), so
    requests sent while earlier ones are in flight stay consistent (real-time chunking).

    ``stats`` sums every session: ``requests``, ``chunks``, ``errors_sent``, ``rejected``,
    ``inference_s`` (list: server-side time of each chunk, request received to chunk sent, s),
    ``sessions`` (served), ``busy`` (refused), ``timeouts`` (ended).
    ``sessions`` lists one summary per ended session (see :meth:`serve`).
    """

    def __init__(self, policy: Any, *, inference_delay_s: float = 0.0, delay_jitter_s: float = 0.0,
                 heartbeat_s: float = 0.1, limits: M.Limits | None = None, seed: int = 0, rtc: bool = True,
                 delay_mode: str = "latency"):
        if delay_mode not in DELAY_MODES:
            raise ValueError(f"delay_mode must be one of {DELAY_MODES}, got {delay_mode!r}")
        self.policy = policy
        self.action_dim = int(policy.action_dim)
        self.chunk_size = int(policy.chunk_size)
        self.inference_delay_s = float(inference_delay_s)
        self.delay_jitter_s = float(delay_jitter_s)
        self.delay_mode = delay_mode
        self.heartbeat_s = float(heartbeat_s)
        lim = limits or M.Limits()
        self.limits = M.Limits(**{**lim.__dict__, "action_dim": self.action_dim, "chunk_size": self.chunk_size})
        self.generator = torch.Generator().manual_seed(seed)
        self.rng = np.random.default_rng(seed)
        self.supports_prefix = bool(rtc) and bool(policy.supports_rtc)
        self.stats = {"requests": 0, "chunks": 0, "errors_sent": 0, "rejected": 0, "inference_s": [],
                      "sessions": 0, "busy": 0, "timeouts": 0}
        self.sessions: list[dict] = []
        self._stop = threading.Event()
        self._policy_lock = threading.Lock()  # one inference at a time on the shared policy
        self._stats_lock = threading.Lock()
        self.last_inference_s = 0.0

    # ------------------------------------------------------------------ inference
    def infer(self, o: M.pb.Observation) -> np.ndarray:
        """Actions ``float32 (H, D_a)`` for one observation message (its own prefix and delay,
        padded to the injected delay); see :meth:`infer_timed`."""
        a, self.last_inference_s = self.infer_timed(o)
        return a

    def injected_delay_s(self) -> float:
        """The injected delay of one request (s): ``inference_delay_s`` plus its jitter."""
        return self.inference_delay_s + (self.rng.uniform(0, self.delay_jitter_s) if self.delay_jitter_s else 0.0)

    def infer_timed(self, o: M.pb.Observation, prefix: Any = _OWN, delay: int | None = None,
                    pad: bool = True) -> tuple[np.ndarray, float]:
        """``(actions float32 (H, D_a), time s)`` for one observation message.

        Args:
            o: the request.
            prefix: committed actions ``float32 (P, D_a)`` to continue (real-time chunking, when
                :attr:`supports_prefix`), ``None`` for none; default: the message's own.
            delay: prefix actions frozen (``min(delay, P)``); default: the message's ``delay_steps``.
            pad: pad the policy call to the injected delay (holding the policy); else the time is
                the policy call alone.

        Holds the policy for the whole call (sessions take turns).

        Raises:
            RuntimeError: the policy returned another shape or a non-finite action.
        """
        obs = obs_from_message(o)
        if prefix is _OWN:
            prefix = M.observation_arrays(o)[2]
        d = int(o.delay_steps if delay is None else delay)
        with self._policy_lock:
            t0 = time.perf_counter()  # inference = the policy call (padded to the injected delay)
            if self.supports_prefix and prefix is not None and len(prefix):  # guidance may need autograd
                actions = self.policy.sample(obs, generator=self.generator, prefix=torch.from_numpy(prefix),
                                             delay=min(d, len(prefix))).actions
            else:
                with torch.no_grad():
                    actions = self.policy.sample(obs, generator=self.generator).actions
            rest = (self.injected_delay_s() if pad else 0.0) - (time.perf_counter() - t0)
            if rest > 0:
                time.sleep(rest)
            dt = time.perf_counter() - t0
        a = actions.detach().to(torch.float32).cpu().numpy()
        if a.ndim != 3 or a.shape[0] != 1 or a.shape[2] != self.action_dim:
            raise RuntimeError(f"policy returned actions of shape {a.shape}, expected (1, H, {self.action_dim})")
        if not np.isfinite(a).all():
            raise RuntimeError("policy returned NaN or inf actions; no chunk sent")
        return a[0], dt

    def warmup(self, hello: M.pb.Hello) -> float:
        """One dummy inference with the robot's shapes (zeros), not padded by the delay; returns
        its duration in s (including any wait for another session's inference)."""
        t0 = time.perf_counter()
        h = hello.image_height or 64
        w = hello.image_width or 64
        obs = Obs(images={c: torch.zeros(1, 3, h, w, dtype=torch.uint8) for c in hello.cameras},
                  proprio=torch.zeros(1, max(1, hello.state_dim)), task=[hello.task])
        with self._policy_lock, torch.no_grad():
            self.policy.sample(obs, generator=torch.Generator().manual_seed(0))
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ serving
    def stop(self) -> None:
        """End every session and :meth:`serve_endpoint` (within ~0.1 s)."""
        self._stop.set()

    def count(self, **inc) -> None:
        """Add to :attr:`stats` (thread-safe)."""
        with self._stats_lock:
            for k, v in inc.items():
                self.stats[k] += v

    def serve(self, transport, idle_timeout_s: float | None = None, hello_timeout_s: float | None = None) -> dict:
        """Serve one connection (a session) until the peer disconnects, ``stop()`` is called, or a
        timeout ends it: no ``Hello`` within ``hello_timeout_s``, or nothing but heartbeats for
        ``idle_timeout_s`` (``None``: no limit); a timeout is told to the robot as ``[timeout]``.

        Returns the session's summary: ``requests``, ``chunks``, ``rejected``, ``errors_sent``,
        ``duration_s``, ``ended`` (``"peer"`` | ``"stopped"`` | ``"timeout: ..."``).
        """
        sess = Session(self, transport, idle_timeout_s, hello_timeout_s)
        summary = sess.run()
        with self._stats_lock:
            self.stats["sessions"] += 1
            self.stats["timeouts"] += summary["ended"].startswith("timeout")
            self.sessions.append(summary)
        return summary

    def serve_endpoint(self, endpoint, limits: SessionLimits | None = None, accept_timeout_s: float | None = None,
                       max_connections: int = 0) -> list[dict]:
        """Accept robot connections from ``endpoint`` (``accept(timeout) -> transport | None``) and
        serve each in its own thread (:meth:`serve`), at most ``limits.max_sessions`` at once.

        Returns when ``stop()`` is called, when ``max_connections`` (> 0) sessions were started and
        have ended, or when no session was active and none connected for ``accept_timeout_s``.
        Returns :attr:`sessions`. The endpoint is not closed.
        """
        lim = limits or SessionLimits()
        slots = threading.BoundedSemaphore(int(lim.max_sessions))
        threads: list[threading.Thread] = []
        started = 0
        quiet_since = time.monotonic()
        while not self._stop.is_set() and (max_connections <= 0 or started < max_connections):
            conn = endpoint.accept(timeout=0.1)
            threads = [t for t in threads if t.is_alive()]
            if conn is None:
                if threads:
                    quiet_since = time.monotonic()
                elif accept_timeout_s is not None and time.monotonic() - quiet_since > accept_timeout_s:
                    log.info("no robot connected within %s s", accept_timeout_s)
                    break
                continue
            has_slot = slots.acquire(blocking=False)
            if not has_slot and lim.on_busy == "reject":
                self._refuse_busy(conn, lim)
                continue
            started += 1
            th = threading.Thread(target=self._session_thread, args=(conn, slots, has_slot, lim), daemon=True,
                                  name=f"server-session-{started}")
            th.start()
            threads.append(th)
        for t in threads:
            while t.is_alive():
                t.join(timeout=0.1)
        return self.sessions

    def _session_thread(self, conn, slots: threading.BoundedSemaphore, has_slot: bool, lim: SessionLimits) -> None:
        while not has_slot:  # on_busy="queue": wait for a session to end
            if self._stop.is_set():
                _close_quietly(conn)
                return
            has_slot = slots.acquire(timeout=0.1)
        try:
            self.serve(conn, idle_timeout_s=lim.idle_timeout_s, hello_timeout_s=lim.hello_timeout_s)
        except Exception:  # never let one session's fault end the server
            log.exception("session failed")
        finally:
            slots.release()
            _close_quietly(conn)

    def _refuse_busy(self, conn, lim: SessionLimits) -> None:
        log.warning("refused a robot connection: %d sessions already (max_sessions)", lim.max_sessions)
        self.count(busy=1)
        try:
            conn.send(M.make_error("busy", f"policy server busy: it serves max_sessions={lim.max_sessions} robots "
                                           f"already; retry later or raise max_sessions"))
        except Exception as e:  # the robot may be gone already
            log.debug("could not tell a robot it was refused: %s", e)
        _close_quietly(conn)

    def send_estop(self, transport, reason: str = "operator") -> None:
        transport.send(Envelope(estop=M.pb.EStop(reason=reason)))


def _close_quietly(conn) -> None:
    try:
        conn.close()
    except Exception:  # pragma: no cover
        pass
