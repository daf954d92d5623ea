"""The five role protocols. Implementations live in the component packages and are put together
only in ``wmrl/run/`` (the composition roots). Contract tests: ``tests/test_contracts.py``.

See ``wmrl.kernel.types`` for the shape legend and units.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from wmrl.kernel.types import Obs, PolicySample, Start, StepResult


@runtime_checkable
class Policy(Protocol):
    """A chunking policy. Source of the interface: DESIGN.md, Flow-GRPO (Liu et al. 2025)."""

    chunk_size: int  # H
    action_dim: int  # D_a
    # real-time chunking: True when ``sample`` also takes ``prefix=`` (committed actions
    # ``float32 (P, D_a)``, controller units) and ``delay=`` (int, prefix actions frozen) and
    # returns a chunk that continues the prefix (e.g. ``policies.rtc``, Black et al. 2025)
    supports_rtc: bool

    def sample(self, obs: Obs, generator: torch.Generator | None = None) -> PolicySample:
        """Sample an action chunk ``(B, H, D_a)`` for ``obs`` (batch ``B``)."""

    def log_prob(self, obs: Obs, sample: PolicySample, per_step: bool = False) -> torch.Tensor:
        """Differentiable ``float32 (B,)`` log-probability of ``sample`` under the current params;
        ``per_step=True``: per step of the sampling chain, ``float32 (B, K)`` (``K = 1`` for a
        policy that samples in one step)."""


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

    def step(self, actions: torch.Tensor) -> StepResult:
        """Execute ``actions`` ``float32 (B, H, D_a)``; raise ``ValueError`` on a wrong shape."""


@runtime_checkable
class WorldModel(Protocol):
    """Action-conditioned video world model with an explicit state (DreamerV3's vocabulary)."""

    def init(self, context: Obs) -> Any:
        """Build the model state from context frames ``Obs`` (batch ``B``)."""

    def imagine(self, state: Any, actions: torch.Tensor, generator: torch.Generator | None = None) -> tuple[Any, Obs]:
        """Predict the observation after executing ``actions`` ``(B, H, D_a)`` from ``state``."""


@runtime_checkable
class ProgressCritic(Protocol):
    """Progress-value critic (RISE's progress value model)."""

    def progress(self, obs: Obs) -> torch.Tensor:
        """``float32 (B,)`` task progress in [0, 1]."""

    def success_prob(self, obs: Obs) -> torch.Tensor:
        """``float32 (B,)`` probability that the task is achieved in ``obs``."""


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
class RandomStreams(Protocol):
    """Capability: an object that draws from generators of its own (e.g. ``ImaginationEnv``'s
    sampling generator) declares them, so a trainer's checkpoint saves and restores them
    (``wmrl.kernel.rng``) and a resumed run continues the uninterrupted one bit for bit."""

    def rng_streams(self) -> dict[str, Any]:
        """Name (no ``/``) -> ``torch.Generator`` or ``numpy.random.Generator``, the live objects."""
