"""In-process transport: two endpoints joined by queues of serialized envelopes (same bytes and
validation as the network transports, no sockets)."""

from __future__ import annotations

import queue

from robot_bridge.messages import Limits
from robot_bridge.transports.base import _CLOSED, ByteTransport, TransportLink


class InProcTransport(ByteTransport):
    """One endpoint of an in-process link. Build a connected pair with :meth:`pair`."""

    def __init__(self, limits: Limits | None = None):
        super().__init__(limits)
        self._peer: InProcTransport | None = None

    @classmethod
    def pair(cls, limits_a: Limits | None = None, limits_b: Limits | None = None) -> tuple["InProcTransport", "InProcTransport"]:
        """``(robot_end, server_end)``; each end validates what it receives with its own limits."""
        a, b = cls(limits_a), cls(limits_b)
        a._peer, b._peer = b, a
        return a, b

    def send_bytes(self, data: bytes) -> None:
        if self._closed.is_set() or self._peer is None or self._peer._closed.is_set():
            raise ConnectionError("InProcTransport: link closed")
        self._peer._inbox.put(bytes(data))

    def close(self) -> None:
        if not self._closed.is_set():
            super().close()
            if self._peer is not None:
                self._peer._inbox.put(_CLOSED)


class InProcEndpoint:
    """Server endpoint of :class:`InProcLink`: ``accept`` hands out the server end of each pair
    opened by :meth:`InProcLink.robot`."""

    address = "inproc"

    def __init__(self, limits: Limits | None = None):
        self.limits = limits or Limits()
        self._pending: queue.Queue = queue.Queue()
        self.closed = False

    def accept(self, timeout: float | None = None) -> InProcTransport | None:
        try:
            return self._pending.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        self.closed = True


class InProcLink(TransportLink):
    """``configs/transport/inproc.yaml``: the policy server runs in a thread of the robot process
    (``same_process``); :meth:`server` must be called before :meth:`robot`."""

    name = "inproc"
    same_process = True

    def __init__(self, connect_timeout_s: float = 1.0):
        self.connect_timeout_s = float(connect_timeout_s)
        self._endpoint: InProcEndpoint | None = None

    def server(self, limits: Limits, *, max_sessions: int = 4) -> InProcEndpoint:
        self._endpoint = InProcEndpoint(limits)
        return self._endpoint

    def robot(self, limits: Limits, *, cameras=(), control_hz: float = 20.0,
              connect_timeout_s: float | None = None) -> InProcTransport:
        ep = self._endpoint
        if ep is None or ep.closed:
            raise ConnectionError("no in-process policy server (InProcLink.server() was not called or is closed)")
        robot_end, server_end = InProcTransport.pair(limits, ep.limits)
        ep._pending.put(server_end)
        return robot_end

    def start_hint(self) -> str:
        return "the in-process server runs inside `wmrl robot` (inproc_server.*)"
