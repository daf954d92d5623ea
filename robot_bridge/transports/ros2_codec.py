"""Conversion between the bridge's protobuf envelopes and the ROS 2 messages of
``robot_bridge.transports.ros2`` (topics and layout in that module's docstring): an observation
as ``JointState`` + one ``Image`` per camera + a ``JointTrajectory`` chunk request (the RTC
prefix), assembled again by stamp on the server; a chunk as a ``JointTrajectory``; the
bookkeeping in ``header.frame_id``. Malformed or inconsistent messages raise
:class:`robot_bridge.messages.MessageError`.
"""

from __future__ import annotations

import time

import numpy as np
from google.protobuf import json_format

from robot_bridge import messages as M
from robot_bridge.transports import ros2_types as R

ACTION_NAMES_7 = ["dx", "dy", "dz", "dax", "day", "daz", "gripper"]


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


def _float(meta: dict, key: str) -> float:
    """``meta[key]`` as a float (0 when absent, as from an older server)."""
    try:
        return float(meta.get(key, 0.0))
    except ValueError:
        raise M.MessageError("malformed", f"header.frame_id has a non-numeric {key!r}") from None


class Ros2Codec:
    """Mixin of :class:`robot_bridge.transports.ros2.Ros2Transport`: writes envelopes as ROS 2
    messages (``_send_observation``, ``_send_chunk``) and reads them back (the ``_on_*`` reader
    handlers, ``(sample, session) -> Envelope | None``). Uses the endpoint's ``frame``,
    ``limits``, ``control_hz``, ``action_names``, ``session``, ``_lock``, ``_partial``,
    ``_tasks``, ``w_*`` writers and ``_write``."""

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
                             inference_s=_float(meta, "inf"), request_id=_int(meta, "req", 0),
                             queue_s=_float(meta, "q"), compute_s=_float(meta, "c"))
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
                                             inf=f"{c.inference_s:.6f}", q=f"{c.queue_s:.6f}",
                                             c=f"{c.compute_s:.6f}", to=key))
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
