"""Action queue keyed by control step, with latency-aware merging of overlapping chunks.

A chunk computed from the observation of step ``s`` holds actions for steps ``s .. s+H-1``. By the
time it arrives the robot is already at step ``k > s``: the actions for steps ``< k`` would be
stale. :class:`ActionQueue` with ``merge="latency_aware"`` drops them and lets the new chunk
overwrite the queued actions from step ``k`` on (the newest observation wins for the future); this
is the execution rule of Black et al. 2025, "Real-Time Execution of Action Chunking Flow
Policies" (RTC). ``merge="naive"`` is the baseline that switches to the new chunk from its first
action as if no time had passed (what synchronous chunk execution does when made asynchronous);
it exists for the benchmark.

With more than one request in flight (``robot_bridge.timing``) chunks may overlap and, with
jitter, arrive out of order: the latency-aware merge writes a step only when the arriving chunk
was computed from an observation no older than the one the queued action came from (its
``start_step``), so the newest observation wins whatever the order of arrival.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Literal

import numpy as np


class StepOverlay:
    """Actions by control step from overlapping chunks, the newest observation winning per step: a
    chunk computed for ``start_step`` writes step ``s`` unless it holds an action of a chunk with a
    later ``start_step``. Not thread-safe (:class:`ActionQueue` locks around it); also the
    server's record of what a session planned (``robot_bridge.plan``)."""

    def __init__(self):
        self.actions: dict[int, np.ndarray] = {}  # step -> action float32 (D_a,)
        self.src: dict[int, int] = {}             # step -> id of the chunk it came from
        self.origin: dict[int, int] = {}          # step -> start_step of the chunk it came from

    def put(self, chunk: np.ndarray, start_step: int, first: int = 0, src: int = -1) -> tuple[int, int]:
        """Write ``chunk[first:]`` (rows for steps ``start_step + first ..``) where it is the newest;
        returns ``(replaced, superseded)``: queued actions it overwrote, rows not written."""
        replaced = superseded = 0
        for i in range(first, len(chunk)):
            s = start_step + i
            if self.origin.get(s, start_step) > start_step:
                superseded += 1
                continue
            replaced += s in self.actions
            self.actions[s], self.src[s], self.origin[s] = chunk[i], src, start_step
        return replaced, superseded

    def drop_before(self, step: int) -> None:
        for s in [s for s in self.actions if s < step]:
            del self.actions[s], self.src[s], self.origin[s]

    def contiguous(self, step: int, n: int | None = None) -> list[np.ndarray]:
        """The actions of steps ``step, step+1, ...`` up to the first gap (at most ``n``)."""
        out = []
        while step + len(out) in self.actions and (n is None or len(out) < n):
            out.append(self.actions[step + len(out)])
        return out

    def clear(self) -> None:
        self.actions.clear()
        self.src.clear()
        self.origin.clear()


@dataclass
class MergeResult:
    """What :meth:`ActionQueue.insert` did. ``skipped``: stale actions dropped (steps already
    executed); ``inserted``: actions now queued from the chunk; ``replaced``: queued actions it
    overwrote; ``superseded``: actions not written because the step holds one of a newer chunk;
    ``chunk_id``: id given to the chunk (returned with its actions by ``pop``)."""

    skipped: int
    inserted: int
    replaced: int
    chunk_id: int = -1
    superseded: int = 0


class ActionQueue:
    """Thread-safe map ``control step -> action float32 (D_a,)``.

    Args:
        action_dim: ``D_a``; chunks of another width raise ``ValueError``.
        merge: ``"latency_aware"`` or ``"naive"`` (see module docstring).
    """

    def __init__(self, action_dim: int, merge: Literal["latency_aware", "naive"] = "latency_aware"):
        if merge not in ("latency_aware", "naive"):
            raise ValueError(f"merge must be 'latency_aware' or 'naive', got {merge!r}")
        self.action_dim = int(action_dim)
        self.merge = merge
        self._steps = StepOverlay()
        self._lock = threading.Lock()
        self._next_chunk_id = 0

    def insert(self, chunk: np.ndarray, start_step: int, next_step: int) -> MergeResult:
        """Merge ``chunk`` ``float32 (H, D_a)`` computed for ``start_step`` while the robot's next
        step to execute is ``next_step``.

        Raises:
            ValueError: wrong shape.
        """
        chunk = np.asarray(chunk, dtype=np.float32)
        if chunk.ndim != 2 or chunk.shape[1] != self.action_dim:
            raise ValueError(f"chunk must be (H, D_a={self.action_dim}), got {chunk.shape}")
        with self._lock:
            cid = self._next_chunk_id
            self._next_chunk_id += 1
            self._steps.drop_before(next_step)
            if self.merge == "naive":
                replaced = len(self._steps.actions)
                self._steps.clear()
                self._steps.put(chunk, next_step, src=cid)  # from its first action, as if no time had passed
                return MergeResult(skipped=0, inserted=chunk.shape[0], replaced=replaced, chunk_id=cid)
            skipped = max(0, min(chunk.shape[0], next_step - start_step))
            replaced, superseded = self._steps.put(chunk, start_step, first=skipped, src=cid)
            return MergeResult(skipped=skipped, inserted=chunk.shape[0] - skipped - superseded, replaced=replaced,
                               chunk_id=cid, superseded=superseded)

    def pop(self, step: int) -> tuple[np.ndarray | None, int]:
        """Remove and return ``(action for step, chunk id)``, or ``(None, -1)`` if none is queued
        (the robot must hold). Entries for earlier steps are discarded."""
        with self._lock:
            st = self._steps
            st.drop_before(step)
            a = st.actions.pop(step, None)
            cid = st.src.pop(step, -1)
            st.origin.pop(step, None)
            return a, cid

    def size(self, step: int) -> int:
        """Number of contiguous queued actions from ``step`` on."""
        with self._lock:
            return len(self._steps.contiguous(step))

    def committed(self, step: int, n: int | None = None) -> np.ndarray:
        """The queued actions for steps ``step, step+1, ...`` (contiguous, at most ``n``):
        ``float32 (P, D_a)``, ``P`` possibly 0. Sent as the real-time-chunking prefix."""
        with self._lock:
            out = self._steps.contiguous(step, n)
            return np.stack(out) if out else np.zeros((0, self.action_dim), np.float32)

    def clear(self) -> None:
        with self._lock:
            self._steps.clear()
