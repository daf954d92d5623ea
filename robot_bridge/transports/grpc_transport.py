"""gRPC transport: one bidirectional stream ``/wmrl.bridge.Bridge/Stream`` of serialized
``Envelope`` messages (schema ``robot_bridge/proto/bridge.proto``).

The stream carries raw bytes and each endpoint parses them itself (``robot_bridge.messages.decode``)
so that a malformed or oversized message is answered with an ``Error`` envelope while the stream
stays up (gRPC's own deserializer would abort the call). gRPC's hard message cap is set to twice
the bridge limit; only beyond it does gRPC itself reset the stream.

Loopback only by default: addresses must be ``127.0.0.1``, ``localhost`` or ``[::1]`` unless
``allow_remote=True``.

* robot side: ``GrpcClientTransport("127.0.0.1:50051")``;
* server side: ``srv = GrpcServer("127.0.0.1:0"); srv.port; t = srv.accept(timeout)`` gives a
  ``GrpcServerTransport`` per robot connection (``PolicyServer.serve_endpoint`` serves several
  at once). At most ``max_streams`` streams are open at once; gRPC itself refuses more with
  ``RESOURCE_EXHAUSTED``, which the robot's ``recv`` reports in its ``ConnectionError``.
"""

from __future__ import annotations

import queue
import threading
from concurrent import futures

import grpc

from robot_bridge.messages import Limits
from robot_bridge.transports.base import _CLOSED, ByteTransport, TransportLink

METHOD = "/wmrl.bridge.Bridge/Stream"
_LOOPBACK = ("127.0.0.1", "localhost", "[::1]", "::1")


def _check_loopback(address: str, allow_remote: bool) -> None:
    host = address.rsplit(":", 1)[0]
    if not allow_remote and host not in _LOOPBACK:
        raise ValueError(f"gRPC address {address!r} is not loopback; use 127.0.0.1:<port> or pass "
                         f"allow_remote=True for a real deployment")


def _options(limits: Limits) -> list[tuple[str, int]]:
    cap = 2 * limits.max_message_bytes + 1024
    return [("grpc.max_receive_message_length", cap), ("grpc.max_send_message_length", cap),
            ("grpc.so_reuseport", 0), ("grpc.http2.min_time_between_pings_ms", 1000)]


class GrpcClientTransport(ByteTransport):
    """Robot-side endpoint: opens the stream to a :class:`GrpcServer`.

    Raises ``ConnectionError`` from ``connect`` when the server cannot be reached in ``timeout``.
    """

    def __init__(self, address: str, limits: Limits | None = None, allow_remote: bool = False,
                 connect_timeout_s: float = 10.0):
        super().__init__(limits)
        _check_loopback(address, allow_remote)
        self.address = address
        self._out: queue.Queue = queue.Queue()
        self._channel = grpc.insecure_channel(address, options=_options(self.limits))
        try:
            grpc.channel_ready_future(self._channel).result(timeout=connect_timeout_s)
        except grpc.FutureTimeoutError:
            self._channel.close()
            raise ConnectionError(f"no gRPC policy server at {address} within {connect_timeout_s} s") from None
        stream = self._channel.stream_stream(METHOD, request_serializer=None, response_deserializer=None)
        self._call = stream(self._requests())
        self._reader = threading.Thread(target=self._read, daemon=True, name="grpc-client-read")
        self._reader.start()

    def _requests(self):
        while True:
            item = self._out.get()
            if item is _CLOSED:
                return
            yield item

    def _read(self) -> None:
        try:
            for data in self._call:
                self._inbox.put(data)
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            if code is not None and code != grpc.StatusCode.CANCELLED:
                self.end_reason = f"gRPC {code.name}: {e.details()}"
        self._inbox.put(_CLOSED)

    def send_bytes(self, data: bytes) -> None:
        if self.closed:
            raise ConnectionError(f"gRPC stream to {self.address} is closed")
        self._out.put(bytes(data))

    def close(self) -> None:
        if not self._closed.is_set():
            super().close()
            self._out.put(_CLOSED)
            try:
                self._call.cancel()
            except Exception:  # pragma: no cover
                pass
            self._channel.close()


class GrpcServerTransport(ByteTransport):
    """Server-side endpoint of one robot's stream (made by :class:`GrpcServer`)."""

    def __init__(self, limits: Limits):
        super().__init__(limits)
        self._out: queue.Queue = queue.Queue()

    def send_bytes(self, data: bytes) -> None:
        if self.closed:
            raise ConnectionError("gRPC stream closed by the robot")
        self._out.put(bytes(data))

    def close(self) -> None:
        if not self._closed.is_set():
            super().close()
            self._out.put(_CLOSED)


class GrpcServer:
    """gRPC server accepting robot streams on ``address`` (``port 0``: pick a free port).

    ``max_streams``: streams open at once (robot sessions plus connections being told
    ``[busy]``); beyond it gRPC refuses a stream with ``RESOURCE_EXHAUSTED``.
    """

    def __init__(self, address: str = "127.0.0.1:0", limits: Limits | None = None, allow_remote: bool = False,
                 max_streams: int = 8):
        _check_loopback(address, allow_remote)
        self.limits = limits or Limits()
        self._accepted: queue.Queue = queue.Queue()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_streams + 2),
                                   options=_options(self.limits), maximum_concurrent_rpcs=max_streams)
        handler = grpc.method_handlers_generic_handler(
            "wmrl.bridge.Bridge",
            {"Stream": grpc.stream_stream_rpc_method_handler(self._stream, request_deserializer=None,
                                                             response_serializer=None)})
        self._server.add_generic_rpc_handlers((handler,))
        self.port = self._server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"could not bind gRPC server to {address}")
        self.address = f"{address.rsplit(':', 1)[0]}:{self.port}"
        self._server.start()

    def _stream(self, request_iterator, context):
        conn = GrpcServerTransport(self.limits)

        def pump():
            try:
                for data in request_iterator:
                    conn._inbox.put(data)
            except grpc.RpcError:
                pass
            conn._inbox.put(_CLOSED)
            conn._out.put(_CLOSED)

        threading.Thread(target=pump, daemon=True, name="grpc-server-read").start()
        self._accepted.put(conn)
        while True:
            item = conn._out.get()
            if item is _CLOSED:
                return
            yield item

    def accept(self, timeout: float | None = None) -> GrpcServerTransport | None:
        """The next robot connection, or ``None`` after ``timeout`` s."""
        try:
            return self._accepted.get(timeout=timeout)
        except queue.Empty:
            return None

    def stop(self, grace: float | None = 0.5) -> None:
        self._server.stop(grace)

    def close(self) -> None:
        """Stop at once (no grace)."""
        self.stop(0)


class GrpcLink(TransportLink):
    """``configs/transport/grpc.yaml``: the robot opens a :class:`GrpcClientTransport` to a
    :class:`GrpcServer` at ``address`` (loopback only unless ``allow_remote``)."""

    name = "grpc"

    def __init__(self, address: str = "127.0.0.1:50051", allow_remote: bool = False, connect_timeout_s: float = 1.0):
        self.address = str(address)
        self.allow_remote = bool(allow_remote)
        self.connect_timeout_s = float(connect_timeout_s)

    def robot(self, limits: Limits, *, cameras=(), control_hz: float = 20.0,
              connect_timeout_s: float | None = None) -> GrpcClientTransport:
        kw = {} if connect_timeout_s is None else {"connect_timeout_s": connect_timeout_s}
        return GrpcClientTransport(self.address, limits, allow_remote=self.allow_remote, **kw)

    def server(self, limits: Limits, *, max_sessions: int = 4) -> GrpcServer:
        # room for the connections told [busy]
        return GrpcServer(self.address, limits, allow_remote=self.allow_remote, max_streams=int(max_sessions) + 4)

    def start_hint(self) -> str:
        return (f"start `wmrl serve transport=grpc transport.address={self.address}` or set "
                f"transport.address to where it listens")

    def overrides(self) -> list[str]:
        return [f"transport={self.name}", f"transport.address={self.address}"]

    def on_loopback(self, index: int) -> "GrpcLink":
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        return GrpcLink(f"127.0.0.1:{port}", connect_timeout_s=self.connect_timeout_s)
