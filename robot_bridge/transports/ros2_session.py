"""Server side of the ROS 2 transport: the topics are shared by every robot in the namespace, so
the server endpoint tells robots apart by the DDS participant that wrote each sample and hands
out one :class:`Ros2Session` (a transport) per robot participant (see the Sessions paragraph of
``robot_bridge.transports.ros2``).
"""

from __future__ import annotations

import queue
import time
from typing import TYPE_CHECKING

from google.protobuf import json_format

from robot_bridge import messages as M
from robot_bridge.transports import ros2_types as R

if TYPE_CHECKING:
    from robot_bridge.transports.ros2 import Ros2Transport

_U64 = 1 << 64
_ENDED_KEEP = 4096  # ended sessions remembered (their late samples are dropped)


class Ros2SessionTable:
    """Mixin of :class:`robot_bridge.transports.ros2.Ros2Transport`: which participant wrote a
    sample, the session of each robot, ``accept``, addressed sends and the end of sessions.
    Uses the endpoint's ``role``, ``_lock``, ``_closed``, ``_inbox``, ``_readers``, ``w_*``
    writers, ``_write`` and the codec's ``_send_chunk``."""

    def _init_sessions(self) -> None:
        self._partial: dict[tuple[str, int], dict] = {}  # (session, stamp) -> parts of an observation
        self._sessions: dict[str, Ros2Session] = {}
        self._ended: dict[str, None] = {}  # ordered: the oldest forgotten first
        self._accepted: queue.Queue = queue.Queue()
        self._writer_key: dict[int, str] = {}  # publication handle -> participant GUID
        self._key_handles: dict[str, set[int]] = {}
        self._tasks: dict[str, str] = {}  # session -> instruction from its Hello (ROS topics carry no text)

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
        matched = {int(h) % _U64 for r in self._readers for h in _matched_publications(r)}
        return bool(handles & matched)


def _matched_publications(reader, tries: int = 5) -> list[int]:
    """Instance handles of the writers matched to ``reader``.

    cyclonedds' ``get_matched_publications`` sizes its buffer with one call and fills it with a
    second; a writer matched between the two makes it raise ``IndexError``. The handles are read
    again then (a handful of tries; a match storm that outlasts them re-raises)."""
    for attempt in range(tries):
        try:
            return reader.get_matched_publications()
        except IndexError:
            if attempt == tries - 1:
                raise
            time.sleep(0.001)
    return []


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
