"""The six role protocols (Policy, ChunkEnv, WorldModel, ProgressCritic, Transport, Suite) and the
capability protocols (FlowPolicy, SteerableFlowPolicy, SamplerPolicy, SimStateEnv, CountingEnv, RandomStreams). Implementations live in the
component packages and are put together only in ``wmrl/run/`` (the composition roots). Contract
tests over every implementation: ``tests/test_contracts.py``.

A capability is a declared member, never a probe: a policy says ``supports_rtc = False`` rather than
lacking a method, and a caller that needs an optional capability checks ``isinstance(x, FlowPolicy)``
(a ``runtime_checkable`` protocol) instead of ``hasattr(x, "flow_matching_loss")``. ``isinstance``
looks members up statically (``inspect.getattr_static``, Python 3.12), so declare them as class
attributes, instance attributes, methods or properties, not as ``nn.Module`` children or buffers.

See ``wmrl.kernel.types`` for the shape legend and units.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from wmrl.kernel.types import ActionSpace, Obs, PolicySample, Start, StepResult


@runtime_checkable
class Policy(Protocol):
    """A chunking policy (the sampling / likelihood interface of Flow-GRPO, Liu et al. 2025).

    Attributes:
        chunk_size: ``H``, actions per sampled chunk.
        action_dim: ``D_a``.
        supports_rtc: whether the policy samples a chunk guided by a committed prefix of the previous
            one (real-time chunking, Black et al. 2025) in its own flow-time convention: ``sample``
            then also takes ``prefix=`` (committed actions ``float32 (P, D_a)``, controller units)
            and ``delay=`` (int, prefix actions frozen) and returns a chunk that continues the prefix
            (``policies.rtc``); the robot bridge asks for it only when ``True``.
    """

    chunk_size: int  # H
    action_dim: int  # D_a
    supports_rtc: bool

    def sample(self, obs: Obs, generator: torch.Generator | None = None) -> PolicySample:
        """Sample an action chunk ``(B, H, D_a)`` for ``obs`` (batch ``B``)."""

    def log_prob(self, obs: Obs, sample: PolicySample, per_step: bool = False) -> torch.Tensor:
        """Differentiable ``float32 (B,)`` log-probability of ``sample`` under the current params;
        ``per_step=True``: per step of the sampling chain, ``float32 (B, K)`` (``K = 1`` for a
        policy that samples in one step)."""


@runtime_checkable
class FlowPolicy(Protocol):
    """Capability: a flow-matching policy that gives its conditional flow-matching loss, the
    likelihood stand-in of FPO (McAllister et al. 2025; GRPO ``ratio="fpo"``)."""

    def flow_matching_loss(self, obs: Obs, sample: PolicySample, t: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
        """``float32 (B,)`` conditional flow-matching loss of ``sample``'s normalised chunk at flow times
        ``t`` ``float32 (B, N)`` with noise ``eps`` ``float32 (B, N, H, D_a)``, averaged over the ``N``
        draws; differentiable in the parameters. ``ValueError`` when the sample cannot be scored."""


@runtime_checkable
class SteerableFlowPolicy(Protocol):
    """Capability: a flow policy whose conditioning and velocity field are exposed, so its initial
    noise can be steered (``policies.steering.LatentNoisePolicy``, DSRL)."""

    chunk_size: int
    action_dim: int
    init_config: dict  # constructor arguments; ``init_config["cond_dim"]`` is ``C``
    action_space: Any  # the ActionSpace actions are clipped to
    # and a ``normalizer`` (``unnormalize("actions", x)``: normalised chunk -> actions). Not a declared
    # member: an ``nn.Module`` child is invisible to ``isinstance``'s static lookup (Python 3.12).

    def encode(self, images: dict[str, torch.Tensor], proprio: torch.Tensor, tasks: list[str], *args, **kwargs) -> torch.Tensor:
        """Conditioning ``float32 (B, C)`` of an observation."""

    def velocity(self, x: torch.Tensor, t: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """Velocity ``(B, H, D_a)`` of the normalised chunk ``x`` at flow time ``t`` ``(B,)``."""


@runtime_checkable
class SamplerPolicy(Protocol):
    """Capability: a policy whose sampling scheme is the swappable attribute ``sampler`` (a
    ``policies.samplers`` object or ``policies.steering.LatentNoiseSampler``); evaluation and GRPO set
    their own for a while (``FlowVLAPolicy``, ``LatentNoisePolicy``, ``LeRobotFlowPolicy``)."""

    sampler: Any


@runtime_checkable
class ChunkEnv(Protocol):
    """A batched environment stepped one action chunk at a time (SimEnv and ImaginationEnv).

    Semantics every implementation must keep (tested in ``tests/test_contracts.py``):
    * success or termination at an inner step ends the chunk there for that slot; the remaining
      actions are not executed; the reward of the executed steps is kept;
    * with ``auto_reset`` only finished slots reset, and ``StepResult.terminated|truncated``
      marks the boundary.
    """

    num_envs: int  # B
    action_dim: int  # D_a

    def reset(self, starts: list[Start]) -> Obs:
        """Reset every slot to ``starts[i]``; ``len(starts) == num_envs``."""

    def reset_slots(self, slots: Sequence[int], starts: Sequence[Start]) -> Obs:
        """Reset only ``slots`` (to ``starts``, same length) and return the whole batch's current
        observation; raise ``ValueError`` on a length mismatch or a slot out of range."""

    def step(self, actions: torch.Tensor) -> StepResult:
        """Execute ``actions`` ``float32 (B, H, D_a)``; raise ``ValueError`` on a wrong shape."""


@runtime_checkable
class SimStateEnv(Protocol):
    """Capability: a ``ChunkEnv`` over a simulator that gives a slot's exact simulator state (e.g.
    ``sim.env.SimEnv``: flattened MuJoCo state ``float64 (1 + nq + nv,)``), so a ``Start`` can carry it
    (``Start.sim_state``) and an episode can be replayed from it."""

    def sim_state(self, slot: int) -> Any:
        """The state of ``slot`` now (a copy); ``RuntimeError`` for a slot never reset."""


@runtime_checkable
class WorldModel(Protocol):
    """Action-conditioned video world model with an explicit state (DreamerV3's vocabulary).

    Attributes:
        action_dim: ``D_a`` of the actions ``imagine`` takes.
        chunk_size: ``H``, the chunk length ``imagine`` predicts over (``None``: any ``H``).
        context_frames: how many most recent frames of the context ``init`` conditions on.
    """

    action_dim: int
    chunk_size: int | None
    context_frames: int

    def init(self, context: Obs) -> Any:
        """Build the model state from context frames ``Obs`` (batch ``B``)."""

    def imagine(self, state: Any, actions: torch.Tensor, generator: torch.Generator | None = None) -> tuple[Any, Obs]:
        """Predict the observation after executing ``actions`` ``(B, H, D_a)`` from ``state``."""


@runtime_checkable
class UncertainWorldModel(Protocol):
    """Capability: a world model that says how sure it is of an imagined state (an ensemble's
    disagreement, MOReL / MOPO), for the imagination to halt on."""

    def uncertainty(self, state: Any) -> torch.Tensor | None:
        """``float32 (B,)`` (m for the end-effector position of ``worldmodels.dynamics``), or ``None``
        for a state it did not imagine (just ``init``-ed)."""


@runtime_checkable
class SlotStateWorldModel(Protocol):
    """Capability: a world model whose batched state can be merged per slot, so that resetting (or
    freezing) some imagined branches leaves the others' state whole (an ensemble's carried velocity,
    the rollout's real start frame); without it the imagination re-``init``s every slot from its
    last observation."""

    def merge_states(self, state: Any, slots: torch.Tensor, other: Any) -> Any:
        """A state equal to ``state`` except on ``slots`` (``bool (B,)``), which come from ``other``
        (same batch ``B``); neither input is modified."""


@runtime_checkable
class ProgressCritic(Protocol):
    """Progress-value critic (RISE's progress value model)."""

    def progress(self, obs: Obs) -> torch.Tensor:
        """``float32 (B,)`` task progress in [0, 1]."""

    def success_prob(self, obs: Obs) -> torch.Tensor:
        """``float32 (B,)`` probability that the task is achieved in ``obs``."""

    def evaluate(self, obs: Obs) -> tuple[torch.Tensor, torch.Tensor]:
        """``(progress(obs), success_prob(obs))`` (one forward pass where the critic can), each ``float32 (B,)``."""


@runtime_checkable
class Transport(Protocol):
    """Typed message transport between the policy server and the robot client."""

    def send(self, message: Any) -> None:
        """Send one typed message; raise ``ConnectionError`` when the link is down."""

    def recv(self, timeout: float | None = None) -> Any | None:
        """Receive the next message, or ``None`` after ``timeout`` seconds."""

    def close(self) -> None:
        ...


@runtime_checkable
class Suite(Protocol):
    """A task suite (LIBERO's vocabulary): named tasks with instructions and step limits, stored
    train / eval init states, the observation settings of its environments and the factory of its
    ``ChunkEnv``. Implementation: ``sim.suite.Suite`` (``configs/suite/*.yaml``); a new task is a
    class plus a YAML entry (see ``sim.tasks.TaskSpec``).

    Attributes:
        name: suite name for reports. task_names: its tasks, in order.
        cameras: observation cameras; image_size: ``(Hi, Wi)``; state_dim: ``D_s``; fps: control rate (Hz).
        action_space: the ``ActionSpace`` of its environments (``action_space.dim == D_a``).
    """

    name: str
    cameras: tuple[str, ...]
    image_size: tuple[int, int]
    state_dim: int
    fps: int
    action_space: ActionSpace

    @property
    def task_names(self) -> list[str]: ...

    def instruction(self, task: str) -> str:
        """The language instruction of ``task``; ``ValueError`` for a task not in the suite."""

    def max_steps(self, task: str) -> int:
        """Control-step limit of an episode of ``task`` (reaching it truncates)."""

    def num_init_states(self, task: str, split: str) -> int:
        """Number of stored init states of ``split`` (``"train"`` / ``"eval"``) for ``task``."""

    def init_state(self, task: str, split: str, index: int) -> Any:
        """Init state ``index`` of ``split`` (a copy; for the sim suite ``float64 (1 + nq + nv,)``)."""

    def eval_start(self, task: str, j: int) -> Start:
        """Start of evaluation episode ``j`` (eval init state ``j % num_init_states(task, "eval")``)."""

    def train_start(self, task: str, i: int) -> Start:
        """Start of training episode ``i`` (train init state ``i % num_init_states(task, "train")``)."""

    def make_env(self, num_envs: int, auto_reset: bool = True, next_start: Callable[[int], Start] | None = None,
                 device: Any = "cpu", cameras: Sequence[str] | None = None) -> ChunkEnv:
        """A ``ChunkEnv`` of ``num_envs`` slots with this suite's observation settings."""

    def make_expert(self, noise: float = 0.0) -> Any:
        """The suite's scripted experts as an evaluation actor (``wmrl.evaluation``'s actor protocol)."""

    def describe(self) -> dict:
        """JSON-able description for reports and store metadata."""


@runtime_checkable
class ObjectLocatingSuite(Protocol):
    """Capability: a suite that says where a start's task object is (the start-state perception a
    deployment gets from a pose estimator on its first frame), for the imagination's grasp box
    (``wmrl.imagination.ProprioLiftRule``). Implementation: ``sim.suite.Suite.object_position``."""

    def object_position(self, start: Start) -> Any:
        """``float64 (3,)`` (m, robot base frame), or ``None`` where the start does not say."""


@runtime_checkable
class GoalLocatingSuite(Protocol):
    """Capability: a suite that says where a start's goal object is (a placing task's base, e.g. the
    green cube of ``stack_red_on_green``), for the imagination's place box
    (``wmrl.imagination.ProprioLiftRule``). Implementation: ``sim.suite.Suite.goal_position``."""

    def goal_position(self, start: Start) -> Any:
        """``float64 (3,)`` (m, robot base frame), or ``None`` where the start or its task does not say."""


@runtime_checkable
class CountingEnv(Protocol):
    """Capability: a ``ChunkEnv`` that counts events a run's report should show (e.g. ``ImaginationEnv``:
    slots its uncertainty gate halted, closes its grasp box judged misses); ``wmrl post-train`` reports
    them (``report.json`` ``env_counters``)."""

    def counters(self) -> dict[str, int]:
        """``{name: count}`` since the env was built (a resumed run counts from its resume)."""


@runtime_checkable
class RandomStreams(Protocol):
    """Capability: an object that draws from generators of its own (e.g. ``ImaginationEnv``'s
    sampling generator) declares them, so a trainer's checkpoint saves and restores them
    (``wmrl.kernel.rng``) and a resumed run continues the uninterrupted one bit for bit."""

    def rng_streams(self) -> dict[str, Any]:
        """Name (no ``/``) -> ``torch.Generator`` or ``numpy.random.Generator``, the live objects."""
