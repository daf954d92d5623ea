"""Example: a new bridge transport added by one module and one YAML file, with no edit to shared
code (``tests/examples/configs/transport/loopback.yaml``; used by ``tests/test_transport.py``).

The robot and the policy server talk over a local socket pair (``socket.socketpair``), each
serialized ``Envelope`` framed by its 4-byte big-endian length. Both ends live in one process,
so the link is ``same_process`` and ``wmrl robot transport=loopback`` starts the server in a
thread, as for ``transport=inproc`` (with this folder importable and its configs on Hydra's search
path: ``PYTHONPATH=tests/examples wmrl robot transport=loopback
'hydra.searchpath=[file://tests/examples/configs]'``). Only what every transport does is implemented:
``TransportLink.robot`` / ``server`` and a ``ByteTransport`` end (``send_bytes`` plus a reader
thread that fills the inbox, ``_CLOSED`` when the peer hung up).
"""

from __future__ import annotations

import queue
import socket
import struct
import threading

from robot_bridge.messages import Limits
from robot_bridge.transports.base import _CLOSED, ByteTransport, TransportLink


class SocketEnd(ByteTransport):
    """One end of a socket pair carrying length-prefixed serialized envelopes."""

    def __init__(self, sock: socket.socket, limits: Limits | None = None):
        super().__init__(limits)
        self._sock = sock
        self._send_lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True, name="loopback-read").start()

    def _read(self) -> None:
        f = self._sock.makefile("rb")
        try:
            while True:
                head = f.read(4)
                if len(head) < 4:
                    break
                self._inbox.put(f.read(struct.unpack(">I", head)[0]))
        except OSError:
            pass
        self._inbox.put(_CLOSED)

    def send_bytes(self, data: bytes) -> None:
        if self._closed.is_set():
            raise ConnectionError("SocketEnd: link closed")
        try:
            with self._send_lock:
                self._sock.sendall(struct.pack(">I", len(data)) + data)
        except OSError as e:
            raise ConnectionError(f"SocketEnd: peer gone ({e})") from None

    def close(self) -> None:
        if not self._closed.is_set():
            super().close()
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()


class LoopbackLink(TransportLink):
    """``transport=loopback``: a socket pair per robot connection, the server in this process."""

    name = "loopback"
    same_process = True

    def __init__(self, connect_timeout_s: float = 1.0):
        self.connect_timeout_s = float(connect_timeout_s)
        self._accepted: queue.Queue | None = None
        self._server_limits = Limits()

    def server(self, limits: Limits, *, max_sessions: int = 4):
        self._accepted, self._server_limits = queue.Queue(), limits
        link = self

        class Endpoint:
            address = "loopback socket pair"

            def accept(self, timeout=None):
                try:
                    return link._accepted.get(timeout=timeout)
                except queue.Empty:
                    return None

            def close(self):
                link._accepted = None

        return Endpoint()

    def robot(self, limits: Limits, *, cameras=(), control_hz: float = 20.0, connect_timeout_s=None):
        if self._accepted is None:
            raise ConnectionError("no loopback policy server (LoopbackLink.server() not called)")
        a, b = socket.socketpair()
        self._accepted.put(SocketEnd(b, self._server_limits))
        return SocketEnd(a, limits)
