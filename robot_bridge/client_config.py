"""Settings of the robot client (``robot_bridge.client.RobotClient``): control rate, request
timing (``robot_bridge.timing``), the safe fallback, merging, watchdog and timeouts."""

from __future__ import annotations

from dataclasses import dataclass

from robot_bridge.timing import TimingConfig


@dataclass
class ClientConfig:
    """Settings of :class:`RobotClient`.

    Attributes:
        control_hz: control rate (Hz).
        request_threshold: request the next chunk at the latest when this many actions remain
            (queued or in flight); the measured round trip raises it (``robot_bridge.timing``).
        latency_margin_steps: steps of safety between a chunk's expected arrival and the end of
            the actions (``m`` of ``robot_bridge.timing``).
        initial_latency_s: round trip assumed before the first measurement (s); ``None``: only
            twice the age of the oldest request in flight (``robot_bridge.timing``).
        latency_window: round trips the estimate keeps (its second largest is the estimate).
        max_inflight: requests in flight at once.
        fallback: ``"hold"`` | ``"slow"``: what to do when the round trip is too long for any
            schedule (see ``robot_bridge.timing``); recorded in ``info["fallback"]``.
        slow_factor: ``fallback="slow"`` multiplies the control period by this (> 1).
        fallback_min_samples: round trips measured before the fallback can be decided.
        merge: ``"latency_aware"`` or ``"naive"`` (see ``robot_bridge.queue``).
        rtc_prefix: ask for real-time chunking (committed actions as the prefix, ``delay_steps``)
            when the server supports it; never with ``merge="naive"`` (a baseline without it).
        watchdog_s: stop when the server is silent this long.
        silence_hold_s: hold (stop consuming queued actions) when the server is silent this long
            (default ``watchdog_s / 2``; the server heart-beats every 0.1 s).
        ready_timeout_s: how long ``connect`` waits for ``Ready`` (the server's warm-up).
        hello_retry_s: ``connect`` sends ``Hello`` again after this long while nothing at all was
            heard from the server (a ROS 2 server that was discovered only after the first
            ``Hello``, e.g. restarted, never saw it; a server answers a repeated ``Hello`` with
            the same ``Ready``).
        request_timeout_s: a request unanswered this long no longer counts as in flight.
        max_steps: episode length limit (control steps).
        stop_on_success: end the episode when the success predicate holds.
        frames: ``"every_step"``: the camera frames are read at every control step (the recorded
            episode has each step's own frames); ``"requests"``: only at the steps that send a
            chunk request (and the first), for a robot that declares ``frames_on_demand`` (a
            simulated arm that renders only what is read: ``sim.libero.env.LiberoChunkEnv``
            with ``frames="on_demand"``); the recorded episode repeats the last frames read at
            the other steps and marks the fresh ones in ``extras["frame_fresh"]`` (1 / 0), so
            it is a record for videos at the policy's observation rate, not world-model data.

    Raises:
        ValueError: (on use by :class:`RobotClient`) an unknown ``fallback``, ``slow_factor <= 1``
            or ``max_inflight < 1``.
    """

    control_hz: float = 20.0
    request_threshold: int = 8
    latency_margin_steps: int = 1
    initial_latency_s: float | None = None
    latency_window: int = 16
    max_inflight: int = 4
    fallback: str = "hold"
    slow_factor: float = 2.0
    fallback_min_samples: int = 3
    merge: str = "latency_aware"
    rtc_prefix: bool = True
    watchdog_s: float = 0.5
    silence_hold_s: float | None = None
    ready_timeout_s: float = 30.0
    hello_retry_s: float = 1.0
    request_timeout_s: float = 2.0
    max_steps: int = 400
    stop_on_success: bool = True
    frames: str = "every_step"

    def timing(self, chunk_size: int) -> TimingConfig:
        """The :class:`robot_bridge.timing.TimingConfig` for chunks of ``chunk_size``."""
        return TimingConfig(chunk_size=int(chunk_size), margin_steps=int(self.latency_margin_steps),
                            request_threshold=int(self.request_threshold), max_inflight=int(self.max_inflight),
                            request_timeout_s=float(self.request_timeout_s),
                            initial_latency_s=None if self.initial_latency_s is None else float(self.initial_latency_s),
                            fallback=str(self.fallback), slow_factor=float(self.slow_factor),
                            min_samples=int(self.fallback_min_samples))
