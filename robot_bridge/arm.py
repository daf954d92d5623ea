"""The arm side of ``wmrl robot``: a simulated arm behind :class:`robot_bridge.client.RobotInterface`,
the episode recorder, and the node loop that runs episodes and records every one of them.

The simulator is injected: :class:`ChunkEnvArm` drives any ``wmrl.kernel.interfaces.ChunkEnv`` with one
slot (the sim suite's ``SimEnv`` built with ``auto_reset=False``) one control step at a time, so
this package never imports ``sim``; the composition root (``wmrl/run/robot.py``) builds the env.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Callable, Sequence

import numpy as np
import torch

from robot_bridge.client import (
    ClientConfig,
    EpisodeResult,
    ReconnectPolicy,
    RobotClient,
    episode_ran,
)
from robot_bridge.safety import SafetyLimits
from wmrl.kernel.pose import yaw_of_down_quat
from wmrl.kernel.types import Start

log = logging.getLogger("robot_bridge.arm")


class ChunkEnvArm:
    """A :class:`RobotInterface` over a one-slot ``ChunkEnv`` stepped with ``(1, 1, D_a)`` chunks.

    Args:
        env: ``ChunkEnv`` with ``num_envs == 1`` (no auto-reset).
        starts: ``Start`` per episode index (a sequence, cycled, or a callable ``i -> Start``).
        cameras: camera names in the env's observations.
        image_size: ``(Hi, Wi)``.
        state_dim: ``D_s``.
        gripper_dim: index of the gripper command (kept when holding); ``None``: no gripper;
            ``"auto"``: the last dimension of the env's ``action_space`` (6 for the 7-D ``OSC_POSE``
            delta space, 4 for ``suite=ee``'s 5-D targets).
        gripper_open: gripper command before any command was sent.

    ``hold_action`` keeps the arm where it is: in a delta space (``action_space.mode == "delta"``,
    or no ``action_space``) the zero delta; in the absolute ``yaw_down`` space (``suite=ee``) the
    current end-effector pose as the target, ``(x, y, z, yaw)`` read from the Panda proprio
    (``D_s = 9``: position in m, quaternion ``wxyz``), with the last gripper command.
    ``done()`` is true once the env terminated or truncated the episode. ``observe(images=False)``
    reads only the proprio (``frames_on_demand``: with an env that renders on demand, e.g.
    ``sim.libero.env.LiberoChunkEnv(frames="on_demand")``, nothing is rendered for it).

    Raises:
        ValueError: an absolute action space other than ``yaw_down`` (no hold pose is known for it),
            or a ``num_envs`` other than 1.
    """

    def __init__(self, env, starts: Sequence[Start] | Callable[[int], Start], cameras: Sequence[str],
                 image_size: Sequence[int], state_dim: int = 9, gripper_dim: int | None | str = "auto",
                 gripper_open: float = -1.0):
        if getattr(env, "num_envs", 1) != 1:
            raise ValueError(f"ChunkEnvArm drives one robot; build the env with num_envs=1, got {env.num_envs}")
        self.env = env
        self.starts = starts
        self.cameras = list(cameras)
        self.image_size = (int(image_size[0]), int(image_size[1]))
        self.action_dim = int(env.action_dim)
        self.state_dim = int(state_dim)
        space = getattr(env, "action_space", None)
        self.absolute = space is not None and getattr(space, "mode", "delta") == "absolute"
        if self.absolute and (getattr(space, "rotation", "") != "yaw_down" or self.state_dim != 9):
            raise ValueError(f"ChunkEnvArm holds absolute targets only in the yaw_down space with the Panda "
                             f"proprio (D_s=9), got rotation={space.rotation!r}, D_s={self.state_dim}")
        self.gripper_dim = self.action_dim - 1 if gripper_dim == "auto" else gripper_dim
        self.gripper_open = gripper_open
        self.task = ""
        self.task_name = ""
        self._lock = threading.Lock()
        self._obs = None
        self._success = False
        self._done = False
        self.stopped = False
        self.sim_states: list[np.ndarray] = []

    def _start(self, i: int) -> Start:
        if callable(self.starts):
            return self.starts(i)
        return self.starts[i % len(self.starts)]

    def reset_episode(self, i: int) -> Start:
        start = self._start(i)
        with self._lock:
            self._obs = self.env.reset([start])
            self.task, self.task_name = start.instruction, start.task_name
            self._success = self._done = self.stopped = False
        return start

    frames_on_demand = True

    def observe(self, images: bool = True):
        with self._lock:
            o = self._obs
            return (o.proprio[0].detach().cpu().numpy().astype(np.float32),
                    {c: o.images[c][0].detach().cpu().numpy() for c in self.cameras} if images else {})

    def apply(self, action: np.ndarray) -> None:
        with self._lock:
            if self.stopped or self._done:
                return
            res = self.env.step(torch.as_tensor(np.asarray(action, np.float32)).view(1, 1, -1))
            self._obs = res.info.get("final_obs", res.obs) if bool(res.done[0]) and "final_obs" in res.info else res.obs
            self._success = self._success or bool(res.success[0])
            self._done = bool(res.done[0])

    def hold_action(self, last):
        h = np.zeros(self.action_dim, np.float32)
        if self.absolute:  # the target where the end effector is now
            with self._lock:
                p = self._obs.proprio[0].detach().cpu().double()
            h[:3] = p[:3].numpy()
            h[3] = float(yaw_of_down_quat(p[3:7]))
        if self.gripper_dim is not None:
            h[self.gripper_dim] = self.gripper_open if last is None else last[self.gripper_dim]
        return h

    def stop(self) -> None:
        self.stopped = True  # a simulated arm stops by not being stepped any more

    def success(self) -> bool:
        return self._success

    def done(self) -> bool:
        return self._done


class EpisodeRecorder:
    """Appends every deployed episode to an ``EpisodeStore`` (``append(Episode) -> int``; its
    appends are crash-safe). Episodes with no executed step cannot be stored and are counted in
    ``skipped``."""

    def __init__(self, store):
        self.store = store
        self.indices: list[int] = []
        self.skipped = 0

    def record(self, result: EpisodeResult) -> int | None:
        if result.steps == 0:
            self.skipped += 1
            log.warning("episode %s had no executed step; nothing to record", result.episode.info.get("episode"))
            return None
        i = self.store.append(result.episode)
        self.indices.append(i)
        return i


def run_node(arm, transport, episodes: int, client_cfg: ClientConfig | None = None,
             safety: SafetyLimits | None = None, recorder: EpisodeRecorder | None = None,
             critic: Callable | None = None, progress: bool = True,
             transport_factory: Callable | None = None, reconnect: ReconnectPolicy | None = None) -> dict:
    """Connect to the policy server and run ``episodes`` episodes of ``arm`` in real time,
    recording each (also failed, e-stopped and watchdog-stopped ones) with ``recorder``.

    ``transport``: the first link (``None``: open it with ``transport_factory``). When the server
    goes away the episode under way is stopped by the watchdog and recorded as ``watchdog``; the
    node then reopens the link with ``transport_factory`` per ``reconnect`` (default: no retry)
    and runs the remaining episodes; if the server does not come back, they are not run.

    SIGTERM ends the current episode as failed (label ``operator:interrupted``), records it and
    stops; SIGUSR1 is an e-stop (the arm stops at once, the episode is recorded as ``estop``);
    SIGUSR2 flags the current episode as an operator failure (``operator:operator``).

    Returns a summary dict: per-episode outcome, starvation, latencies, time to first action, the
    fallback decided (``fallback``: ``""``, ``hold`` or ``slow``, with ``fallback_decision``);
    ``episodes_lost`` (indices of the episodes that did not run to completion, see
    :func:`robot_bridge.client.episode_ran`, or did not run at all), ``all_ran``, ``reconnects``
    (one row per reopened link: after which episode, seconds to ``Ready``) and ``gave_up`` (the
    last connection error when the server did not come back, else ``None``).

    Raises:
        ConnectionError: no link could be opened at start (the policy's retries exhausted).
    """
    from tqdm import tqdm

    client = RobotClient(arm, transport, client_cfg, safety=safety, critic=critic,
                         transport_factory=transport_factory)
    stop = threading.Event()
    t0 = time.monotonic()
    ready = client.connect_with_retry(reconnect, stop)
    connect_s = time.monotonic() - t0
    log.info("connected to the policy server: chunk_size=%d warm-up %.2f s, RTC %s", ready.chunk_size,
             ready.warmup_s, "on" if ready.supports_prefix else "off")
    rows, reconnects = [], []
    gave_up = None
    interrupted = {"flag": False}

    def on_term(signum, frame):  # noqa: ARG001
        interrupted["flag"] = True
        stop.set()
        client.flag_failure("interrupted")

    old = _operator_signals(client, on_term)
    try:
        for i in tqdm(range(episodes), desc="robot episodes", disable=not progress):
            if not client.link_up:
                gave_up = _reconnect(client, reconnect, stop, i, reconnects)
                if gave_up is not None:
                    break
            if hasattr(arm, "reset_episode"):
                arm.reset_episode(i)
            elif hasattr(arm, "reset"):
                arm.reset()
            try:
                res = client.run_episode(i)
            except KeyboardInterrupt:
                interrupted["flag"] = True
                raise
            rows.append(_episode_row(i, arm, res, recorder.record(res) if recorder is not None else None))
            if interrupted["flag"] or res.failure_label == "estop":
                break
            if res.failure_label == "watchdog":
                client.drop_link()  # the server went silent: a fresh link before the next episode
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        client.close()
    n = len(rows)
    total_after = sum(r["ticks_after_first"] for r in rows)
    lost = [r["episode"] for r in rows if not episode_ran(r["failure_label"])] + list(range(n, episodes))
    return {"episodes": rows, "num_episodes": n, "success_rate": sum(r["success"] for r in rows) / max(1, n),
            "starvation_rate": sum(r["starved_after_first"] for r in rows) / max(1, total_after),
            "connect_s": connect_s, "warmup_s": ready.warmup_s, "supports_prefix": ready.supports_prefix,
            "interrupted": interrupted["flag"], "episodes_planned": episodes, "episodes_lost": lost,
            "all_ran": not lost, "reconnects": reconnects, "gave_up": gave_up}


def _operator_signals(client: RobotClient, on_term) -> dict:
    """Install the node's signal handlers (main thread only); returns the previous ones."""
    old = {}
    if threading.current_thread() is threading.main_thread():
        old[signal.SIGTERM] = signal.signal(signal.SIGTERM, on_term)
        # operator controls for a headless node: SIGUSR1 = e-stop, SIGUSR2 = flag the episode as failed
        old[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, lambda *_: _estop_from_signal(client))
        old[signal.SIGUSR2] = signal.signal(signal.SIGUSR2, lambda *_: client.flag_failure("operator"))
    return old


def _estop_from_signal(client: RobotClient) -> threading.Thread:
    """The SIGUSR1 handler. A handler runs in the main thread between two bytecodes, possibly while
    that thread holds the robot's lock inside ``observe``/``apply``; calling ``robot.stop()`` there
    (which takes the same lock) would deadlock the node. So the handler only starts a thread that
    calls :meth:`RobotClient.estop`: the e-stop event is set at once and the robot is stopped as soon
    as the interrupted call lets go of its lock (the control loop also stops it at the next tick)."""
    t = threading.Thread(target=client.estop, args=("operator signal",), name="wmrl-estop", daemon=True)
    t.start()
    return t


def _reconnect(client: RobotClient, policy: ReconnectPolicy | None, stop: threading.Event, episode: int,
               reconnects: list[dict]) -> str | None:
    """Reopen the link before ``episode``; appends a row to ``reconnects`` and returns ``None``, or
    returns the error once the policy gave up."""
    t0 = time.monotonic()
    log.warning("link to the policy server lost; reconnecting before episode %d", episode)
    try:
        client.connect_with_retry(policy, stop)
    except ConnectionError as e:
        log.error("policy server did not come back (%s); episodes %d.. not run", e, episode)
        return str(e)
    reconnects.append({"before_episode": episode, "connect_s": time.monotonic() - t0})
    log.info("reconnected to the policy server in %.2f s", reconnects[-1]["connect_s"])
    return None


def _episode_row(i: int, arm, res: EpisodeResult, store_index: int | None) -> dict:
    lat = np.asarray(res.latencies_s) if res.latencies_s else np.zeros(0)
    ticks_after = max(0, res.steps - int(np.argmax(res.episode.extras["starved"] == 0))) if res.steps else 0
    return {"episode": i, "store_index": store_index, "task": arm.task_name, "success": res.success,
            "failure_label": res.failure_label, "steps": res.steps,
            "starved_after_first": res.starved_after_first, "ticks_after_first": ticks_after,
            "starvation_rate": res.starved_after_first / max(1, ticks_after),
            "time_to_first_action_s": res.time_to_first_action_s,
            "latency_p50_ms": float(np.percentile(lat, 50) * 1e3) if lat.size else None,
            "latency_p99_ms": float(np.percentile(lat, 99) * 1e3) if lat.size else None,
            "overruns": res.stats.get("overruns", 0), "stopped_at_s": res.stopped_at_s,
            "fallback": res.episode.info.get("fallback", ""), "fallback_decision": res.stats.get("fallback"),
            "control_hz_effective": res.episode.info.get("control_hz_effective"),
            "inflight_max": res.stats.get("inflight_max", 0)}
