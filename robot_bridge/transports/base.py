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


class TransportLink:
    """How the robot and the policy server reach each other over one transport: one subclass per
    transport, built from ``configs/transport/<name>.yaml`` by its Hydra ``_target_`` (the YAML's
    other keys are the constructor's arguments). The composition roots (``wmrl serve``,
    ``wmrl robot``, ``wmrl bench bridge``) use only these members, so a new transport is one
    class plus one YAML file (example: ``tests/examples/loopback_transport.py``).

    Attributes:
        name: the config name (``transport=<name>``), reported in ``wmrl robot``'s report.
        same_process: the policy server must run in the robot's process (``wmrl robot`` starts
            it in a thread; ``wmrl serve`` refuses the link).
        connect_timeout_s: the robot's first wait for the server (s), see ``wmrl robot``.
    """

    name = ""
    same_process = False
    connect_timeout_s = 1.0

    def robot(self, limits: Limits, *, cameras=(), control_hz: float = 20.0,
              connect_timeout_s: float | None = None):
        """A new robot end (a ``wmrl.kernel.interfaces.Transport``) connected to the server.
        ``connect_timeout_s``: how long to wait for the server (``None``: the transport's default).
        Raises ``ConnectionError`` when no server is reached."""
        raise NotImplementedError

    def server(self, limits: Limits, *, max_sessions: int = 4):
        """The server endpoint: ``accept(timeout) -> Transport | None`` per robot connection,
        ``address`` (str, printed by ``wmrl serve``) and ``close()``."""
        raise NotImplementedError

    def start_hint(self) -> str:
        """What to do when the robot reaches no server (appended to its ``ConnectionError``)."""
        return f"start `wmrl serve transport={self.name}` with the same transport settings"

    def overrides(self) -> list[str]:
        """The Hydra overrides that make ``wmrl serve`` / ``wmrl robot`` use this link."""
        return [f"transport={self.name}"]

    def on_loopback(self, index: int) -> "TransportLink":
        """A link of the same kind on a fresh loopback address (benchmarks and tests start many
        servers in a row); ``index`` tells runs apart (e.g. the DDS domain)."""
        return self
