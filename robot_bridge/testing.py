"""Small stand-ins used by the bridge's tests and benchmark (not by deployments).

* :class:`KinematicArm`: a ``RobotInterface`` whose end effector integrates OSC_POSE-style delta
  commands (``D_a = 7``, ``D_s = 9`` Panda proprio layout), with synthetic camera images; its
  success predicate is "end effector within ``tol`` of ``goal``".
* :class:`TrackingPolicy`: a closed-loop chunking policy following a smooth time reference (the
  arm's clock is in ``proprio[-1]``), to benchmark how chunks are merged (jerk at boundaries).
* :class:`GoalPolicy`: proportional controller to the arm's goal, chunked (task-success tests).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import torch

from wmrl.kernel.types import Obs, PolicySample


class KinematicArm:
    """Point-mass end effector driven by delta commands, in real time or not.

    proprio (``D_s = 9``): ee xyz (m), ``quat_wxyz`` (identity), then two "finger" values: the
    gripper command and the arm's clock ``t`` (s since reset, advanced by ``dt`` per applied
    command) so that :class:`TrackingPolicy` can follow a time reference; with
    ``clock_in_proprio=False`` the last value is 0, so that an arm that does not move gives the
    very same observation at every tick (the static scene of ``wmrl bench bridge``).

    Args:
        goal: ``(3,)`` target ee position (m).
        pos_scale: m per unit of translation command (robosuite OSC_POSE: 0.05).
        image_size: ``(Hi, Wi)`` of the synthetic images.
        cameras: camera names.
        step_time_s: simulated compute per step (sleep), to mimic a simulator.
        clock_in_proprio: put the clock in ``proprio[-1]`` (else 0).
        grip: gripper command before the first command (-1 open).
    """

    action_dim = 7
    state_dim = 9
    frames_on_demand = True  # observe(images=False) skips the images (counted in frames_read)

    def __init__(self, goal=(0.1, 0.0, 0.1), start=(0.0, 0.0, 0.0), tol: float = 0.02, pos_scale: float = 0.05,
                 image_size=(16, 16), cameras=("agentview", "robot0_eye_in_hand"), task: str = "reach the goal",
                 task_name: str = "reach", step_time_s: float = 0.0, dt: float = 0.05,
                 clock_in_proprio: bool = True, grip: float = -1.0):
        self.goal = np.asarray(goal, np.float64)
        self.start = np.asarray(start, np.float64)
        self.tol = tol
        self.pos_scale = pos_scale
        self.image_size = tuple(image_size)
        self.cameras = list(cameras)
        self.task = task
        self.task_name = task_name
        self.step_time_s = step_time_s
        self.dt = dt
        self.clock_in_proprio = bool(clock_in_proprio)
        self.grip0 = float(grip)
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.pos = self.start.copy()
        self.grip = self.grip0
        self.t = 0.0
        self.stopped = False
        self.applied: list[np.ndarray] = []
        self.stop_time: float | None = None
        self.frames_read = 0

    def observe(self, images: bool = True):
        with self.lock:
            clock = self.t if self.clock_in_proprio else 0.0
            p = np.concatenate([self.pos, [1.0, 0.0, 0.0, 0.0], [self.grip, clock]]).astype(np.float32)
            if not images:
                return p, {}
            self.frames_read += 1
            h, w = self.image_size
            v = np.clip((self.pos + 0.5) * 255, 0, 255).astype(np.uint8)
            img = np.broadcast_to(v.reshape(3, 1, 1), (3, h, w)).copy()
            return p, {c: img for c in self.cameras}

    def apply(self, action: np.ndarray) -> None:
        with self.lock:
            if self.stopped:
                return
            a = np.asarray(action, np.float64)
            self.pos = self.pos + self.pos_scale * a[:3]
            self.grip = float(a[6])
            self.t += self.dt
            self.applied.append(np.asarray(action, np.float32).copy())
        if self.step_time_s:
            time.sleep(self.step_time_s)

    def hold_action(self, last):
        h = np.zeros(7, np.float32)
        h[6] = self.grip if last is None else last[6]
        return h

    def stop(self) -> None:
        with self.lock:
            if not self.stopped:
                self.stopped = True
                self.stop_time = time.monotonic()

    def success(self) -> bool:
        return bool(np.linalg.norm(self.pos - self.goal) < self.tol)


class TrackingPolicy(torch.nn.Module):
    """Closed-loop chunking policy: from the observed end-effector position ``p_s`` it plans the
    commands that follow the circle ``r(t) = c + R (sin wt, 1 - cos wt, 0)`` over the chunk,
    ``scale * a_i = r_{i+1} - r_i + gain (r_i - p_i)`` with ``p_{i+1} = p_i + scale * a_i``,
    ``p_0 = p_s`` and ``r_i = r(t_s + i dt)``, ``t_s`` the arm's clock (``proprio[:, -1]``). Like a learned policy, each chunk starts
    from the state it saw, so executing it late (naive switching) replays motion already done.
    ``freq_hz=0``: a target that does not move (``r = c``). ``D_a = 7``; actions ``float32 (B, H, 7)``.

    Real-time chunking (``rtc=True``, the default): ``sample(obs, prefix=, delay=)`` keeps the
    first ``d = min(delay, P)`` actions of the prefix ``(P, 7)`` (they run before the chunk
    arrives, Black et al. 2025) and plans the rest from the position they lead to,
    ``p_d = p_s + scale * sum(prefix[:d, :3])``: the exact inpainting of this deterministic plan."""

    def __init__(self, chunk_size: int = 16, radius: float = 0.05, freq_hz: float = 0.5, dt: float = 0.05,
                 pos_scale: float = 0.05, center=(0.0, 0.0, 0.0), gain: float = 0.3, rtc: bool = True):
        super().__init__()
        self.chunk_size, self.action_dim = chunk_size, 7
        self.supports_rtc = bool(rtc)
        self.gain = gain
        self.radius, self.freq, self.dt, self.scale = radius, freq_hz, dt, pos_scale
        self.center = torch.tensor(center, dtype=torch.float32)

    def reference(self, t: torch.Tensor) -> torch.Tensor:
        """``r(t)``: ``(...,) -> (..., 3)`` metres."""
        w = 2 * torch.pi * self.freq
        return self.center + self.radius * torch.stack([torch.sin(w * t), 1 - torch.cos(w * t), torch.zeros_like(t)], -1)

    def sample(self, obs: Obs, generator=None, prefix: torch.Tensor | None = None, delay: int = 0) -> PolicySample:
        t = obs.proprio[:, -1:].to(torch.float32)  # (B, 1)
        tau = t + self.dt * torch.arange(self.chunk_size + 1, dtype=torch.float32)[None]  # (B, H+1)
        ref = self.reference(tau)  # (B, H+1, 3)
        p = obs.proprio[:, :3].to(torch.float32)
        a = torch.zeros(obs.batch_size, self.chunk_size, 7)
        d = 0
        if prefix is not None and self.supports_rtc:
            d = max(0, min(int(delay), prefix.shape[-2], self.chunk_size))
            a[:, :d] = prefix[..., :d, :].to(torch.float32)
            p = p + self.scale * a[:, :d, :3].sum(1)
        for i in range(d, self.chunk_size):
            step = ref[:, i + 1] - ref[:, i] + self.gain * (ref[:, i] - p)
            a[:, i, :3] = torch.clamp(step / self.scale, -1, 1)
            p = p + self.scale * a[:, i, :3]
        a[:, d:, 6] = 1.0
        return PolicySample(a, torch.zeros(obs.batch_size))

    def log_prob(self, obs, sample):  # pragma: no cover - deterministic
        return torch.zeros(obs.batch_size)


class GoalPolicy(torch.nn.Module):
    """Chunked proportional controller to a fixed goal: ``a[:3] = clip(gain (goal - ee) / scale)``
    repeated with the predicted motion over the chunk. ``D_a = 7``."""

    supports_rtc = False

    def __init__(self, goal=(0.1, 0.0, 0.1), chunk_size: int = 16, gain: float = 0.3, pos_scale: float = 0.05):
        super().__init__()
        self.chunk_size, self.action_dim = chunk_size, 7
        self.goal = torch.tensor(goal, dtype=torch.float32)
        self.gain, self.scale = gain, pos_scale

    def sample(self, obs: Obs, generator=None) -> PolicySample:
        pos = obs.proprio[:, :3].clone()
        out = []
        for _ in range(self.chunk_size):
            d = torch.clamp(self.gain * (self.goal - pos) / self.scale, -1, 1)
            a = torch.zeros(obs.batch_size, 7)
            a[:, :3] = d
            a[:, 6] = 1.0
            out.append(a)
            pos = pos + self.scale * d
        return PolicySample(torch.stack(out, 1), torch.zeros(obs.batch_size))

    def log_prob(self, obs, sample):  # pragma: no cover
        return torch.zeros(obs.batch_size)
