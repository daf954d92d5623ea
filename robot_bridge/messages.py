"""Typed bridge messages: protobuf ``Envelope`` (schema ``robot_bridge/proto/bridge.proto``),
conversion to/from numpy, size limits and validation.

Nothing crosses a boundary as pickle: byte transports carry one serialized ``Envelope`` per
message; the ROS 2 transport maps the same messages onto ROS 2 types.

Validation raises :class:`MessageError` (a ``ValueError``) with a ``code``:
``"oversized"`` (more bytes than :attr:`Limits.max_message_bytes`), ``"malformed"`` (bytes that
do not parse as an ``Envelope``, or an empty envelope) and ``"invalid"`` (parses, but shapes or
values are wrong, e.g. an action chunk whose ``action_dim`` differs from the robot's ``D_a``).
The receiver answers with an ``Error`` envelope and keeps the connection up.
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
    "validate_observation", "validate_chunk",
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
        action_dim: expected ``D_a`` (``None``: not checked).
        state_dim: expected ``D_s`` (``None``: not checked).
    """

    max_message_bytes: int = 4 * 1024 * 1024
    max_image_pixels: int = 1024 * 1024
    max_cameras: int = 8
    max_horizon: int = 256
    max_dim: int = 64
    action_dim: int | None = None
    state_dim: int | None = None


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
    lim = limits or Limits()
    k = kind(env)
    if not k:
        raise MessageError("malformed", "envelope has no body (empty or unknown message type)")
    if k == "observation":
        validate_observation(env.observation, lim)
    elif k == "chunk":
        validate_chunk(env.chunk, lim)
    return env


def validate_observation(obs: pb.Observation, lim: Limits) -> None:
    rid = obs.request_id
    d_s = len(obs.proprio)
    if d_s > lim.max_dim or (lim.state_dim is not None and d_s != lim.state_dim):
        raise MessageError("invalid", f"observation proprio has {d_s} values, expected "
                           f"{lim.state_dim if lim.state_dim is not None else f'<= {lim.max_dim}'}", rid)
    if not all(math.isfinite(v) for v in obs.proprio):
        raise MessageError("invalid", "observation proprio contains NaN or inf", rid)
    if len(obs.images) > lim.max_cameras:
        raise MessageError("invalid", f"{len(obs.images)} images > max_cameras={lim.max_cameras}", rid)
    for im in obs.images:
        if im.height * im.width > lim.max_image_pixels:
            raise MessageError("oversized", f"image {im.camera!r} {im.height}x{im.width} exceeds "
                               f"max_image_pixels={lim.max_image_pixels}", rid)
        if len(im.data) != im.height * im.width * 3:
            raise MessageError("invalid", f"image {im.camera!r} has {len(im.data)} bytes, expected "
                               f"height*width*3={im.height * im.width * 3}", rid)
    if obs.prefix_len:
        if lim.action_dim is not None and len(obs.prefix_actions) != obs.prefix_len * lim.action_dim:
            raise MessageError("invalid", f"prefix_actions has {len(obs.prefix_actions)} values, expected "
                               f"prefix_len*D_a={obs.prefix_len}*{lim.action_dim}", rid)
        if len(obs.prefix_actions) % obs.prefix_len or obs.prefix_len > lim.max_horizon:
            raise MessageError("invalid", f"prefix_actions length {len(obs.prefix_actions)} is not "
                               f"prefix_len={obs.prefix_len} rows", rid)
    elif len(obs.prefix_actions):
        raise MessageError("invalid", "prefix_actions given with prefix_len=0", rid)


def validate_chunk(ch: pb.ActionChunk, lim: Limits) -> None:
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
    a = np.asarray(ch.actions, dtype=np.float32)
    if not np.isfinite(a).all():
        raise MessageError("invalid", "action chunk contains NaN or inf", rid)


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
               inference_s: float = 0.0, request_id: int = 0) -> pb.Envelope:
    """Build a chunk envelope from ``actions`` ``float32 (H, D_a)``."""
    a = np.asarray(actions, dtype=np.float32)
    if a.ndim != 2:
        raise ValueError(f"actions must be (H, D_a), got {a.shape}")
    c = pb.ActionChunk(episode=episode, start_step=start_step, obs_stamp_ns=obs_stamp_ns,
                       horizon=a.shape[0], action_dim=a.shape[1], inference_s=inference_s, request_id=request_id)
    c.actions.extend(a.reshape(-1).tolist())
    return pb.Envelope(chunk=c)


def chunk_array(c: pb.ActionChunk) -> np.ndarray:
    """``float32 (H, D_a)``."""
    return np.asarray(c.actions, dtype=np.float32).reshape(c.horizon, c.action_dim)


def make_error(err: MessageError | str, message: str = "", request_id: int = 0) -> pb.Envelope:
    if isinstance(err, MessageError):
        return pb.Envelope(error=pb.Error(code=err.code, message=err.detail, request_id=err.request_id))
    return pb.Envelope(error=pb.Error(code=err, message=message, request_id=request_id))
