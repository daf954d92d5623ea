"""Typed bridge messages: protobuf ``Envelope`` (schema ``robot_bridge/proto/bridge.proto``),
conversion to/from numpy, size limits and validation.

Nothing crosses a boundary as pickle: byte transports carry one serialized ``Envelope`` per
message; the ROS 2 transport maps the same messages onto ROS 2 types.

Validation raises :class:`MessageError` (a ``ValueError``) with a ``code``:
``"oversized"`` (more bytes than :attr:`Limits.max_message_bytes`), ``"malformed"`` (bytes that
do not parse as an ``Envelope``, or an empty envelope) and ``"invalid"`` (parses, but shapes or
values are wrong, e.g. an action chunk whose ``action_dim`` differs from the robot's ``D_a``).
The receiver answers with an ``Error`` envelope and keeps the connection up.

Every numeric field is checked: float vectors (proprio, the real-time-chunking prefix, chunk
actions) must be finite with ``|value| <= Limits.max_abs_value``; counts, sizes and steps must
lie in their ranges (a prefix and a ``delay_steps`` no longer than the chunk, a
``Hello``'s image size and camera count within the image limits, times finite and ``>= 0``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
from google.protobuf.message import DecodeError

from robot_bridge.proto import bridge_pb2 as pb

Envelope = pb.Envelope

__all__ = [
    "Envelope", "pb", "MessageError", "Limits", "now_ns", "encode", "decode", "kind",
    "make_observation", "observation_arrays", "make_chunk", "chunk_array", "make_error",
    "validate", "validate_observation", "validate_prefix", "validate_chunk", "validate_hello", "validate_ready",
    "check_values",
]


class MessageError(ValueError):
    """A received message was rejected. ``code`` in {"oversized", "malformed", "invalid"}."""

    def __init__(self, code: str, message: str, request_id: int = 0):
        super().__init__(f"[{code}] {message}")
        self.code = code
        self.detail = message
        self.request_id = request_id


@dataclass(frozen=True)
class Limits:
    """What a receiver accepts.

    Attributes:
        max_message_bytes: largest serialized envelope accepted (default 4 MiB; 64x64 images
            from two cameras need ~25 KiB).
        max_image_pixels: largest ``height * width`` of one image.
        max_cameras: most images in one observation.
        max_horizon: largest chunk length ``H``.
        max_dim: largest ``D_a`` / ``D_s``.
        max_abs_value: largest magnitude of a proprio, prefix or action value (default 1e4:
            commands are O(1) controller units, joint angles O(pi) rad, positions O(1) m; a 1e30
            prefix would turn the flow policy's output into NaN).
        max_control_hz: highest control rate a ``Hello`` may announce (Hz).
        action_dim: expected ``D_a`` (``None``: not checked).
        state_dim: expected ``D_s`` (``None``: not checked).
        chunk_size: the served chunk length ``H``; a real-time-chunking prefix may hold at most
            ``H`` actions (``None``: at most ``max_horizon``).
    """

    max_message_bytes: int = 4 * 1024 * 1024
    max_image_pixels: int = 1024 * 1024
    max_cameras: int = 8
    max_horizon: int = 256
    max_dim: int = 64
    max_abs_value: float = 1e4
    max_control_hz: float = 10_000.0
    action_dim: int | None = None
    state_dim: int | None = None
    chunk_size: int | None = None


def now_ns() -> int:
    """Monotonic clock in ns (both processes of the bridge run on one host for the benchmarks)."""
    return time.monotonic_ns()


def kind(env: pb.Envelope) -> str:
    """Name of the envelope's body: ``"observation"``, ``"chunk"``, ... or ``""`` if empty."""
    return env.WhichOneof("body") or ""


def encode(env: pb.Envelope, limits: Limits | None = None) -> bytes:
    """Serialize; raise :class:`MessageError` ``oversized`` if larger than the limit."""
    data = env.SerializeToString()
    lim = limits or Limits()
    if len(data) > lim.max_message_bytes:
        raise MessageError("oversized", f"message of {len(data)} bytes exceeds max_message_bytes="
                           f"{lim.max_message_bytes}; send smaller images or raise the limit")
    return data


def decode(data: bytes, limits: Limits | None = None) -> pb.Envelope:
    """Parse and validate one serialized ``Envelope``.

    Raises:
        MessageError: ``oversized`` / ``malformed`` / ``invalid`` (see module docstring).
    """
    lim = limits or Limits()
    if len(data) > lim.max_message_bytes:
        raise MessageError("oversized", f"message of {len(data)} bytes exceeds max_message_bytes="
                           f"{lim.max_message_bytes}")
    env = pb.Envelope()
    try:
        env.ParseFromString(bytes(data))
    except (DecodeError, ValueError, RuntimeError) as e:
        raise MessageError("malformed", f"bytes do not parse as wmrl.bridge.Envelope ({e})") from None
    validate(env, lim)
    return env


def validate(env: pb.Envelope, limits: Limits | None = None) -> pb.Envelope:
    """Check the body of ``env`` against ``limits``; returns ``env``.

    Raises:
        MessageError: ``malformed`` (no body), ``invalid`` / ``oversized`` (see the
            ``validate_*`` functions).
    """
    lim = limits or Limits()
    k = kind(env)
    if not k:
        raise MessageError("malformed", "envelope has no body (empty or unknown message type)")
    check = {"observation": validate_observation, "chunk": validate_chunk, "hello": validate_hello,
             "ready": validate_ready}.get(k)
    if check is not None:
        check(getattr(env, k), lim)
    return env


def check_values(values, what: str, lim: Limits, request_id: int = 0) -> None:
    """Every value of ``values`` finite with ``|v| <= lim.max_abs_value``.

    Raises:
        MessageError: ``invalid``, naming ``what`` and the offending value.
    """
    a = np.asarray(values, dtype=np.float64)
    if not a.size:
        return
    if not np.isfinite(a).all():
        raise MessageError("invalid", f"{what} contains NaN or inf", request_id)
    m = float(np.abs(a).max())
    if m > lim.max_abs_value:
        raise MessageError("invalid", f"{what} has a value of magnitude {m:.3g} > max_abs_value="
                           f"{lim.max_abs_value:g}", request_id)


def validate_observation(obs: pb.Observation, lim: Limits) -> None:
    """Proprio (``D_s``, values), images (count, size, bytes), the RTC prefix and ``step``.

    Raises:
        MessageError: ``invalid`` or ``oversized`` (an image over ``max_image_pixels``).
    """
    rid = obs.request_id
    d_s = len(obs.proprio)
    if d_s > lim.max_dim or (lim.state_dim is not None and d_s != lim.state_dim):
        raise MessageError("invalid", f"observation proprio has {d_s} values, expected "
                           f"{lim.state_dim if lim.state_dim is not None else f'<= {lim.max_dim}'}", rid)
    check_values(obs.proprio, "observation proprio", lim, rid)
    if obs.step < 0:
        raise MessageError("invalid", f"observation step={obs.step} is negative", rid)
    if len(obs.images) > lim.max_cameras:
        raise MessageError("invalid", f"{len(obs.images)} images > max_cameras={lim.max_cameras}", rid)
    for im in obs.images:
        if im.height * im.width > lim.max_image_pixels:
            raise MessageError("oversized", f"image {im.camera!r} {im.height}x{im.width} exceeds "
                               f"max_image_pixels={lim.max_image_pixels}", rid)
        if len(im.data) != im.height * im.width * 3:
            raise MessageError("invalid", f"image {im.camera!r} has {len(im.data)} bytes, expected "
                               f"height*width*3={im.height * im.width * 3}", rid)
    validate_prefix(obs, lim)


def validate_prefix(obs: pb.Observation, lim: Limits) -> None:
    """The real-time-chunking prefix of a request: ``prefix_len`` rows of ``D_a`` finite values
    of sane magnitude, at most the chunk length ``H``, and ``delay_steps <= H``.

    ``delay_steps`` (the steps the robot expects to run before the chunk arrives) may exceed
    ``prefix_len``: with requests in flight the server continues its own record of the chunks it
    sent (``robot_bridge.plan``), which can reach further than the robot's committed actions; it
    freezes at most the prefix it continues.

    Raises:
        MessageError: ``invalid``, saying which rule the prefix broke.
    """
    rid, p, n = obs.request_id, obs.prefix_len, len(obs.prefix_actions)
    h = lim.chunk_size if lim.chunk_size is not None else lim.max_horizon
    what = "the chunk length H" if lim.chunk_size is not None else "max_horizon"
    if obs.delay_steps > h:
        raise MessageError("invalid", f"delay_steps={obs.delay_steps} exceeds {what}={h}: at most a whole chunk "
                           f"can run before the next one arrives", rid)
    if not p:
        if n:
            raise MessageError("invalid", f"prefix_actions has {n} values but prefix_len=0", rid)
        return
    if p > h:
        raise MessageError("invalid", f"RTC prefix of prefix_len={p} actions is longer than {what}={h}; "
                           f"send at most {h} committed actions", rid)
    if lim.action_dim is not None and n != p * lim.action_dim:
        raise MessageError("invalid", f"prefix_actions has {n} values, expected prefix_len*D_a="
                           f"{p}*{lim.action_dim}", rid)
    if n % p or not (1 <= n // p <= lim.max_dim):
        raise MessageError("invalid", f"prefix_actions has {n} values, not prefix_len={p} rows of "
                           f"1..{lim.max_dim} actions", rid)
    check_values(obs.prefix_actions, "RTC prefix (prefix_actions)", lim, rid)


def validate_chunk(ch: pb.ActionChunk, lim: Limits) -> None:
    """Shape (``D_a``, ``H``), values, ``start_step >= 0`` and finite times ``>= 0`` (``inference_s``,
    ``queue_s``, ``compute_s``).

    Raises:
        MessageError: ``invalid``.
    """
    rid = ch.request_id
    if lim.action_dim is not None and ch.action_dim != lim.action_dim:
        raise MessageError("invalid", f"action chunk has action_dim={ch.action_dim}, the robot takes "
                           f"D_a={lim.action_dim}; serve a policy trained for this action space", rid)
    if not (1 <= ch.horizon <= lim.max_horizon) or not (1 <= ch.action_dim <= lim.max_dim):
        raise MessageError("invalid", f"action chunk shape (H={ch.horizon}, D_a={ch.action_dim}) out of "
                           f"range (1..{lim.max_horizon}, 1..{lim.max_dim})", rid)
    if len(ch.actions) != ch.horizon * ch.action_dim:
        raise MessageError("invalid", f"action chunk has {len(ch.actions)} values, expected "
                           f"H*D_a={ch.horizon}*{ch.action_dim}", rid)
    check_values(ch.actions, "action chunk", lim, rid)
    if ch.start_step < 0:
        raise MessageError("invalid", f"action chunk start_step={ch.start_step} is negative", rid)
    for name in ("inference_s", "queue_s", "compute_s"):
        v = getattr(ch, name)
        if not (math.isfinite(v) and v >= 0):
            raise MessageError("invalid", f"action chunk {name}={v} is not a time >= 0", rid)


def validate_hello(h: pb.Hello, lim: Limits) -> None:
    """What the server warms its policy up with: dims, cameras, image size, control rate.

    Raises:
        MessageError: ``invalid`` (``oversized`` for an image size over ``max_image_pixels``).
    """
    if h.action_dim > lim.max_dim or h.state_dim > lim.max_dim:
        raise MessageError("invalid", f"hello announces D_a={h.action_dim}, D_s={h.state_dim}; at most "
                           f"max_dim={lim.max_dim}")
    if len(h.cameras) > lim.max_cameras:
        raise MessageError("invalid", f"hello announces {len(h.cameras)} cameras > max_cameras={lim.max_cameras}")
    if h.image_height * h.image_width > lim.max_image_pixels:
        raise MessageError("oversized", f"hello announces images of {h.image_height}x{h.image_width} > "
                           f"max_image_pixels={lim.max_image_pixels}")
    if not (math.isfinite(h.control_hz) and 0 <= h.control_hz <= lim.max_control_hz):
        raise MessageError("invalid", f"hello announces control_hz={h.control_hz}; expected 0 (unset) .. "
                           f"max_control_hz={lim.max_control_hz:g}")


def validate_ready(r: pb.Ready, lim: Limits) -> None:
    """The server's answer to ``Hello``: chunk shape in range, a finite ``warmup_s >= 0``.

    Raises:
        MessageError: ``invalid``.
    """
    if not (1 <= r.chunk_size <= lim.max_horizon) or not (1 <= r.action_dim <= lim.max_dim):
        raise MessageError("invalid", f"ready announces chunks of (H={r.chunk_size}, D_a={r.action_dim}); "
                           f"expected (1..{lim.max_horizon}, 1..{lim.max_dim})")
    if not (math.isfinite(r.warmup_s) and r.warmup_s >= 0):
        raise MessageError("invalid", f"ready announces warmup_s={r.warmup_s}, not a time >= 0")


# ----------------------------------------------------------------------------- builders


def make_observation(*, episode: int, step: int, proprio: np.ndarray, images: dict[str, np.ndarray],
                     task: str = "", request: bool = False, request_id: int = 0,
                     prefix_actions: np.ndarray | None = None, stamp_ns: int | None = None) -> pb.Envelope:
    """Build an observation envelope.

    Args:
        proprio: ``float32 (D_s,)``.
        images: camera -> ``uint8 (Hi, Wi, 3)`` (HWC) or ``(3, Hi, Wi)`` (CHW) upright RGB.
        prefix_actions: ``float32 (P, D_a)`` committed actions for steps ``step .. step+P-1``.
    """
    o = pb.Observation(episode=episode, step=step, stamp_ns=now_ns() if stamp_ns is None else stamp_ns,
                       task=task, request=request, request_id=request_id)
    o.proprio.extend(np.asarray(proprio, dtype=np.float32).reshape(-1).tolist())
    for cam, img in images.items():
        img = np.asarray(img, dtype=np.uint8)
        if img.ndim == 3 and img.shape[0] == 3 and img.shape[-1] != 3:
            img = img.transpose(1, 2, 0)
        if img.ndim != 3 or img.shape[-1] != 3:
            raise ValueError(f"image {cam!r} must be (Hi, Wi, 3) or (3, Hi, Wi) uint8, got {img.shape}")
        o.images.add(camera=cam, height=img.shape[0], width=img.shape[1], data=np.ascontiguousarray(img).tobytes())
    if prefix_actions is not None and len(prefix_actions):
        p = np.asarray(prefix_actions, dtype=np.float32)
        o.prefix_len = p.shape[0]
        o.prefix_actions.extend(p.reshape(-1).tolist())
    return pb.Envelope(observation=o)


def observation_arrays(o: pb.Observation) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray | None]:
    """``(proprio float32 (D_s,), images camera -> uint8 (3, Hi, Wi), prefix float32 (P, D_a) or None)``."""
    proprio = np.asarray(o.proprio, dtype=np.float32)
    images = {im.camera: np.frombuffer(im.data, dtype=np.uint8).reshape(im.height, im.width, 3).transpose(2, 0, 1)
              for im in o.images}
    prefix = None
    if o.prefix_len:
        prefix = np.asarray(o.prefix_actions, dtype=np.float32).reshape(o.prefix_len, -1)
    return proprio, images, prefix


def make_chunk(*, actions: np.ndarray, start_step: int, episode: int = 0, obs_stamp_ns: int = 0,
               inference_s: float = 0.0, request_id: int = 0, queue_s: float = 0.0,
               compute_s: float = 0.0) -> pb.Envelope:
    """Build a chunk envelope from ``actions`` ``float32 (H, D_a)`` (times in s, see ``bridge.proto``)."""
    a = np.asarray(actions, dtype=np.float32)
    if a.ndim != 2:
        raise ValueError(f"actions must be (H, D_a), got {a.shape}")
    c = pb.ActionChunk(episode=episode, start_step=start_step, obs_stamp_ns=obs_stamp_ns,
                       horizon=a.shape[0], action_dim=a.shape[1], inference_s=inference_s, request_id=request_id,
                       queue_s=queue_s, compute_s=compute_s)
    c.actions.extend(a.reshape(-1).tolist())
    return pb.Envelope(chunk=c)


def chunk_array(c: pb.ActionChunk) -> np.ndarray:
    """``float32 (H, D_a)``."""
    return np.asarray(c.actions, dtype=np.float32).reshape(c.horizon, c.action_dim)


def make_error(err: MessageError | str, message: str = "", request_id: int = 0) -> pb.Envelope:
    if isinstance(err, MessageError):
        return pb.Envelope(error=pb.Error(code=err.code, message=err.detail, request_id=err.request_id))
    return pb.Envelope(error=pb.Error(code=err, message=message, request_id=request_id))
