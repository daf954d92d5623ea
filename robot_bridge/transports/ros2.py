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

import numpy as np
from cyclonedds.internal import InvalidSample
from google.protobuf import json_format

from robot_bridge import messages as M
from robot_bridge.transports import ros2_types as R

log = logging.getLogger("robot_bridge.transports.ros2")

_DOMAINS: dict = {}
_LIVE: set = set()
POLL_S = 0.001  # reader poll period while every reader is empty (s): at most this much added latency
_DOMAINS_LOCK = threading.Lock()

ACTION_NAMES_7 = ["dx", "dy", "dz", "dax", "day", "daz", "gripper"]


def loopback_config() -> str:
    """Cyclone DDS XML: interface ``lo``, no multicast, unicast discovery of ``127.0.0.1`` only."""
    return resources.files("robot_bridge.transports").joinpath("cyclonedds_loopback.xml").read_text()


def _meta_encode(frame: str, **kv) -> str:
    return ";".join([frame] + [f"{k}={v}" for k, v in kv.items()])


def _meta_decode(frame_id: str) -> dict[str, str]:
    parts = frame_id.split(";")
    out = {}
    for p in parts[1:]:
        if "=" not in p:
            raise M.MessageError("malformed", f"header.frame_id {frame_id!r} is not '<frame>;key=value;...'")
        k, v = p.split("=", 1)
        out[k] = v
    return out


def _int(meta: dict, key: str, default: int | None = None) -> int:
    try:
        return int(meta[key]) if key in meta or default is None else default
    except (KeyError, ValueError):
        raise M.MessageError("malformed", f"header.frame_id lacks an integer {key!r}") from None


_U64 = 1 << 64
_ENDED_KEEP = 4096  # ended sessions remembered (their late samples are dropped)


class Ros2Transport:
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
        from cyclonedds.core import Qos, Policy
        from cyclonedds.domain import Domain, DomainParticipant
        from cyclonedds.pub import DataWriter
        from cyclonedds.sub import DataReader
        from cyclonedds.topic import Topic

        if role not in ("robot", "server"):
            raise ValueError(f"role must be 'robot' or 'server', got {role!r}")
        self.role = role
        self.cameras = list(cameras)
        self.limits = limits or M.Limits()
        self.control_hz = control_hz
        self.frame = frame
        self.action_names = action_names
        self.match_timeout_s = match_timeout_s
        self._inbox: queue.Queue = queue.Queue()
        self._closed = False
        self._poller: threading.Thread | None = None
        self._lock = threading.Lock()
        self._init_sessions()
        cfg = loopback_config() if config is None else config
        with _DOMAINS_LOCK:  # one configured Domain per process and id (Cyclone's rule)
            if cfg and domain_id not in _DOMAINS:
                _DOMAINS[domain_id] = Domain(domain_id, cfg)
        self.dp = DomainParticipant(domain_id)
        qos = Qos(Policy.Reliability.Reliable(max_blocking_time=100_000_000), Policy.History.KeepLast(32),
                  Policy.DataRepresentation(use_cdrv0_representation=True))
        ns = namespace.rstrip("/")

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

        if role == "robot":
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
        self.session = str(self.dp.guid) if role == "robot" else ""
        # Keep the DDS entities reachable until close(), which stops the poller before deleting them.
        _LIVE.add(self)
        self._poller = threading.Thread(target=self._poll_loop, daemon=True, name=f"ros2-{role}-poll")
        self._poller.start()
        if role == "robot" and connect_timeout_s is not None:
            self._require_server(connect_timeout_s, domain_id, ns)

    def _init_sessions(self) -> None:
        self._partial: dict[tuple[str, int], dict] = {}  # (session, stamp) -> parts of an observation
        self._sessions: dict[str, Ros2Session] = {}
        self._ended: dict[str, None] = {}  # ordered: the oldest forgotten first
        self._accepted: queue.Queue = queue.Queue()
        self._writer_key: dict[int, str] = {}  # publication handle -> participant GUID
        self._key_handles: dict[str, set[int]] = {}
        self._tasks: dict[str, str] = {}  # session -> instruction from its Hello (ROS topics carry no text)

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

    def _sender(self, r, smp) -> str:
        """Server: the GUID of the participant that wrote ``smp`` (cached per writer); robot: ``""``."""
        if self.role == "robot":
            return ""
        h = int(smp.sample_info.publication_handle) % _U64
        key = self._writer_key.get(h)
        if key is None:
            pub = r.get_matched_publication_data(h)
            key = str(pub.participant_key) if pub is not None else f"writer-{h}"
            with self._lock:
                self._writer_key[h] = key
                self._key_handles.setdefault(key, set()).add(h)
        return key

    def _deliver(self, item, key: str) -> None:
        if self.role == "robot":
            self._inbox.put(item)
            return
        with self._lock:
            if key in self._ended:
                return
            sess = self._sessions.get(key)
            if sess is None:
                sess = self._sessions[key] = Ros2Session(self, key)
                self._accepted.put(sess)
        sess._inbox.put(item)

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

    # ------------------------------------------------------------------ sessions (server)
    def accept(self, timeout: float | None = None) -> Ros2Session | None:
        """Server: the session of the next robot heard from, or ``None`` after ``timeout`` s."""
        self._require("server", "accept")
        try:
            return self._accepted.get(timeout=timeout)
        except queue.Empty:
            return None

    def _send_to(self, message: M.Envelope, key: str) -> None:
        """Server: publish ``message`` addressed to the robot of session ``key``."""
        k = M.kind(message)
        if k == "chunk":
            self._send_chunk(message.chunk, key)
            return
        if not k:
            raise ValueError("cannot send an empty Envelope")
        if k == "estop":
            self._write(self.w_estop, R.Bool(data=True))
        env = M.Envelope()
        env.CopyFrom(message)
        env.session = key
        self._write(self.w_ctrl, R.String(data=json_format.MessageToJson(env, indent=None)))

    def _end_session(self, key: str) -> None:
        with self._lock:
            self._sessions.pop(key, None)
            self._tasks.pop(key, None)
            self._ended[key] = None
            while len(self._ended) > _ENDED_KEEP:
                del self._ended[next(iter(self._ended))]
            for k in [k for k in self._partial if k[0] == key]:
                del self._partial[k]

    def _peer_present(self, key: str) -> bool:
        """Server: whether a writer of session ``key``'s participant is still matched."""
        if self._closed:
            return False
        with self._lock:
            handles = set(self._key_handles.get(key, ()))
        matched = {int(h) % _U64 for r in self._readers for h in r.get_matched_publications()}
        return bool(handles & matched)

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

    # ------------------------------------------------------------------ robot side
    def _send_observation(self, o) -> None:
        stamp = R.stamp_from_ns(o.stamp_ns)
        d_a = (len(o.prefix_actions) // o.prefix_len) if o.prefix_len else 0
        hdr = R.Header(stamp=stamp, frame_id=_meta_encode(self.frame, ep=o.episode, step=o.step, req=o.request_id,
                                                          delay=o.delay_steps, n=len(o.images), r=int(o.request)))
        for im in o.images:
            if im.camera not in self.w_img:
                raise ValueError(f"camera {im.camera!r} has no image topic; Ros2Transport(cameras=...) has {self.cameras}")
            self._write(self.w_img[im.camera], R.Image(header=hdr, height=im.height, width=im.width, encoding="rgb8",
                                                       is_bigendian=0, step=im.width * 3, data=bytes(im.data)))
        pref = np.asarray(o.prefix_actions, np.float64).reshape(o.prefix_len, d_a) if o.prefix_len else []
        pts = [R.JointTrajectoryPoint(positions=row.tolist(), time_from_start=self._dur(i)) for i, row in enumerate(pref)]
        self._write(self.w_req, R.JointTrajectory(header=hdr, joint_names=self._names(d_a) if d_a else [], points=pts))
        self._write(self.w_js, R.JointState(header=hdr, name=[f"proprio_{i}" for i in range(len(o.proprio))],
                                            position=[float(v) for v in o.proprio]))

    def _on_chunk(self, jt, key: str) -> M.Envelope | None:
        meta = _meta_decode(jt.header.frame_id)
        if meta.get("to") != self.session:
            return None  # another robot's chunk
        d_a = len(jt.joint_names)
        for i, p in enumerate(jt.points):
            if len(p.positions) != d_a:
                raise M.MessageError("invalid", f"chunk point {i} has {len(p.positions)} positions for "
                                     f"{d_a} joint_names", _int(meta, "req", 0))
        c = M.pb.ActionChunk(episode=_int(meta, "ep"), start_step=_int(meta, "step"),
                             obs_stamp_ns=R.ns_from_stamp(jt.header.stamp), horizon=len(jt.points), action_dim=d_a,
                             inference_s=float(meta.get("inf", 0.0)), request_id=_int(meta, "req", 0))
        c.actions.extend([v for p in jt.points for v in p.positions])
        M.validate_chunk(c, self.limits)
        return M.Envelope(chunk=c)

    def _on_estop(self, b, key: str) -> M.Envelope | None:
        return M.Envelope(estop=M.pb.EStop(reason="ros2 /estop")) if b.data else None

    def _on_ctrl(self, s, key: str) -> M.Envelope | None:
        env = M.Envelope()
        try:
            json_format.Parse(s.data, env)
        except json_format.ParseError as e:
            raise M.MessageError("malformed", f"bridge control message is not a JSON wmrl.bridge.Envelope: {e}") from None
        if self.role == "robot" and env.session != self.session:
            return None  # addressed to another robot
        env.ClearField("session")
        M.validate(env, self.limits)
        if M.kind(env) == "hello":
            with self._lock:
                self._tasks[key] = env.hello.task
        return env

    # ------------------------------------------------------------------ server side
    def _send_chunk(self, c, key: str) -> None:
        a = M.chunk_array(c).astype(np.float64)
        hdr = R.Header(stamp=R.stamp_from_ns(c.obs_stamp_ns),
                       frame_id=_meta_encode(self.frame, ep=c.episode, step=c.start_step, req=c.request_id,
                                             inf=f"{c.inference_s:.6f}", to=key))
        pts = [R.JointTrajectoryPoint(positions=row.tolist(), time_from_start=self._dur(i)) for i, row in enumerate(a)]
        self._write(self.w_chunk, R.JointTrajectory(header=hdr, joint_names=self._names(a.shape[1]), points=pts))

    def _part(self, key: str, stamp_ns: int) -> dict:
        with self._lock:
            now = time.monotonic()
            for k in [k for k, v in self._partial.items() if now - v["t"] > 5.0]:
                del self._partial[k]  # never completed (a lost sample): forget it
            return self._partial.setdefault((key, stamp_ns), {"t": now, "images": {}, "js": None, "req": None})

    def _on_js(self, js, key: str) -> M.Envelope | None:
        meta = _meta_decode(js.header.frame_id)
        if len(js.name) != len(js.position):
            raise M.MessageError("invalid", f"JointState has {len(js.name)} names but {len(js.position)} positions",
                                 _int(meta, "req", 0))
        stamp = R.ns_from_stamp(js.header.stamp)
        self._part(key, stamp)["js"] = js
        return self._try_complete(key, stamp)

    def _on_img(self, im, cam: str, key: str) -> M.Envelope | None:
        meta = _meta_decode(im.header.frame_id)
        rid = _int(meta, "req", 0)
        if im.height * im.width > self.limits.max_image_pixels:
            raise M.MessageError("oversized", f"image {im.height}x{im.width} exceeds max_image_pixels="
                                 f"{self.limits.max_image_pixels}", rid)
        if im.encoding != "rgb8" or im.step != im.width * 3 or len(im.data) != im.height * im.step:
            raise M.MessageError("invalid", f"image must be rgb8 with step=width*3 and height*step bytes; got "
                                 f"encoding={im.encoding!r} {im.height}x{im.width} step={im.step} "
                                 f"bytes={len(im.data)}", rid)
        stamp = R.ns_from_stamp(im.header.stamp)
        self._part(key, stamp)["images"][cam] = im
        return self._try_complete(key, stamp)

    def _on_req(self, jt, key: str) -> M.Envelope | None:
        stamp = R.ns_from_stamp(jt.header.stamp)
        self._part(key, stamp)["req"] = jt
        return self._try_complete(key, stamp)

    def _try_complete(self, key: str, stamp: int) -> M.Envelope | None:
        """The observation once its JointState, chunk request and every image have arrived."""
        with self._lock:
            p = self._partial.get((key, stamp))
            if p is None or p["js"] is None or p["req"] is None:
                return None
            meta = _meta_decode(p["js"].header.frame_id)
            if len(p["images"]) < _int(meta, "n", 0):
                return None
            del self._partial[(key, stamp)]
            task = self._tasks.get(key, "")
        js, jt = p["js"], p["req"]
        o = M.pb.Observation(episode=_int(meta, "ep"), step=_int(meta, "step"), stamp_ns=stamp,
                             request=bool(_int(meta, "r", 1)), request_id=_int(meta, "req", 0),
                             delay_steps=_int(meta, "delay", 0), task=task)
        o.proprio.extend(js.position)
        for cam, im in p["images"].items():
            o.images.add(camera=cam, height=im.height, width=im.width, data=bytes(im.data))
        if jt.points:
            widths = {len(pt.positions) for pt in jt.points}
            if len(widths) != 1:
                raise M.MessageError("invalid", f"chunk_request points have different widths {sorted(widths)}",
                                     o.request_id)
            o.prefix_len = len(jt.points)
            o.prefix_actions.extend([v for pt in jt.points for v in pt.positions])
        M.validate_observation(o, self.limits)
        return M.Envelope(observation=o)

    # ------------------------------------------------------------------ helpers
    def _dur(self, i: int) -> R.Duration:
        ns = int(round(i * 1e9 / self.control_hz))
        return R.Duration(sec=ns // 1_000_000_000, nanosec=ns % 1_000_000_000)

    def _names(self, d_a: int) -> list[str]:
        if self.action_names and len(self.action_names) == d_a:
            return list(self.action_names)
        return ACTION_NAMES_7 if d_a == 7 else [f"a{i}" for i in range(d_a)]


def _get(inbox: queue.Queue, timeout: float | None):
    try:
        item = inbox.get(timeout=timeout)
    except queue.Empty:
        return None
    if isinstance(item, M.MessageError):
        raise item
    return item


class Ros2Session:
    """Server side of one robot's session on the shared ROS 2 topics (from
    :meth:`Ros2Transport.accept`): a transport whose ``recv`` gives what that robot's participant
    wrote and whose ``send`` addresses the robot.

    ``recv`` raises ``ConnectionError`` once the session was closed, the server endpoint closed,
    or the robot's participant is no longer discovered (checked every ``peer_check_s``).
    """

    peer_check_s = 0.1

    def __init__(self, node: Ros2Transport, key: str):
        self.node = node
        self.key = key
        self.address = f"ros2 participant {key}"
        self._inbox: queue.Queue = queue.Queue()
        self._closed = False
        self._next_check = time.monotonic() + self.peer_check_s

    def send(self, message: M.Envelope) -> None:
        if self._closed or self.node._closed:
            raise ConnectionError(f"ROS 2 session of {self.key} is closed")
        self.node._send_to(message, self.key)

    def recv(self, timeout: float | None = None) -> M.Envelope | None:
        if self._closed or self.node._closed:
            raise ConnectionError(f"ROS 2 session of {self.key} is closed")
        item = _get(self._inbox, timeout)
        if item is None and time.monotonic() > self._next_check:
            self._next_check = time.monotonic() + self.peer_check_s
            if not self.node._peer_present(self.key):
                raise ConnectionError(f"robot {self.key} left (its DDS participant is gone)")
        return item

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.node._end_session(self.key)

    @property
    def closed(self) -> bool:
        return self._closed or self.node._closed
