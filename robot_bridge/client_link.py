"""The robot client's link to the policy server (mixin of ``robot_bridge.client.RobotClient``):
opening it (``Hello`` / ``Ready``), its sender and receiver threads, the messages from the
server (chunks merged into the action queue with their latency, ``Ready``, e-stop, errors) and
closing it. See the Links paragraph of ``robot_bridge.client``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from robot_bridge import messages as M
from robot_bridge.reconnect import ReconnectPolicy, with_retry

log = logging.getLogger("robot_bridge.client")


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


class ServerLink:
    """Connection half of :class:`robot_bridge.client.RobotClient`; uses its ``robot``, ``cfg``,
    ``queue``, ``watchdog``, ``transport_factory``, ``_lock``, request ``timer`` and latency
    bookkeeping, and calls its ``estop`` and ``_new_timer``."""

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
            ready = self._handshake(link)
        except BaseException:
            self.drop_link()
            raise
        self._new_timer(ready.chunk_size)  # a new link: a cold round-trip estimate
        self.ready = ready
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
                if e.request_id:
                    with self._lock:
                        self.timer.answered(e.request_id)
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
            if env.error.request_id:
                with self._lock:
                    self.timer.answered(env.error.request_id)

    def _on_chunk(self, c: M.pb.ActionChunk) -> None:
        """Merge a chunk into the queue (latency-aware, the newest observation winning) and feed
        its round trip, queue wait and compute time (s) to the request timer; a chunk of another
        episode only does the latter."""
        t_arrive = M.now_ns()
        rt = (t_arrive - c.obs_stamp_ns) * 1e-9
        with self._lock:
            self.timer.answered(c.request_id)
            self.timer.measured(rt, c.queue_s, c.compute_s, t_arrive * 1e-9)
        if c.episode != self._episode:
            return
        a = M.chunk_array(c)
        with self._lock:
            res = self.queue.insert(a, int(c.start_step), self._next_step)
        cid = res.chunk_id
        lat = rt - c.inference_s
        self._round_trips.append(rt)
        self._latencies.append(lat)
        self._chunk_latency[cid] = lat
        log.debug("chunk %d: start %d skipped %d superseded %d latency %.2f ms", cid, c.start_step, res.skipped,
                  res.superseded, lat * 1e3)
