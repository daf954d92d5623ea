"""The GRPO loop: one iteration (:func:`grpo_iteration`: collect -> mitigations -> advantages ->
update) and the training loop (:func:`train_grpo`) that repeats it, driven by a
:class:`LoopConfig` and :class:`GRPOHooks` (evaluation, debiasing, denoising, world-model refresh,
checkpointing; each with its own ``every``), with checkpoints and exact resume.

1. :func:`wmrl.rl.rollout.collect_groups`: ``G`` rollouts from every start, one action chunk per
   policy call, recording the SDE sampler's chain and its log-prob (``PolicySample``), per-slot
   ``alive`` masks and chunk rewards.
2. the mitigations of :mod:`wmrl.rl.debias` (both switchable, both reported).
3. :func:`wmrl.rl.losses.group_advantages`: group-relative advantages.
4. :func:`wmrl.rl.update.grpo_update`: PPO-style clipped epochs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from wmrl.kernel.checkpoint import (
    checkpoint_exists,
    load_checkpoint_meta,
    load_extra_tensors,
    optimizer_from_tensors,
    optimizer_to_tensors,
    save_checkpoint,
    verify_checkpoint,
)
from wmrl.kernel.interfaces import ChunkEnv, Policy
from wmrl.kernel.rng import capture_rng, restore_rng
from wmrl.kernel.types import Rollout, Start
from wmrl.rl.debias import OnlineDebiaser, inverse_variance_rewards, tasks_for
from wmrl.rl.distill import SuccessBuffer
from wmrl.rl.losses import describe, group_advantages
from wmrl.rl.rollout import (
    batched_starts,
    collect_groups,
    expand_starts,
    rollout_returns,
)
from wmrl.rl.update import GRPOConfig, build_transitions, grpo_update
from wmrl.rl.value import ValueBaseline, chunk_rewards, last_alive

log = logging.getLogger("wmrl.grpo")


@dataclass
class IterationResult:
    stats: dict[str, float] = field(default_factory=dict)
    rollouts: list[Rollout] = field(default_factory=list)


def grpo_iteration(env: ChunkEnv, policy: Policy, optimizer: torch.optim.Optimizer, starts: Sequence[Start],
                   cfg: GRPOConfig, ref_policy: Policy | None = None, generator: torch.Generator | None = None,
                   debiaser: OnlineDebiaser | None = None,
                   real_rollout_fn: Callable[[list[Start]], tuple[torch.Tensor, torch.Tensor]] | None = None,
                   debias_starts: int = 0, replay_envs: Sequence[ChunkEnv] = (),
                   progress: bool = False, value: ValueBaseline | None = None) -> IterationResult:
    """One GRPO iteration: collect ``G`` rollouts per start on ``env``, apply the optional
    world-model mitigations, compute group-relative advantages and run :func:`wmrl.rl.update.grpo_update`.

    Args:
        debiaser, real_rollout_fn, debias_starts: online debiasing. When all are given,
            ``real_rollout_fn(starts[:debias_starts])`` runs the current policy in the real sim from
            those starts and returns ``(rewards (M_r,), success (M_r,))`` in order of the starts
            given (any number of rollouts per start, same reward definition); the imagined rollouts
            of the same starts update the debiaser before it corrects this iteration's rewards.
        replay_envs: inverse-variance denoising (see :func:`wmrl.rl.debias.inverse_variance_rewards`).
        value: the chunk value of ``cfg.advantage == "gae"`` (:class:`wmrl.rl.value.ValueBaseline`):
            per-chunk GAE advantages of the chunk rewards (a mitigation's change of a rollout's
            reward lands on its last alive chunk), then the value's fit on the returns.

    Raises:
        ValueError: ``cfg.advantage == "gae"`` without ``value``.

    Returns diagnostics: ``reward_*``, ``success_rate`` (as the env reports it; ``success_rate/<task>``
    per task), ``adv_*``, ``valid_group_frac`` (``valid_groups/<task>``: the groups with mixed returns
    per task), ``n_transitions``, the mitigation statistics and the update statistics.
    """
    if isinstance(policy, torch.nn.Module):
        policy.eval()  # type: ignore[attr-defined]  # no dropout: ratio is exactly 1 at unchanged params
    rollouts = collect_groups(env, policy, starts, cfg.group_size, cfg.max_chunks, generator=generator, progress=progress)
    if cfg.advantage == "gae" and value is None:
        raise ValueError("GRPOConfig.advantage='gae' needs a value baseline (wmrl.rl.value.ValueBaseline)")
    rewards, success, gids = rollout_returns(rollouts, cfg.reward_mode, cfg.success_bonus)
    raw_rewards = rewards.clone()
    stats: dict[str, float] = {"success_rate": float(success.float().mean()), **describe(rewards, "reward")}
    tasks = [starts[int(g)].task_name for g in gids]
    of_task = {t: torch.tensor([x == t for x in tasks]) for t in sorted(set(tasks))}   # per task: whose groups carry signal
    for t, m in of_task.items():
        stats[f"success_rate/{t}"] = float(success[m].float().mean())
    weights = None
    if replay_envs:
        batches = batched_starts(expand_starts(starts, cfg.group_size)[0], env.num_envs)
        lookup = {id(ro): batches[j] for j, ro in enumerate(rollouts)}
        rewards, weights, st = inverse_variance_rewards(rollouts, replay_envs, lambda ro: lookup[id(ro)],
                                                        cfg.reward_mode, cfg.success_bonus, rewards)
        stats.update(st)
    if debiaser is not None:
        if real_rollout_fn is not None and debias_starts > 0:
            sub = list(starts[:debias_starts])
            real_r, real_s = real_rollout_fn(sub)
            m = gids < len(sub)
            stats.update(debiaser.update([tasks[i] for i in m.nonzero().flatten().tolist()], rewards[m], real_r.float(),
                                         imagined_success=success[m], real_success=real_s,
                                         real_tasks=tasks_for(sub, int(real_r.shape[0]))))
            stats["debias_real_success"] = float(real_s.float().mean())
            stats["debias_imagined_success"] = float(success[m].float().mean())
        rewards = debiaser.correct(tasks, rewards)
        stats.update(describe(rewards, "reward_debiased"))
    n_groups = len(torch.unique(gids))
    if cfg.advantage == "gae":
        crs = _shifted_chunk_rewards(rollouts, rewards - raw_rewards, cfg)
        chunk_adv, vst = value.advantages(policy, rollouts, crs)  # type: ignore[union-attr]
        stats.update(vst)
        valid = torch.ones_like(gids, dtype=torch.bool)
        stats["valid_group_frac"] = 1.0
        batch = build_transitions(rollouts, torch.zeros(gids.shape[0]), valid, weights, chunk_adv=chunk_adv)
        if batch is not None:
            stats.update(describe(batch.advantages, "adv"))
    else:
        adv, valid = group_advantages(rewards, gids, std_floor=cfg.std_floor, scale_by_std=cfg.scale_by_std)
        stats.update(describe(adv[valid], "adv"))
        stats["valid_group_frac"] = float(len(torch.unique(gids[valid]))) / max(n_groups, 1)
        for t, m in of_task.items():
            stats[f"valid_groups/{t}"] = float(len(torch.unique(gids[valid & m])))
        batch = build_transitions(rollouts, adv, valid, weights)
    anchor = None
    if cfg.anchor_coef > 0 and ref_policy is not None:   # the groups without signal: kept near the reference
        anchor = build_transitions(rollouts, torch.zeros(gids.shape[0]), ~valid)
        stats["n_anchor"] = float(0 if anchor is None else len(anchor))
    stats["n_transitions"] = float(0 if batch is None else len(batch))
    if batch is not None:
        stats.update(grpo_update(policy, optimizer, batch, cfg, ref_policy=ref_policy, generator=generator,
                                 anchor=anchor))
    return IterationResult(stats=stats, rollouts=rollouts)


def _shifted_chunk_rewards(rollouts: Sequence[Rollout], shift: torch.Tensor, cfg: GRPOConfig) -> list[torch.Tensor]:
    """Per rollout ``(B, N)`` chunk rewards (:func:`wmrl.rl.value.chunk_rewards`) with ``shift``
    ``(M,)`` (what debiasing / denoising changed of each real slot's reward) on its last alive chunk."""
    out, k = [], 0
    for ro in rollouts:
        cr = chunk_rewards(ro, cfg.reward_mode, cfg.success_bonus)
        real = (ro.group_ids >= 0).nonzero().flatten()
        last = last_alive(ro.alive)
        for j, i in enumerate(real.tolist()):
            if last[i] >= 0:
                cr[i, last[i]] += float(shift[k + j])
        k += real.numel()
        out.append(cr)
    return out


# --------------------------------------------------------------------------------------------
# The training loop: a config, hooks, checkpoints, resume
# --------------------------------------------------------------------------------------------


@dataclass
class GRPOSetup:
    """What :func:`train_grpo` trains: ``policy`` (a ``torch.nn.Module`` Policy, saved with its
    constructor config ``policy_config``) on ``env`` with ``optimizer``, from ``starts_fn(iteration)``
    (a start provider, :mod:`wmrl.rl.starts`), by the iteration hyper-parameters ``cfg``.

    ``ref_policy``: the frozen KL reference (``cfg.kl_coef > 0`` or ``cfg.anchor_coef > 0``). ``rng_streams``: the generators
    the environments and rollout functions draw from between iterations
    (``wmrl.kernel.interfaces.RandomStreams``; e.g. the imagination env's sampling generator), saved
    with every checkpoint and restored with the loop's own and the process-wide ones
    (``wmrl.kernel.rng``), so a resumed run is bitwise the uninterrupted one. ``writer``: an optional
    TensorBoard ``SummaryWriter``. ``value``: the chunk value of ``cfg.advantage == "gae"``
    (:class:`wmrl.rl.value.ValueBaseline`), saved and restored with the checkpoints."""

    policy: Policy
    policy_config: dict
    env: ChunkEnv
    optimizer: torch.optim.Optimizer
    starts_fn: Callable[[int], list[Start]]
    cfg: GRPOConfig
    ref_policy: Policy | None = None
    rng_streams: Mapping[str, Any] | None = None
    writer: Any = None
    value: ValueBaseline | None = None


@dataclass
class LoopConfig:
    """``iterations`` GRPO iterations; checkpoints in ``out_dir/checkpoints``; ``seed`` seeds the
    loop's generator (rollout sampling, minibatch order); ``resume`` continues from
    ``checkpoints/last``; ``progress`` shows a bar."""

    iterations: int
    out_dir: str | Path
    seed: int = 0
    resume: bool = True
    progress: bool = True


@dataclass
class EvalHook:
    """``fn(policy, n)`` (real-sim evaluation on held-out starts, returning at least ``{"success":
    float}``) runs before the first iteration, after every ``every``-th (0: never in between) and
    after the last one."""

    fn: Callable[[Policy, int], dict]
    every: int = 0


@dataclass
class DebiasHook:
    """Online debiasing (:class:`wmrl.rl.debias.OnlineDebiaser`): every ``every``-th iteration
    ``real_rollout_fn`` runs the first ``starts`` starts in the real sim and updates ``debiaser``;
    the correction applies to every iteration's rewards."""

    debiaser: OnlineDebiaser
    real_rollout_fn: Callable[[list[Start]], tuple[torch.Tensor, torch.Tensor]] | None = None
    starts: int = 0
    every: int = 1


@dataclass
class DenoiseHook:
    """Inverse-variance denoising over ``replay_envs`` (:func:`wmrl.rl.debias.inverse_variance_rewards`)
    on every ``every``-th iteration."""

    replay_envs: Sequence[ChunkEnv] = ()
    every: int = 1


@dataclass
class RefreshHook:
    """World model in the loop (e.g. :class:`wmrl.refresh.WorldModelRefresher`): ``fn(policy, n)``
    runs after iteration ``n`` whenever ``n % every == 0`` and ``n`` is not the last, before the
    checkpoint of ``n``; its returned scalars join that iteration's history entry. It must restore
    its own state on resume."""

    fn: Callable[[Policy, int], dict]
    every: int = 0


@dataclass
class DistillHook:
    """Filtered BC of gated successes into the flow (:class:`wmrl.rl.distill.Distiller`):
    ``fn(policy, rollouts, generator) -> stats`` runs on the rollouts of every ``every``-th
    iteration, after its update, with the loop's generator (so a resumed run repeats it)."""

    fn: Callable[..., dict]
    every: int = 0
    buffer: SuccessBuffer | None = None
    """``None``: ``fn`` sees the due iteration's rollouts only. A :class:`wmrl.rl.distill.SuccessBuffer`
    (the one ``fn`` trains on): every iteration's rollouts are added to it (``distill_buffer_added`` /
    ``distill_buffer_chunks`` in the history), and it is saved and restored with the checkpoints."""


@dataclass
class CheckpointHook:
    """``checkpoints/last`` (weights, optimizer, RNG states, history) is written after every
    iteration; a copy of the weights goes to ``checkpoints/step_<n>`` every ``every`` iterations
    (0: never)."""

    every: int = 1


@dataclass
class GRPOHooks:
    """The optional parts of the loop, each with its own ``every`` (``None``: off)."""

    evaluation: EvalHook | None = None
    debias: DebiasHook | None = None
    denoise: DenoiseHook | None = None
    refresh: RefreshHook | None = None
    distill: DistillHook | None = None
    checkpoint: CheckpointHook = field(default_factory=CheckpointHook)


def _due(every: int, n: int) -> bool:
    return every > 0 and n % every == 0


class _Run:
    """State of one :func:`train_grpo` call (history, evaluations, the loop's generator)."""

    def __init__(self, setup: GRPOSetup, loop: LoopConfig, hooks: GRPOHooks):
        self.s, self.loop, self.hooks = setup, loop, hooks
        self.ck_dir = Path(loop.out_dir) / "checkpoints"
        self.last = self.ck_dir / "last"
        self.gen = torch.Generator().manual_seed(loop.seed)
        self.history: list[dict] = []
        self.evals: list[dict] = []
        self.start_it = 0
        self.resumed_from: str | None = None

    @property
    def debiaser(self) -> OnlineDebiaser | None:
        return None if self.hooks.debias is None else self.hooks.debias.debiaser

    def resume(self) -> None:
        last = self.last
        if not (self.loop.resume and checkpoint_exists(last)):
            return
        from safetensors.torch import load_model

        verify_checkpoint(last)
        load_model(self.s.policy, str(last / "model.safetensors"))  # type: ignore[arg-type]
        meta = load_checkpoint_meta(last)
        extra = load_extra_tensors(last)
        optimizer_from_tensors(self.s.optimizer, extra, meta["optimizer"])
        self.gen.set_state(extra["rng/torch"])
        if "rng" in meta:
            missing = restore_rng(extra, meta["rng"], self.s.rng_streams)
            if missing:
                log.warning("%s has no saved state for the RNG stream(s) %s: they continue from their seeds", last, missing)
        else:
            log.warning("%s was written by an older wmrl without the environments' RNG states: the resumed run "
                        "is not bitwise the uninterrupted one", last)
        self.history, self.evals = meta["history"], meta["evals"]
        self.start_it = int(meta["iteration"])
        if self.debiaser is not None and "debiaser" in meta:
            self.debiaser.load_state_dict(meta["debiaser"])
        if self.s.value is not None:
            if "value" not in meta:
                raise ValueError(f"{last} was written without a value head (advantage=group); resume it with "
                                 "grpo.advantage=group or start a new run directory")
            self.s.value.load_state_tensors(extra, meta["value"])
        buf = self.hooks.distill.buffer if self.hooks.distill is not None else None
        if buf is not None:
            if "distill_buffer" not in meta:
                raise ValueError(f"{last} was written without a distillation buffer (distill.buffer=0); resume it "
                                 "with distill.buffer=0 or start a new run directory")
            buf.load_state_tensors(extra, meta["distill_buffer"])
        self.resumed_from = str(last)

    def evaluate(self, n: int) -> None:
        ev = self.hooks.evaluation
        if ev is None or any(e["iteration"] == n for e in self.evals):
            return
        e = dict(ev.fn(self.s.policy, n))
        e["iteration"] = n
        self.evals.append(e)
        if self.s.writer is not None and "success" in e:
            self.s.writer.add_scalar("eval/real_success", e["success"], n)

    def save(self, n: int) -> None:
        tensors, ometa = optimizer_to_tensors(self.s.optimizer)
        tensors["rng/torch"] = self.gen.get_state()
        rng_tensors, rng_meta = capture_rng(self.s.rng_streams)
        tensors.update(rng_tensors)
        meta = {"iteration": n, "history": self.history, "evals": self.evals, "optimizer": ometa, "rng": rng_meta}
        if self.debiaser is not None:
            meta["debiaser"] = self.debiaser.state_dict()
        if self.s.value is not None:
            vt, vm = self.s.value.state_tensors()
            tensors.update(vt)
            meta["value"] = vm
        buf = self.hooks.distill.buffer if self.hooks.distill is not None else None
        if buf is not None:
            bt, meta["distill_buffer"] = buf.state_tensors()
            tensors.update(bt)
        save_checkpoint(self.s.policy, self.last, self.s.policy_config, extra_tensors=tensors, meta=meta)  # type: ignore[arg-type]
        if _due(self.hooks.checkpoint.every, n):
            save_checkpoint(self.s.policy, self.ck_dir / f"step_{n}", self.s.policy_config)  # type: ignore[arg-type]

    def iteration(self, it: int) -> dict:
        """Iteration ``it`` (0-based) with the hooks due at it; returns its history entry."""
        s, h = self.s, self.hooks
        deb, den = h.debias, h.denoise
        do_debias = deb is not None and deb.real_rollout_fn is not None and _due(deb.every, it)
        replay_envs = den.replay_envs if den is not None and _due(den.every, it) else ()
        t0 = time.time()
        res = grpo_iteration(s.env, s.policy, s.optimizer, s.starts_fn(it), s.cfg, ref_policy=s.ref_policy,
                             generator=self.gen, debiaser=self.debiaser,
                             real_rollout_fn=deb.real_rollout_fn if do_debias else None,  # type: ignore[union-attr]
                             debias_starts=deb.starts if deb is not None else 0, replay_envs=replay_envs,
                             value=s.value)
        st = {"iteration": it + 1, **res.stats}
        if h.distill is not None and h.distill.buffer is not None:
            st["distill_buffer_added"] = float(h.distill.buffer.add(res.rollouts))
            st["distill_buffer_chunks"] = float(len(h.distill.buffer))
        if h.distill is not None and _due(h.distill.every, it + 1):
            st.update(h.distill.fn(s.policy, res.rollouts, self.gen))
        st["wall_s"] = time.time() - t0
        self.history.append(st)
        if s.writer is not None:
            for k, v in st.items():
                if k != "iteration":
                    s.writer.add_scalar(f"grpo/{k}", v, it + 1)
        return st

    def refresh(self, n: int, st: dict) -> None:
        rf = self.hooks.refresh
        if rf is None or not _due(rf.every, n) or n >= self.loop.iterations:
            return
        st.update(rf.fn(self.s.policy, n))
        if self.s.writer is not None:
            for k, v in st.items():
                if k.startswith("refresh/"):
                    self.s.writer.add_scalar(k, v, n)


def train_grpo(setup: GRPOSetup, loop: LoopConfig, hooks: GRPOHooks | None = None) -> dict:
    """GRPO post-training: ``loop.iterations`` times :func:`grpo_iteration` on
    ``setup.starts_fn(iteration)``, with the ``hooks`` due at each iteration.

    Per iteration ``n`` (1-based): the iteration (with debiasing / denoising when due), the
    world-model refresh when due, the evaluation when due (and after the last iteration), then the
    checkpoint ``out_dir/checkpoints/last`` (policy weights, optimizer state and RNG state in
    safetensors, history in ``meta.json``) and, when due, ``step_<n>``. The evaluation also runs
    before the first iteration. With ``loop.resume`` the loop continues from ``last`` and reproduces
    the run that was not interrupted.

    Returns ``{"history": [per-iteration stats], "evals": [{"iteration", ...}], "iterations",
    "checkpoint", "resumed_from"}``.
    """
    run = _Run(setup, loop, hooks or GRPOHooks())
    run.resume()
    n_it = int(loop.iterations)
    if run.start_it == 0:   # a resumed run has the evaluations of its iterations in the checkpoint
        run.evaluate(0)
    its = range(run.start_it, n_it)
    if loop.progress:
        from tqdm import tqdm

        its = tqdm(its, desc="GRPO", initial=run.start_it, total=n_it)
    ev_every = run.hooks.evaluation.every if run.hooks.evaluation is not None else 0
    for it in its:
        st = run.iteration(it)
        if loop.progress:
            its.set_postfix(reward=f"{st['reward_mean']:.3f}", succ=f"{st['success_rate']:.2f}")  # type: ignore[union-attr]
        run.refresh(it + 1, st)
        if _due(ev_every, it + 1) or it + 1 == n_it:
            run.evaluate(it + 1)
        run.save(it + 1)
    if run.start_it >= n_it and not (run.last / "model.safetensors").is_file():
        run.save(run.start_it)
    return {"history": run.history, "evals": run.evals, "iterations": n_it, "checkpoint": str(run.last),
            "resumed_from": run.resumed_from}
