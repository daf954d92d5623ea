"""The one batched rollout engine: chunk-level rollouts on any ChunkEnv, with a step recorder.

:func:`rollout_batch` runs one batch of ``env.num_envs`` slots from their starts, one action chunk
per call of the policy (or of an ``actions_fn``: open-loop replay, chunks split into control steps)
and hands every executed step to an optional :class:`StepRecorder`. Everything that rolls a policy
or a fixed action sequence out in batches is built on it:

* :func:`collect_groups`: GRPO's ``G`` rollouts from every start;
* :func:`replay_open_loop`: fixed action chunks per slot (inverse-variance denoising, fidelity);
* :func:`record_episodes`: whole episodes with every control step (the refresher's and the
  pipeline's real-sim rollouts), through :class:`EpisodeRecorder`.

A last, partial batch is filled by :func:`pad_slots` (repeats of its last item; padding slots get
group id ``-1`` and are never alive). Shape legend: :mod:`wmrl.kernel.types`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, TypeVar

import numpy as np
import torch

from wmrl.kernel.interfaces import ChunkEnv, Policy, SimStateEnv
from wmrl.kernel.types import Episode, Obs, PolicySample, Rollout, Start, StepResult

T = TypeVar("T")


def pad_slots(items: Sequence[T], b: int) -> list[T]:
    """``items`` (``1 <= len <= b``) followed by repeats of its last item up to length ``b``."""
    items = list(items)
    return items + [items[-1]] * (b - len(items))


def slot_ids(n: int, b: int, first: int = 0) -> torch.Tensor:
    """``int64 (b,)``: ids ``first .. first+n-1`` of ``n`` real slots, then ``-1`` for the padding."""
    return torch.cat([torch.arange(first, first + n), torch.full((b - n,), -1, dtype=torch.long)])


def _batches(n: int, b: int, progress: bool, desc: str) -> Iterable[int]:
    rng: Iterable[int] = range(0, n, b)
    if progress:
        from tqdm import tqdm

        rng = tqdm(rng, desc=desc, leave=False)
    return rng


class StepRecorder(Protocol):
    """Sees every executed chunk of :func:`rollout_batch`: ``before_step`` with the observation, the
    sample about to be executed and the ``alive (B,)`` mask; ``after_step`` with the env's result."""

    def before_step(self, env: ChunkEnv, obs: Obs, sample: PolicySample, alive: torch.Tensor) -> None: ...

    def after_step(self, env: ChunkEnv, res: StepResult, alive: torch.Tensor) -> None: ...


def cat_samples(items: Sequence[PolicySample]) -> PolicySample:
    """Concatenate ``PolicySample`` batches along ``B``."""
    keys = items[0].extras.keys()
    return PolicySample(torch.cat([s.actions for s in items]), torch.cat([s.log_prob for s in items]),
                        {k: torch.cat([s.extras[k] for s in items]) for k in keys})


def expand_starts(starts: Sequence[Start], group_size: int) -> tuple[list[Start], torch.Tensor]:
    """Repeat every start ``G`` times (consecutively). Returns the starts and ``int64 (len*G,)`` group ids."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    out = [s for s in starts for _ in range(group_size)]
    return out, torch.arange(len(starts)).repeat_interleave(group_size)


def batched_starts(starts: Sequence[Start], b: int) -> list[list[Start]]:
    """``starts`` cut into batches of ``b`` slots, the last one padded (:func:`pad_slots`)."""
    return [pad_slots(starts[i:i + b], b) for i in range(0, len(starts), b)]


@torch.no_grad()
def rollout_batch(env: ChunkEnv, policy: Policy | None, starts: Sequence[Start], group_ids: torch.Tensor,
                  max_chunks: int, generator: torch.Generator | None = None,
                  actions_fn: Callable[[int, Obs], PolicySample] | None = None,
                  chunk_limits: torch.Tensor | None = None, recorder: StepRecorder | None = None,
                  branch: torch.Tensor | None = None) -> Rollout:
    """One batch of chunk-level rollouts, ``len(starts) == env.num_envs``.

    A slot is alive from the reset until (and including) the chunk in which it terminates or is
    truncated; later chunks (after the env's auto-reset) are masked out. Stops when no slot is
    alive or after ``max_chunks`` chunks (then the slot counts as unsuccessful unless it succeeded).

    Args:
        env: any ChunkEnv with ``num_envs == len(starts)``.
        policy: samples ``PolicySample`` (actions ``(B, H, D_a)``, log_prob ``(B,)``, extras).
        group_ids: ``int64 (B,)``; ``-1`` marks padding slots (never alive).
        actions_fn: optional ``(n, obs) -> PolicySample`` replacing the policy (open-loop replay).
        chunk_limits: optional ``int64 (B,)``: slot ``b`` stops after ``chunk_limits[b]`` chunks even
            if its episode goes on (replaying recorded rollouts of different lengths).
        recorder: optional :class:`StepRecorder` called around every ``env.step``.
        branch: optional ``bool (B,)``: slots of branch starts; ``Rollout.cut`` marks those whose
            episode was still going when they stopped.

    Returns:
        ``Rollout`` with ``rewards (B, N)``, ``alive (B, N)``, ``success (B,)``, ``group_ids (B,)``,
        ``final_obs`` and ``cut``.
    """
    if len(starts) != env.num_envs:
        raise ValueError(f"rollout_batch needs len(starts) == env.num_envs ({len(starts)} != {env.num_envs})")
    b = len(starts)
    obs = env.reset(list(starts))
    alive = group_ids >= 0
    running = alive.clone()  # in its episode (not ended by the env), whatever the chunk caps
    success = torch.zeros(b, dtype=torch.bool)
    obs_list, samples, rewards, alive_list = [], [], [], []
    for n in range(max_chunks):
        if chunk_limits is not None:
            alive &= chunk_limits > n
        if not alive.any():
            break
        sample = actions_fn(n, obs) if actions_fn is not None else policy.sample(obs, generator=generator)  # type: ignore[union-attr]
        if sample.actions.shape[0] != b:
            raise ValueError(f"policy returned {sample.actions.shape[0]} chunks for a batch of {b}")
        if recorder is not None:
            recorder.before_step(env, obs, sample, alive)
        res = env.step(sample.actions)
        if recorder is not None:
            recorder.after_step(env, res, alive)
        r = torch.as_tensor(res.reward, dtype=torch.float32).reshape(b)
        obs_list.append(obs)
        samples.append(PolicySample(sample.actions.detach(), sample.log_prob.detach().float(),
                                    {k: v.detach() for k, v in sample.extras.items()}))
        alive_list.append(alive.clone())
        rewards.append(torch.where(alive, r, torch.zeros_like(r)))
        success |= alive & torch.as_tensor(res.success, dtype=torch.bool).reshape(b)
        done = torch.as_tensor(res.done, dtype=torch.bool).reshape(b)
        running = running & ~(alive & done)
        alive = alive & ~done
        obs = res.obs
    if not rewards:
        raise ValueError("no chunk was executed: max_chunks must be >= 1 and at least one slot must be real")
    alive_t = torch.stack(alive_list, 1)
    ran = alive_t.any(1)
    cut = running & ran & ~success & (branch.bool() if branch is not None else torch.zeros(b, dtype=torch.bool))
    return Rollout(obs=obs_list, samples=samples, rewards=torch.stack(rewards, 1), alive=alive_t,
                   success=success, group_ids=group_ids.clone(), final_obs=obs, cut=cut)


def collect_groups(env: ChunkEnv, policy: Policy, starts: Sequence[Start], group_size: int, max_chunks: int,
                   generator: torch.Generator | None = None, progress: bool = False,
                   recorder: StepRecorder | None = None) -> list[Rollout]:
    """``G`` rollouts from every start, in batches of ``env.num_envs`` (the last batch is padded
    with inactive slots of group id ``-1``). Group ``i`` is ``starts[i]``. A branch start
    (``Start.max_chunks``) stops after its own chunk count.

    Returns: list of ``Rollout`` batches (their ``group_ids`` are global)."""
    all_starts, ids = expand_starts(starts, group_size)
    b = env.num_envs
    out = []
    for i in _batches(len(all_starts), b, progress, "rollouts"):
        st, gi = all_starts[i:i + b], ids[i:i + b]
        gi = torch.cat([gi, torch.full((b - len(st),), -1, dtype=torch.long)]) if len(st) < b else gi
        padded = pad_slots(st, b)
        branch = torch.tensor([s.max_chunks is not None for s in padded])
        limits = torch.tensor([min(int(s.max_chunks), max_chunks) if s.max_chunks is not None else max_chunks
                               for s in padded]) if branch.any() else None
        out.append(rollout_batch(env, policy, padded, gi, max_chunks, generator=generator, chunk_limits=limits,
                                 branch=branch, recorder=recorder))
    return out


def replay_open_loop(env: ChunkEnv, starts: Sequence[Start], group_ids: torch.Tensor, chunks: torch.Tensor,
                     lengths: torch.Tensor, recorder: StepRecorder | None = None) -> Rollout:
    """Execute fixed action chunks open loop: slot ``b`` runs ``chunks[b, n]`` at chunk ``n`` for its
    first ``lengths[b]`` chunks (or until its episode ends).

    Args: ``chunks`` ``(B, N, H, D_a)``; ``lengths`` ``int64 (B,)``, ``<= N``; ``group_ids`` as in
    :func:`rollout_batch`. Returns the replay's ``Rollout``."""
    log_prob = torch.zeros(chunks.shape[0])

    def fn(n: int, obs: Obs) -> PolicySample:
        return PolicySample(chunks[:, n], log_prob)

    return rollout_batch(env, None, starts, group_ids, int(lengths.max()), actions_fn=fn, chunk_limits=lengths,
                         recorder=recorder)


def rollout_returns(rollouts: Sequence[Rollout], reward_mode: str = "return", success_bonus: float = 1.0
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-rollout scalar rewards of real slots.

    Args:
        reward_mode: ``"return"`` (sum of chunk rewards), ``"success"`` (1 / 0), or
            ``"return+success"`` (return plus ``success_bonus`` on success).

    Returns: ``(rewards float32 (M,), success bool (M,), group_ids int64 (M,))`` over real slots,
    in the order of ``rollouts``."""
    if reward_mode not in ("return", "success", "return+success"):
        raise ValueError(f"reward_mode must be 'return', 'success' or 'return+success', got {reward_mode!r}")
    rs, ss, gs = [], [], []
    for ro in rollouts:
        real = ro.group_ids >= 0
        ret = (ro.rewards * ro.alive).sum(1)
        suc = ro.success.float()
        r = {"return": ret, "success": suc, "return+success": ret + success_bonus * suc}[reward_mode]
        rs.append(r[real]); ss.append(ro.success[real]); gs.append(ro.group_ids[real])
    return torch.cat(rs).float(), torch.cat(ss), torch.cat(gs)


# ------------------------------------------------------------------ whole episodes, every control step


class ChunkSteps:
    """An ``actions_fn`` that samples a chunk ``(B, H, D_a)`` from ``policy`` and hands it out one
    control step ``(B, 1, D_a)`` per call, sampling the next chunk when the last one is used up."""

    def __init__(self, policy: Policy, generator: torch.Generator | None = None):
        self.policy, self.generator = policy, generator
        self.chunk: torch.Tensor | None = None
        self.h = 0

    def __call__(self, n: int, obs: Obs) -> PolicySample:
        if self.chunk is None or self.h >= self.chunk.shape[1]:
            self.chunk, self.h = self.policy.sample(obs, generator=self.generator).actions, 0
        a = self.chunk[:, self.h:self.h + 1]
        self.h += 1
        return PolicySample(a, torch.zeros(a.shape[0]))


class EpisodeRecorder:
    """:class:`StepRecorder` keeping, for the first ``n`` slots while alive, every step's images,
    proprio, action (the step's ``(D_a,)``), reward and (when the env has ``sim_state(slot)``) MuJoCo
    state, as numpy arrays."""

    def __init__(self, n: int):
        self.n = int(n)
        self.buf: list[dict] | None = None

    def before_step(self, env, obs: Obs, sample: PolicySample, alive: torch.Tensor) -> None:
        if self.buf is None:
            self.buf = [{"images": {k: [] for k in obs.images}, "proprio": [], "actions": [], "rewards": [],
                         "states": []} for _ in range(self.n)]
        has_state = isinstance(env, SimStateEnv)
        for j in alive[:self.n].nonzero().flatten().tolist():
            d = self.buf[j]
            for k, v in obs.images.items():
                d["images"][k].append(v[j].cpu().numpy())
            d["proprio"].append(obs.proprio[j].cpu().numpy())
            d["actions"].append(sample.actions[j, 0].cpu().numpy())
            if has_state:
                d["states"].append(np.asarray(env.sim_state(int(j))))

    def after_step(self, env, res: StepResult, alive: torch.Tensor) -> None:
        for j in alive[:self.n].nonzero().flatten().tolist():
            self.buf[j]["rewards"].append(float(res.reward[j]))  # type: ignore[index]

    def episode(self, j: int, start: Start, success: bool, source: str) -> Episode:
        d = self.buf[j]  # type: ignore[index]
        return Episode(
            images={k: np.stack(v).astype(np.uint8) for k, v in d["images"].items()},
            proprio=np.stack(d["proprio"]).astype(np.float32), actions=np.stack(d["actions"]).astype(np.float32),
            rewards=np.asarray(d["rewards"], np.float32), success=bool(success), instruction=start.instruction,
            task_name=start.task_name, sim_states=np.stack(d["states"]) if d["states"] else None,
            info={"source": source, "init_index": start.init_index, "split": start.split})


@torch.no_grad()
def record_episodes(env, policy, starts: list[Start], max_steps: int, generator: torch.Generator | None = None,
                    source: str = "policy_rollout", progress: bool = False, desc: str = "rollouts") -> list[Episode]:
    """Run ``policy`` from every start once and return the whole episodes (every control step).

    Each sampled chunk ``(B, H, D_a)`` is executed one step at a time (``env.step`` with ``H = 1``,
    :class:`ChunkSteps`) so that every step's observation is recorded (:class:`EpisodeRecorder`),
    exactly as a scripted demo is. An episode ends at termination, truncation or ``max_steps``.
    ``env`` must not auto-reset in a way that hides the boundary (``StepResult.done`` marks it).
    Returns ``Episode`` objects (``sim_states`` when the env exposes ``sim_state(slot)``), in the
    order of ``starts``.
    """
    b = env.num_envs
    out: list[Episode] = []
    for i in _batches(len(starts), b, progress, desc):
        real = list(starts[i:i + b])
        rec = EpisodeRecorder(len(real))
        ro = rollout_batch(env, None, pad_slots(real, b), slot_ids(len(real), b), int(max_steps),
                           actions_fn=ChunkSteps(policy, generator), recorder=rec)
        out.extend(rec.episode(j, s, bool(ro.success[j]), source) for j, s in enumerate(real))
    return out
