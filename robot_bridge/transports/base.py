"""Shared base of the byte transports (in-process, gRPC): one serialized ``Envelope`` per message.

Every transport implements :class:`wmrl.kernel.interfaces.Transport`: ``send(envelope)``,
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
        self.end_reason = ""  # why the link ended, when the transport knows (e.g. a gRPC status)

    # -- Transport protocol
    def send(self, message: Envelope) -> None:
        """Serialize and send; ``MessageError('oversized')`` if over the limit, ``ConnectionError``
        when closed."""
        self.send_bytes(encode(message, self.limits))

    def recv(self, timeout: float | None = None) -> Envelope | None:
        """The next message, or ``None`` after ``timeout`` s.

        Raises:
            MessageError: the message was rejected (call ``recv`` again: the link stays up).
            ConnectionError: the peer is gone (with :attr:`end_reason` when known).
        """
        if not self._peer_gone:
            try:
                data = self._inbox.get(timeout=timeout)
            except queue.Empty:
                return None
            if data is not _CLOSED:
                return decode(data, self.limits)
            self._peer_gone = True
        raise ConnectionError(f"{type(self).__name__}: peer disconnected"
                              + (f" ({self.end_reason})" if self.end_reason else ""))

    def close(self) -> None:
        self._closed.set()

    @property
    def closed(self) -> bool:
        return self._closed.is_set() or self._peer_gone

    # -- subclasses
    def send_bytes(self, data: bytes) -> None:  # pragma: no cover - abstract
        raise NotImplementedError
