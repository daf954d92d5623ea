"""The record of one robot episode as the client runs it: :class:`StepLog` (what each control step
observed and commanded) becomes a ``wmrl.kernel.types.Episode`` for the EpisodeStore;
:class:`EpisodeResult` is what ``robot_bridge.client.RobotClient.run_episode`` returns;
:func:`episode_ran` tells whether an episode ran to completion.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from wmrl.kernel.types import Episode


def episode_ran(label: str) -> bool:
    """Whether an episode with this failure label ran to completion: a success (``""``), a task
    failure (``timeout``, ``critic``) or an operator's verdict (``operator:<label>``); not one cut
    short by the watchdog, an e-stop or an interruption (``operator:interrupted``)."""
    if label in ("", "timeout", "critic"):
        return True
    return label.startswith("operator:") and label != "operator:interrupted"


@dataclass
class EpisodeResult:
    """Outcome of :meth:`RobotClient.run_episode`.

    ``episode`` is the record for the EpisodeStore (``extras``: ``t_cmd`` s since start,
    ``starved`` 0/1, ``clipped`` 0/1, ``cmd_latency_s`` obs-to-command latency of the action's
    chunk (NaN on hold), ``chunk_id``); ``failure_label``: ``""`` on success, else
    ``timeout`` | ``watchdog`` | ``estop`` | ``operator:<label>`` | ``critic``.
    """

    episode: Episode
    success: bool
    failure_label: str
    steps: int
    starved_after_first: int
    time_to_first_action_s: float
    latencies_s: list[float]
    round_trips_s: list[float]
    stopped_at_s: float | None
    stats: dict = field(default_factory=dict)


class StepLog:
    """Per control step: the images and proprio observed, the command applied (after the safety
    filter), its time since the episode start (s), whether the robot held for lack of actions,
    whether the command was clipped, the observation-to-command latency of its chunk (NaN on
    hold) and the chunk id (``-1`` on hold)."""

    def __init__(self, cameras):
        self.cameras = list(cameras)
        self.images: dict[str, list[np.ndarray]] = {c: [] for c in self.cameras}
        self.proprio: list[np.ndarray] = []
        self.actions: list[np.ndarray] = []
        self.t: list[float] = []
        self.starved: list[float] = []
        self.clipped: list[float] = []
        self.latency: list[float] = []
        self.chunk_id: list[int] = []
        self.fresh: list[float] = []

    def __len__(self) -> int:
        return len(self.actions)

    def append(self, images: dict, proprio: np.ndarray, cmd: np.ndarray, t: float, starved: bool, clipped: bool,
               latency: float, chunk_id: int, fresh: bool = True) -> None:
        for c in self.cameras:
            self.images[c].append(images[c])
        self.proprio.append(proprio)
        self.actions.append(cmd)
        self.t.append(t)
        self.starved.append(float(starved))
        self.clipped.append(float(clipped))
        self.latency.append(latency)
        self.chunk_id.append(chunk_id)
        self.fresh.append(float(fresh))

    def episode(self, robot, success: bool, info: dict) -> Episode:
        """The ``Episode`` (images ``uint8 (T, 3, Hi, Wi)``, proprio ``float32 (T, D_s)``, actions
        ``float32 (T, D_a)``, reward 1 at the last step of a success; ``extras`` ``t_cmd``,
        ``starved``, ``clipped``, ``cmd_latency_s``, ``chunk_id``, ``frame_fresh``: 1 where the
        step's frames were read at that step, 0 where they repeat an earlier step's, see
        ``ClientConfig.frames``) of ``robot``'s shapes."""
        T = len(self.actions)
        D_s, D_a = robot.state_dim, robot.action_dim
        h, w = robot.image_size
        return Episode(
            images={c: (np.stack(self.images[c]).astype(np.uint8) if T else np.zeros((0, 3, h, w), np.uint8))
                    for c in self.cameras},
            proprio=np.stack(self.proprio).astype(np.float32) if T else np.zeros((0, D_s), np.float32),
            actions=np.stack(self.actions).astype(np.float32) if T else np.zeros((0, D_a), np.float32),
            rewards=np.zeros(T, np.float32) if not success else np.eye(1, T, T - 1, dtype=np.float32)[0],
            success=success, instruction=robot.task, task_name=getattr(robot, "task_name", ""),
            extras={"t_cmd": np.asarray(self.t, np.float64), "starved": np.asarray(self.starved, np.float32),
                    "clipped": np.asarray(self.clipped, np.float32),
                    "cmd_latency_s": np.asarray(self.latency, np.float64),
                    "chunk_id": np.asarray(self.chunk_id, np.int64),
                    "frame_fresh": np.asarray(self.fresh, np.float32)},
            info=info)


def percentile_or_none(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def failure_source(label: str) -> str:
    if not label:
        return ""
    if label == "timeout":
        return "success_predicate"
    if label.startswith("operator"):
        return "operator"
    return label
