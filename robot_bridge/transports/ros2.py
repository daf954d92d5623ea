"""ROS 2 transport without ROS: Cyclone DDS with ROS 2 topic and type names.

Topics (ROS 2 name -> DDS topic ``rt/<name>``), namespace ``/wmrl`` by default:

==============================  ================================  ==================
topic                           type                              direction
==============================  ================================  ==================
``/wmrl/joint_states``          ``sensor_msgs/msg/JointState``    robot -> server
``/wmrl/<camera>/image_raw``    ``sensor_msgs/msg/Image`` (rgb8)  robot -> server
``/wmrl/chunk_request``         ``trajectory_msgs/msg/JointTrajectory`` (RTC prefix) robot -> server
``/wmrl/action_chunk``          ``trajectory_msgs/msg/JointTrajectory``  server -> robot
``/wmrl/estop``                 ``std_msgs/msg/Bool``             server/operator -> robot
``/wmrl/bridge/to_server``      ``std_msgs/msg/String`` (JSON of the protobuf message)  robot -> server
``/wmrl/bridge/to_robot``       ``std_msgs/msg/String`` (JSON)    server -> robot
==============================  ================================  ==================

One observation is a ``JointState`` (proprio in ``position``), one ``Image`` per camera and one
``JointTrajectory`` on ``chunk_request`` (the committed prefix as points), all with the same
``header.stamp`` (the capture time); the server assembles them by stamp. The bridge's
bookkeeping (episode, control step, request id, delay steps, number of images, inference time)
travels in ``header.frame_id`` as ``"<frame>;ep=0;step=12;req=5;delay=3;n=2"``. A chunk is a
``JointTrajectory`` whose ``joint_names`` name the action dimensions and whose point ``i``
holds action ``i`` with ``time_from_start = i / control_hz``.

Sessions. The topics are shared by every robot in the namespace, so the server tells robots
apart by the DDS participant that wrote each sample (its GUID, from the sample's publication
handle): ``Ros2Transport(role="server")`` is an endpoint whose :meth:`~Ros2Transport.accept`
yields one :class:`Ros2Session` (a transport) per robot participant, as ``GrpcServer`` yields
one per stream. Every server message is addressed to its robot: ``to=<GUID>`` in a chunk's
``header.frame_id``, the envelope's ``session`` field in the JSON; a robot drops what is
addressed to another. ``/wmrl/estop`` (``Bool``) has no address: it stops every robot in the
namespace. A session ends when the server closes it or its robot's participant disappears
(``recv`` raises ``ConnectionError``); later samples of that participant are dropped.

Messages that do not fit (malformed bookkeeping, inconsistent image sizes, chunk points of the
wrong width, bad JSON) raise :class:`robot_bridge.messages.MessageError` from ``recv`` of the
session of the robot that wrote them; nothing is torn down. To the robot a dead server is
silence (the client's watchdog handles it); ``connect_timeout_s`` makes a robot endpoint fail at
once with ``ConnectionError`` when no server is there.

Loopback only for tests: :func:`loopback_config` restricts Cyclone DDS to ``lo`` without
multicast, with ``127.0.0.1`` as the only discovery peer, and lets a deleted writer wait only
20 ms for acknowledgements. With Cyclone's own defaults (``config=""``) closing a robot endpoint
whose server died (and has not yet expired) waits ``Internal/WriterLingerDuration`` (1 s) per
writer, about 5 s before a reconnect; set it lower in ``CYCLONEDDS_URI``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from importlib import resources

from cyclonedds.internal import InvalidSample
from google.protobuf import json_format

from robot_bridge import messages as M
from robot_bridge.transports import ros2_types as R
from robot_bridge.transports.base import TransportLink
from robot_bridge.transports.ros2_codec import ACTION_NAMES_7, Ros2Codec  # noqa: F401 (re-exported)
from robot_bridge.transports.ros2_session import Ros2Session, Ros2SessionTable, _get  # noqa: F401 (Ros2Session re-exported)

log = logging.getLogger("robot_bridge.transports.ros2")

_DOMAINS: dict = {}
_LIVE: set = set()
POLL_S = 0.001  # reader poll period while every reader is empty (s): at most this much added latency
_DOMAINS_LOCK = threading.Lock()

def loopback_config() -> str:
    """Cyclone DDS XML: interface ``lo``, no multicast, unicast discovery of ``127.0.0.1`` only."""
    return resources.files("robot_bridge.transports").joinpath("cyclonedds_loopback.xml").read_text()


class Ros2Transport(Ros2Codec, Ros2SessionTable):
    """One endpoint (``role="robot"`` or ``"server"``) of the ROS 2 link.

    The robot endpoint is a transport (``send``, ``recv``, ``close``); the server endpoint
    hands out one :class:`Ros2Session` transport per robot with :meth:`accept`.

    Args:
        role: which side this is.
        cameras: camera names (one image topic each).
        domain_id: DDS domain (``ROS_DOMAIN_ID``).
        namespace: ROS namespace of the topics.
        limits: what is accepted (``action_dim`` checked on chunks, sizes on images).
        config: Cyclone DDS XML; default :func:`loopback_config`; ``""``: Cyclone's own defaults
            (``CYCLONEDDS_URI``).
        control_hz: used for ``time_from_start`` of trajectory points.
        frame: coordinate frame written in headers.
        match_timeout_s: how long the first message on a topic waits for a subscriber.
        connect_timeout_s: robot only: wait this long (s) for a policy server's reader of
            ``bridge/to_server`` and raise ``ConnectionError`` when none is discovered
            (``None``: do not wait).

    Attributes:
        session: robot: this endpoint's session id (its DDS participant GUID); server: ``""``.
    """

    def __init__(self, role: str, cameras=("agentview", "robot0_eye_in_hand"), domain_id: int = 0,
                 namespace: str = "/wmrl", limits: M.Limits | None = None, config: str | None = None,
                 control_hz: float = 20.0, frame: str = "base", action_names: list[str] | None = None,
                 match_timeout_s: float = 3.0, connect_timeout_s: float | None = None):
        if role not in ("robot", "server"):
            raise ValueError(f"role must be 'robot' or 'server', got {role!r}")
        self.role = role
        self.cameras = list(cameras)
        self.limits = limits or M.Limits()
        self.control_hz = control_hz
        self.frame = frame
        self.action_names = action_names
        self.match_timeout_s = match_timeout_s
        self.address = f"ros2 domain {domain_id}"
        self._inbox: queue.Queue = queue.Queue()
        self._closed = False
        self._poller: threading.Thread | None = None
        self._lock = threading.Lock()
        self._init_sessions()
        ns = namespace.rstrip("/")
        self._open_dds(domain_id, ns, loopback_config() if config is None else config)
        self.session = str(self.dp.guid) if role == "robot" else ""
        # Keep the DDS entities reachable until close(), which stops the poller before deleting them.
        _LIVE.add(self)
        self._poller = threading.Thread(target=self._poll_loop, daemon=True, name=f"ros2-{role}-poll")
        self._poller.start()
        if role == "robot" and connect_timeout_s is not None:
            self._require_server(connect_timeout_s, domain_id, ns)

    def _open_dds(self, domain_id: int, ns: str, cfg: str) -> None:
        """The participant, the topics of namespace ``ns`` and this role's readers and writers
        (``cfg``: Cyclone XML for the domain, ``""``: Cyclone's defaults)."""
        from cyclonedds.core import Policy, Qos
        from cyclonedds.domain import Domain, DomainParticipant
        from cyclonedds.pub import DataWriter
        from cyclonedds.sub import DataReader
        from cyclonedds.topic import Topic

        with _DOMAINS_LOCK:  # one configured Domain per process and id (Cyclone's rule)
            if cfg and domain_id not in _DOMAINS:
                _DOMAINS[domain_id] = Domain(domain_id, cfg)
        self.dp = DomainParticipant(domain_id)
        qos = Qos(Policy.Reliability.Reliable(max_blocking_time=100_000_000), Policy.History.KeepLast(32),
                  Policy.DataRepresentation(use_cdrv0_representation=True))
        self._entities: list = []  # deleted explicitly, children first, in close()

        def topic(name, typ):
            t = Topic(self.dp, f"rt{ns}/{name}", typ, qos=qos)
            self._entities.append(t)
            return t

        t_js = topic("joint_states", R.JointState)
        t_img = {c: topic(f"{c}/image_raw", R.Image) for c in self.cameras}
        t_req = topic("chunk_request", R.JointTrajectory)
        t_chunk = topic("action_chunk", R.JointTrajectory)
        t_estop = topic("estop", R.Bool)
        t_to_server = topic("bridge/to_server", R.String)
        t_to_robot = topic("bridge/to_robot", R.String)
        self._writers_matched: set[int] = set()
        self._polled: list = []  # (reader, handler), taken by the poller thread

        def reader(t, fn):
            r = DataReader(self.dp, t, qos=qos)
            self._entities.insert(0, r)
            self._polled.append((r, fn))
            return r

        def writer(t):
            w = DataWriter(self.dp, t, qos=qos)
            self._entities.insert(0, w)
            return w

        if self.role == "robot":
            self.w_js = writer(t_js)
            self.w_img = {c: writer(t) for c, t in t_img.items()}
            self.w_req = writer(t_req)
            self.w_ctrl = writer(t_to_server)
            self._readers = [reader(t_chunk, self._on_chunk), reader(t_to_robot, self._on_ctrl),
                             reader(t_estop, self._on_estop)]
        else:
            self.w_chunk = writer(t_chunk)
            self.w_ctrl = writer(t_to_robot)
            self.w_estop = writer(t_estop)
            self._readers = [reader(t_js, self._on_js), reader(t_req, self._on_req), reader(t_to_server, self._on_ctrl)]
            self._readers += [reader(t, lambda im, key, c=c: self._on_img(im, c, key)) for c, t in t_img.items()]

    # ------------------------------------------------------------------ plumbing
    def _poll_loop(self) -> None:
        """Take the samples of every reader from this Python thread, ``POLL_S`` apart while all are
        empty. No DDS listener: cyclonedds-python's write/take hold the GIL inside Cyclone, while a
        listener callback runs in a Cyclone thread and needs the GIL, so a write blocked on a lock
        that thread holds froze every thread of the process (seen with several endpoints in one
        process: a robot's connect() never returned). Polling keeps Cyclone's threads out of Python."""
        while not self._closed:
            got = 0
            for r, fn in self._polled:
                if self._closed:
                    return
                got += self._take(fn, r)
            if not got:
                time.sleep(POLL_S)

    def _take(self, fn, r) -> int:
        """Hand every new sample of ``r`` to ``fn(sample, session) -> envelope | None`` and deliver
        the result (or the ``MessageError`` it raised) to the sender's session. Returns the
        number of samples taken."""
        try:
            samples = r.take(N=64)
        except Exception as e:  # never kill the poller thread
            if not self._closed:
                log.warning("could not take ROS 2 samples: %s", e)
            return 0
        for smp in samples:
            if isinstance(smp, InvalidSample):
                continue  # a writer's dispose / unregister (e.g. a robot closing), no data
            key = self._sender(r, smp)
            try:
                item = fn(smp, key)
            except M.MessageError as e:
                item = e
            except Exception as e:  # never kill the poller thread
                item = M.MessageError("malformed", f"could not read a ROS 2 message: {e}")
            if item is not None:
                self._deliver(item, key)
        return len(samples)

    def _write(self, w, msg) -> None:
        if self._closed:
            raise ConnectionError("Ros2Transport is closed")
        if id(w) not in self._writers_matched:
            t_end = time.monotonic() + self.match_timeout_s
            while w.get_publication_matched_status().current_count == 0 and time.monotonic() < t_end:
                time.sleep(0.01)
            self._writers_matched.add(id(w))
        try:
            w.write(msg)
        except Exception:
            if self._closed:  # deleted under the writer by close() from another thread
                raise ConnectionError("Ros2Transport is closed") from None
            raise

    def _require_server(self, timeout_s: float, domain_id: int, ns: str) -> None:
        if not self.wait_for_peer(timeout_s):
            self.close()
            raise ConnectionError(f"no ROS 2 policy server on domain {domain_id}, namespace {ns or '/'} within "
                                  f"{timeout_s:g} s (no reader of {ns}/bridge/to_server discovered)")

    def wait_for_peer(self, timeout: float = 5.0) -> bool:
        """Wait until the other side's readers of our control topic are discovered."""
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            if self.w_ctrl.get_publication_matched_status().current_count > 0:
                return True
            time.sleep(0.01)
        return False

    # ------------------------------------------------------------------ Transport protocol (robot)
    def send(self, message: M.Envelope) -> None:
        """Robot: publish ``message`` (an observation on the ROS topics, the rest as JSON)."""
        self._require("robot", "send")
        if M.kind(message) == "observation":
            self._send_observation(message.observation)
        elif M.kind(message):
            self._write(self.w_ctrl, R.String(data=json_format.MessageToJson(message, indent=None)))
        else:
            raise ValueError("cannot send an empty Envelope")

    def recv(self, timeout: float | None = None) -> M.Envelope | None:
        """Robot: the next message addressed to this robot, or ``None`` after ``timeout`` s.

        Raises:
            MessageError: a message was rejected (the link stays up).
        """
        self._require("robot", "recv")
        return _get(self._inbox, timeout)

    def _require(self, role: str, what: str) -> None:
        if self.role != role:
            raise TypeError(f"Ros2Transport(role={self.role!r}) has no {what}(); "
                            + ("the server serves sessions: use accept()" if role == "robot" else ""))

    def close(self) -> None:
        """Delete this endpoint's DDS entities (readers and writers, topics, participant), from
        the calling thread, after the poller thread has stopped. Sessions of a server
        endpoint raise ``ConnectionError`` from then on."""
        if self._closed:
            return
        self._closed = True
        if self._poller is not None and self._poller is not threading.current_thread():
            self._poller.join(timeout=5.0)
        for e in [*self._entities, self.dp]:
            try:
                e.__del__()  # cyclonedds deletes on __del__; explicit, so it never happens in a callback
            except Exception:  # pragma: no cover
                pass
        self._entities = []
        _LIVE.discard(self)



class Ros2Link(TransportLink):
    """``configs/transport/ros2.yaml``: both ends are :class:`Ros2Transport` endpoints on DDS
    domain ``domain_id``, topics under ``namespace`` (``config``: Cyclone XML, ``None`` the
    loopback-only one, ``""`` Cyclone's defaults / ``CYCLONEDDS_URI``)."""

    name = "ros2"

    def __init__(self, domain_id: int = 42, namespace: str = "/wmrl", config: str | None = None,
                 connect_timeout_s: float = 1.0):
        self.domain_id = int(domain_id)
        self.namespace = str(namespace)
        self.config = config
        self.connect_timeout_s = float(connect_timeout_s)

    def robot(self, limits: M.Limits, *, cameras=("agentview", "robot0_eye_in_hand"), control_hz: float = 20.0,
              connect_timeout_s: float | None = None) -> Ros2Transport:
        return Ros2Transport("robot", cameras=list(cameras), domain_id=self.domain_id, namespace=self.namespace,
                             limits=limits, config=self.config, control_hz=float(control_hz),
                             connect_timeout_s=connect_timeout_s)

    def server(self, limits: M.Limits, *, max_sessions: int = 4) -> Ros2Transport:
        return Ros2Transport("server", domain_id=self.domain_id, namespace=self.namespace, limits=limits,
                             config=self.config)

    def start_hint(self) -> str:
        return (f"start `wmrl serve transport=ros2 transport.domain_id={self.domain_id}` or set "
                f"transport.domain_id / transport.namespace / transport.config to the server's")

    def overrides(self) -> list[str]:
        return [f"transport={self.name}", f"transport.domain_id={self.domain_id}"]

    def on_loopback(self, index: int) -> "Ros2Link":
        return Ros2Link(int(index), self.namespace, None, self.connect_timeout_s)
