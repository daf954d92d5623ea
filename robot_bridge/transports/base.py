"""Shared base of the byte transports (in-process, gRPC): one serialized ``Envelope`` per message.

Every transport implements :class:`wmrl.interfaces.Transport`: ``send(envelope)``,
``recv(timeout) -> envelope | None``, ``close()``. ``recv`` raises
:class:`robot_bridge.messages.MessageError` for a rejected message (the link stays up: call
``recv`` again) and ``ConnectionError`` once the peer is gone.
"""

from __future__ import annotations

import queue
import threading

from robot_bridge.messages import Envelope, Limits, decode, encode

_CLOSED = object()


class ByteTransport:
    """Base class: subclasses provide ``send_bytes`` and fill ``self._inbox`` with received bytes
    (or ``_CLOSED`` when the peer went away)."""

    def __init__(self, limits: Limits | None = None):
        self.limits = limits or Limits()
        self._inbox: queue.Queue = queue.Queue()
        self._closed = threading.Event()
        self._peer_gone = False

    # -- Transport protocol
    def send(self, message: Envelope) -> None:
        """Serialize and send; ``MessageError('oversized')`` if over the limit, ``ConnectionError``
        when closed."""
        self.send_bytes(encode(message, self.limits))

    def recv(self, timeout: float | None = None) -> Envelope | None:
        if self._peer_gone:
            raise ConnectionError(f"{type(self).__name__}: peer disconnected")
        try:
            data = self._inbox.get(timeout=timeout)
        except queue.Empty:
            return None
        if data is _CLOSED:
            self._peer_gone = True
            raise ConnectionError(f"{type(self).__name__}: peer disconnected")
        return decode(data, self.limits)

    def close(self) -> None:
        self._closed.set()

    @property
    def closed(self) -> bool:
        return self._closed.is_set() or self._peer_gone

    # -- subclasses
    def send_bytes(self, data: bytes) -> None:  # pragma: no cover - abstract
        raise NotImplementedError
