"""Shape legend, units and data containers shared by every wmrl package.

Shape legend (used in every docstring of the project)
-----------------------------------------------------
==========  ===============================================================
``B``       batch (parallel environments, or imagined branches)
``G``       group size (rollouts from the same start in GRPO)
``T``       time steps of an episode or an observation history
``H``       action-chunk length (control steps executed per policy call)
``K``       denoising steps of a flow / diffusion sampler
``C``       image channels (3, RGB)
``Hi, Wi``  image height and width in pixels
``D_a``     action dimension (7 for OSC_POSE: dx, dy, dz, dax, day, daz, gripper)
``D_s``     proprio state dimension
==========  ===============================================================

Units and conventions (decided once here, tested once)
------------------------------------------------------
* Images are ``uint8`` RGB, channel-first ``(C, Hi, Wi)`` in containers, **upright** (the table at
  the bottom of ``agentview``); MuJoCo's bottom-up offscreen buffer is flipped once, in ``sim``.
* Camera names follow robosuite: ``agentview`` (third person), ``robot0_eye_in_hand`` (wrist).
* Proprio (``D_s = 9`` for the Panda suite): end-effector position in the robot base frame (m, 3),
  end-effector orientation ``quat_wxyz`` (4), gripper finger joint positions (m, 2).
* Actions are what the controller takes, declared by :class:`ActionSpace`. The default suite uses
  robosuite's ``OSC_POSE`` in delta mode: xyz and axis-angle deltas scaled to [-1, 1], gripper
  ``-1 = open, +1 = close`` (:data:`PANDA_OSC_POSE`); ``suite=ee`` takes absolute end-effector
  targets ``(x, y, z, yaw, gripper)`` in the base frame (:data:`PANDA_EE_YAW`).
* Quaternions are named by their order: ``quat_wxyz`` (MuJoCo), ``quat_xyzw`` (robosuite utils).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

AGENTVIEW = "agentview"
EYE_IN_HAND = "robot0_eye_in_hand"


@dataclass(frozen=True)
class ActionSpace:
    """How the numbers of an action are to be read by the robot's controller.

    Attributes:
        dim: ``D_a``.
        controller: controller name, e.g. ``"OSC_POSE"``.
        mode: ``"delta"`` (relative to the current pose) or ``"absolute"``.
        frame: frame the translation / rotation are expressed in, e.g. ``"base"``.
        rotation: rotation representation: ``"axis_angle"`` (3 dims), or ``"yaw_down"`` (1 dim, the
            yaw in rad of a gripper held pointing down; roll and pitch are not commanded).
        gripper_open: the gripper command value that opens (``-1.0`` in robosuite).
        gripper_close: the gripper command value that closes (``+1.0`` in robosuite).
        low, high: declared range (the controller clips to it): one value for every dimension, or
            a tuple of ``dim`` values (JSON lists from a store or checkpoint become tuples).

    Raises:
        ValueError: a per-dimension range whose length is not ``dim``.
    """

    dim: int = 7
    controller: str = "OSC_POSE"
    mode: Literal["delta", "absolute"] = "delta"
    frame: str = "base"
    rotation: str = "axis_angle"
    gripper_open: float = -1.0
    gripper_close: float = 1.0
    low: float | tuple[float, ...] = -1.0
    high: float | tuple[float, ...] = 1.0

    def __post_init__(self):
        for name in ("low", "high"):
            v = getattr(self, name)
            if isinstance(v, (list, tuple, np.ndarray)):
                v = tuple(float(x) for x in v)
                if len(v) != self.dim:
                    raise ValueError(f"ActionSpace.{name} has {len(v)} values, dim={self.dim}")
            else:
                v = float(v)
            object.__setattr__(self, name, v)

    def bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """``(low, high)`` as ``float64 (dim,)`` arrays."""
        return (np.broadcast_to(np.asarray(self.low, np.float64), (self.dim,)).copy(),
                np.broadcast_to(np.asarray(self.high, np.float64), (self.dim,)).copy())

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        for name in ("low", "high"):
            if isinstance(d[name], tuple):
                d[name] = list(d[name])
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ActionSpace":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


PANDA_OSC_POSE = ActionSpace()

#: Absolute end-effector targets of the Panda suite (``sim.control.EeTargetControl``, ``suite=ee``):
#: ``(x, y, z, yaw, gripper)``, position in the robot base frame (m) within the reachable part of the
#: table, yaw in rad of the gripper held pointing down, gripper -1 open / +1 close.
PANDA_EE_YAW = ActionSpace(dim=5, controller="OSC_POSE", mode="absolute", frame="base", rotation="yaw_down",
                           low=(0.25, -0.35, -0.105, -float(np.pi), -1.0),
                           high=(0.85, 0.35, 0.35, float(np.pi), 1.0))


@dataclass
class Obs:
    """A batch of observations.

    Attributes:
        images: camera name -> ``uint8`` tensor ``(B, C, Hi, Wi)``, upright RGB.
        proprio: ``float32`` tensor ``(B, D_s)`` (see module docstring for the layout).
        task: ``B`` instruction strings.
    """

    images: dict[str, torch.Tensor]
    proprio: torch.Tensor
    task: list[str]

    @property
    def batch_size(self) -> int:
        return int(self.proprio.shape[0])

    def validate(self) -> "Obs":
        """Check dtypes and shapes; raise ``ValueError`` naming what is wrong."""
        b = self.batch_size
        if self.proprio.ndim != 2:
            raise ValueError(f"Obs.proprio must be (B, D_s), got shape {tuple(self.proprio.shape)}")
        for name, img in self.images.items():
            if img.dtype != torch.uint8:
                raise ValueError(f"Obs.images[{name!r}] must be uint8, got {img.dtype}")
            if img.ndim != 4 or img.shape[0] != b or img.shape[1] != 3:
                raise ValueError(
                    f"Obs.images[{name!r}] must be (B={b}, 3, Hi, Wi), got {tuple(img.shape)}"
                )
        if len(self.task) != b:
            raise ValueError(f"Obs.task has {len(self.task)} strings for a batch of {b}")
        return self

    def index(self, idx) -> "Obs":
        """Select batch entries (int list, slice, or bool / long tensor)."""
        if isinstance(idx, torch.Tensor):
            idx_list = idx.nonzero().flatten().tolist() if idx.dtype == torch.bool else idx.tolist()
        elif isinstance(idx, slice):
            idx_list = list(range(self.batch_size))[idx]
        else:
            idx_list = list(idx)
        t = torch.as_tensor(idx_list, dtype=torch.long)
        return Obs(
            images={k: v[t] for k, v in self.images.items()},
            proprio=self.proprio[t],
            task=[self.task[i] for i in idx_list],
        )

    def to(self, device: torch.device | str) -> "Obs":
        return Obs({k: v.to(device) for k, v in self.images.items()}, self.proprio.to(device), list(self.task))

    @staticmethod
    def cat(items: list["Obs"]) -> "Obs":
        return Obs(
            images={k: torch.cat([o.images[k] for o in items]) for k in items[0].images},
            proprio=torch.cat([o.proprio for o in items]),
            task=[t for o in items for t in o.task],
        )


@dataclass
class Start:
    """Where a rollout starts: a task, an init state and/or real context frames.

    Attributes:
        task_name: suite task id (e.g. ``"lift_red"``).
        instruction: language instruction.
        init_index: index into the task's init states (``None`` when starting from a stored frame).
        split: ``"train"`` or ``"eval"`` init-state set.
        sim_state: flattened MuJoCo state ``float64 (1 + nq + nv,)`` or ``None``.
        context: observation history ``Obs`` with batch dim = T context frames (oldest first), or
            ``None``; the world model starts from it.
        episode: source episode index in an EpisodeStore, if any; ``step``: its step.
        max_chunks: a *branch*: the rollout from this start stops after this many chunks even if
            its episode goes on, and a chunk value bootstraps the rest (``GRPOConfig.advantage =
            "gae"``; VLA-MBPO's short branches); ``None``: GRPO's own ``max_chunks``.
    """

    task_name: str
    instruction: str
    init_index: int | None = None
    split: Literal["train", "eval"] = "eval"
    sim_state: object | None = None
    context: Obs | None = None
    episode: int | None = None
    step: int | None = None
    max_chunks: int | None = None


@dataclass
class PolicySample:
    """Output of ``Policy.sample``.

    Attributes:
        actions: ``float32 (B, H, D_a)`` in the controller's action space (unnormalised).
        log_prob: ``float32 (B,)`` log-density of the sampled chain (``0`` for deterministic
            samplers, where it is not defined).
        extras: sampler-specific tensors needed to recompute ``log_prob`` (e.g. the denoising
            chain ``(B, K+1, H, D_a)``), all with leading dim ``B``.
    """

    actions: torch.Tensor
    log_prob: torch.Tensor
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    def index(self, idx: torch.Tensor) -> "PolicySample":
        return PolicySample(self.actions[idx], self.log_prob[idx], {k: v[idx] for k, v in self.extras.items()})


@dataclass
class StepResult:
    """What ``ChunkEnv.step`` returns for one action chunk.

    Attributes:
        obs: observation after the chunk (after an auto-reset for finished slots, see ``info``).
        reward: ``float32 (B,)``, summed over the executed steps of the chunk.
        terminated: ``bool (B,)`` success or failure ended the episode inside this chunk.
        truncated: ``bool (B,)`` the step limit ended the episode inside this chunk.
        success: ``bool (B,)`` the success predicate held at the end of the executed steps.
        steps_executed: ``int64 (B,)`` control steps actually executed (``<= H``).
        info: extra per-slot data, e.g. ``final_obs`` (the observation before auto-reset).
    """

    obs: Obs
    reward: torch.Tensor
    terminated: torch.Tensor
    truncated: torch.Tensor
    success: torch.Tensor
    steps_executed: torch.Tensor
    info: dict = field(default_factory=dict)

    @property
    def done(self) -> torch.Tensor:
        return self.terminated | self.truncated


@dataclass
class Rollout:
    """A batch of chunk-level trajectories, as GRPO consumes them.

    Attributes:
        obs: list over chunk index ``n`` of ``Obs`` (batch ``B``) the policy saw.
        samples: list over ``n`` of ``PolicySample``.
        rewards: ``float32 (B, N)`` chunk rewards.
        alive: ``bool (B, N)`` whether the slot was still in its episode at chunk ``n``.
        success: ``bool (B,)`` episode success.
        group_ids: ``int64 (B,)`` GRPO group of each slot.
        final_obs: ``Obs`` (batch ``B``) after the last executed chunk, or ``None``.
        cut: ``bool (B,)`` slots of branch starts (``Start.max_chunks``) whose episode was still
            going when the branch stopped (a value bootstraps their rest), or ``None``.
    """

    obs: list[Obs]
    samples: list[PolicySample]
    rewards: torch.Tensor
    alive: torch.Tensor
    success: torch.Tensor
    group_ids: torch.Tensor
    final_obs: Obs | None = None
    cut: torch.Tensor | None = None


@dataclass
class Episode:
    """One recorded episode, as stored in and read from an ``EpisodeStore``.

    ``T`` is the number of steps; observation ``t`` is what the robot saw before executing
    ``actions[t]``.

    Attributes:
        images: camera name -> ``uint8 (T, 3, Hi, Wi)`` upright RGB.
        proprio: ``float32 (T, D_s)``.
        actions: ``float32 (T, D_a)`` as the controller takes them (see ``ActionSpace``).
        rewards: ``float32 (T,)`` reward received after ``actions[t]``.
        success: whether the episode achieved its task.
        instruction: language instruction.
        task_name: task id (e.g. ``"lift_red"``), ``""`` when unknown.
        sim_states: optional ``float64 (T, 1 + nq + nv)`` flattened MuJoCo states.
        extras: optional per-step arrays with leading dim ``T`` (timestamps in s, latencies in s, ...).
        info: JSON-serialisable per-episode metadata (init index, seed, failure label, source, ...).
    """

    images: dict[str, "np.ndarray"]
    proprio: "np.ndarray"
    actions: "np.ndarray"
    rewards: "np.ndarray"
    success: bool
    instruction: str
    task_name: str = ""
    sim_states: "np.ndarray | None" = None
    extras: dict[str, "np.ndarray"] = field(default_factory=dict)
    info: dict = field(default_factory=dict)

    @property
    def length(self) -> int:
        return int(self.actions.shape[0])
