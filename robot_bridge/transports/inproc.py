"""In-process transport: two endpoints joined by queues of serialized envelopes (same bytes and
validation as the network transports, no sockets)."""

from __future__ import annotations

from robot_bridge.messages import Limits
from robot_bridge.transports.base import _CLOSED, ByteTransport


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
