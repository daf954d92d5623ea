"""The GRPO post-training job behind ``wmrl post-train`` and ``wmrl bench grpo`` (a non-entry module of
``wmrl.run``, so both entry points can run it without importing each other).

:func:`run` builds the suite (``cfg.suite``), the GRPO ChunkEnv (:func:`wmrl.run.builders.build_env`:
the suite's ``SimEnv``, an ``ImaginationEnv`` from world-model and critic checkpoints, or any
``env.chunk_env`` ``_target_``), the policy (checkpoint + the RL sampler ``cfg.rl_sampler``), the start
providers (:mod:`wmrl.rl.starts`) and the hooks of :func:`wmrl.rl.loop.train_grpo`: real-sim
evaluation (:func:`wmrl.run.builders.evaluate_real`), the world-model reward mitigations
(``cfg.mitigations``: ``debias``, online debiasing from a few real-sim rollouts, needs a suite or
``cfg.mitigations.debias.env``; ``denoise``, inverse-variance weighting over ``samples`` extra imagined
replays with other seeds), the world-model refresh (``cfg.refresh``) and checkpoints.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from wmrl.kernel.interfaces import CountingEnv, RandomStreams, SamplerPolicy
from wmrl.rl import loop
from wmrl.rl.debias import OnlineDebiaser, real_rollout_fn_for
from wmrl.rl.starts import ContextStarts, InitStateStarts, KeyframeStarts, MixedStarts
from wmrl.rl.update import GRPOConfig, check_policy, make_reference
from wmrl.run.builders import (
    build_env,
    evaluate_real,
    load_policy,
    make_sim_env,
    precision_report,
    rl_policy,
    task_instructions,
    train_n_init,
    trainable_parameters,
    using_sampler,
)
from wmrl.run.common import RunContext

log = logging.getLogger("wmrl.post_train")


def _maybe(cfg: DictConfig | None, key: str, default=None):
    return default if cfg is None else cfg.get(key, default)


def _maybe_refresher(cfg: DictConfig, ctx: RunContext, env, suite, tasks: dict, n_init: int, replay_envs):
    """The world-model-in-the-loop refresher (``cfg.refresh``, :class:`wmrl.refresh.WorldModelRefresher`)
    or ``None`` when ``refresh.every`` is 0. On resume it reloads its last completed round."""
    rc = cfg.get("refresh")
    if rc is None or int(rc.get("every", 0) or 0) <= 0:
        return None
    if not cfg.env.get("world_model") or not cfg.env.get("critic"):
        raise ValueError("refresh.every > 0 refines the world model: it needs env=imagination "
                         "(env.world_model and env.critic checkpoints)")
    if int(cfg.env.get("replicas", 1) or 1) > 1:
        raise ValueError("refresh.every > 0 fine-tunes the learner's world model, which replicas do not share: "
                         "use env.replicas=1 with refresh, or refresh.every=0 with replicas")
    if suite is None:
        raise ValueError("refresh.every > 0 needs a suite (the real sim the policy is rolled out in)")
    if rc.get("store") in (None, "", "???"):
        raise ValueError("refresh.every > 0 needs refresh.store=PATH: the world model's training EpisodeStore "
                         "(replay data against forgetting)")
    from wmrl.kernel.checkpoint import read_checkpoint_config
    from wmrl.refresh import RefreshConfig, WorldModelRefresher
    from worldmodels.train import RefreshFineTunes

    wm, cr = rc.worldmodel, rc.critic
    r = WorldModelRefresher(
        env, make_sim_env(int(rc.num_envs), suite=suite), tasks, ctx.out_dir / "refresh", ctx.path(rc.store),
        read_checkpoint_config(ctx.path(cfg.env.world_model)), read_checkpoint_config(ctx.path(cfg.env.critic)),
        RefreshFineTunes(), RefreshConfig(
            n_init=n_init, episodes_per_task=int(rc.episodes_per_task), max_steps=int(rc.max_steps),
            replay_episodes=int(rc.replay_episodes), heldout_every=int(rc.heldout_every),
            wm_seconds=float(wm.seconds), wm_lr=float(wm.lr), wm_batch_size=int(wm.batch_size),
            wm_p_deterministic=float(wm.p_deterministic), critic_seconds=float(cr.seconds), critic_lr=float(cr.lr),
            critic_batch_size=int(cr.batch_size), imagined_fraction=float(cr.imagined_fraction),
            bank_size=int(cr.bank_size), bank_chunks=int(cr.bank_chunks), seed=int(cfg.seed),
            progress=bool(cfg.get("progress", True))),
        also_update=replay_envs)
    if bool(cfg.resume) and r.restore() is not None:
        log.info("world-model refresh: resumed with the world model and critic of round %d", r.restored)
    return r


def _policy(cfg: DictConfig, policy_path):
    """The policy GRPO trains (its RL sampler set), its checkpoint config, the evaluation sampler."""
    policy, policy_cfg = load_policy(policy_path, cfg.device)
    policy, policy_cfg, rl_sampler = rl_policy(policy, policy_cfg, cfg, str(cfg.device))
    eval_sampler = instantiate(cfg.eval_sampler) if cfg.get("eval_sampler") else None
    if eval_sampler is None and isinstance(policy, SamplerPolicy):
        eval_sampler = policy.sampler  # the checkpoint's own (deterministic) sampler
    if rl_sampler is not None and isinstance(policy, SamplerPolicy):
        policy.sampler = rl_sampler
    return policy, policy_cfg, eval_sampler


def _starts(cfg: DictConfig, ctx: RunContext, suite, tasks: dict, n_init: int):
    """GRPO's start provider: train init states, in imagination with their real first frames
    (``ContextStarts``) and optionally mixed with keyframes of ``starts.store``."""
    keyframes = int(cfg.starts.get("keyframes_per_task") or 0) if cfg.starts.get("store") else 0
    first_steps = cfg.starts.get("first_steps")
    branch = cfg.starts.get("branch_chunks")
    if branch is not None and str(cfg.grpo.get("advantage", "group")) != "gae":
        raise ValueError("starts.branch_chunks (short branches from keyframes) needs grpo.advantage=gae: the chunk "
                         "value bootstraps what a branch leaves out, group advantages would score it as a failure")

    def keyframe_starts():
        return KeyframeStarts(ctx.path(cfg.starts.store), tasks, keyframes, seed=int(cfg.seed), first_steps=first_steps,
                              branch_chunks=branch, success_fraction=cfg.starts.get("success_fraction"))

    if int(cfg.starts.per_task) == 0:   # keyframes of the store only: no sim is needed for the starts (LIBERO)
        if keyframes <= 0:
            raise ValueError("starts.per_task=0 needs keyframe starts: starts.store and starts.keyframes_per_task > 0")
        return keyframe_starts()
    starts_fn = InitStateStarts(tasks, n_init=n_init, per_task=cfg.starts.per_task, split="train", seed=cfg.seed)
    if bool(cfg.env.get("context_starts", False)):   # e.g. an imagination env: real first frames
        ctx_env = instantiate(cfg.env.context_env) if cfg.env.get("context_env") else \
            make_sim_env(int(cfg.env.get("context_num_envs", 4)), suite=suite)
        starts_fn = ContextStarts(starts_fn, ctx_env)
        if keyframes > 0:
            starts_fn = MixedStarts(starts_fn, keyframe_starts())
    elif keyframes > 0:
        raise ValueError("starts.store (keyframe starts) needs env=imagination (env.context_starts): the sim "
                         "starts from init states")
    return starts_fn


def _eval_hook(cfg: DictConfig, suite, tasks: dict, eval_sampler) -> loop.EvalHook | None:
    """Real-sim evaluation on held-out init states (``cfg.evaluation``), ``None`` without episodes."""
    ev = cfg.evaluation
    eval_env = instantiate(ev.env) if ev.get("env") else None

    def evaluate_fn(p, n):
        with using_sampler(p, eval_sampler):
            r = evaluate_real(p, tasks, int(ev.episodes_per_task), int(ev.num_envs), int(cfg.seed), suite=suite,
                              env=eval_env, max_chunks=int(ev.max_chunks))
        log.info("iteration %d: real-sim success %.3f %s", n, r["success"], {k: v["success"] for k, v in r["per_task"].items()})
        return r

    return loop.EvalHook(evaluate_fn, every=int(ev.every)) if int(ev.episodes_per_task) > 0 else None


def _debias_hook(cfg: DictConfig, suite, policy, gcfg: GRPOConfig, streams: dict) -> loop.DebiasHook | None:
    """Online debiasing (``cfg.mitigations.debias``); its real-rollout generator joins ``streams``."""
    deb = _maybe(cfg.get("mitigations") or {}, "debias")
    if deb is None or not deb.get("enabled", False):
        return None
    if deb.get("env"):
        real_env = instantiate(deb.env)
    elif suite is not None:
        real_env = make_sim_env(int(deb.get("num_envs", 4)), suite=suite)
    else:
        raise ValueError("mitigations.debias.enabled needs a real sim: a suite or mitigations.debias.env")
    debiaser = OnlineDebiaser(momentum=float(deb.momentum))
    streams["debias"] = torch.Generator().manual_seed(int(cfg.seed) + 17)
    real_fn = real_rollout_fn_for(real_env, policy, gcfg, rollouts_per_start=int(deb.rollouts_per_start),
                                  generator=streams["debias"])
    return loop.DebiasHook(debiaser, real_fn, starts=int(deb.starts), every=int(_maybe(deb, "every", 1) or 1))


def _replay_envs(cfg: DictConfig, suite) -> list:
    """Inverse-variance denoising's replay envs (``cfg.mitigations.denoise``; empty when off)."""
    den = _maybe(cfg.get("mitigations") or {}, "denoise")
    if den is None or not den.get("enabled", False):
        return []
    return [build_env(cfg.env, suite, seed=int(cfg.seed) + 1000 + s, device=str(cfg.device))
            for s in range(int(den.samples))]


def _report(cfg: DictConfig, policy_path, tasks: dict, out: dict, hooks: loop.GRPOHooks, refresher, env, policy) -> dict:
    evals = out["evals"]
    debiaser = hooks.debias.debiaser if hooks.debias is not None else None
    report: dict[str, Any] = {
        "env": str(cfg.env.get("name") or cfg.env.get("_target_") or "chunk_env"),
        "policy": str(policy_path),
        "checkpoint": out["checkpoint"],
        "resumed_from": out["resumed_from"],
        "iterations": out["iterations"],
        "tasks": list(tasks),
        "mitigations": {"debias": debiaser is not None, "denoise": hooks.denoise is not None},
        "steer": (OmegaConf.to_container(cfg.steer, resolve=True)
                  if cfg.get("steer") is not None and bool(cfg.steer.get("enabled", False)) else None),
        "refresh": None if refresher is None else {"every": int(cfg.refresh.every), "restored_round": refresher.restored,
                                                  "rounds": [{k: v for k, v in h.items() if k.startswith("refresh/") or k == "iteration"}
                                                             for h in out["history"] if "refresh/real_success" in h]},
        "grpo": OmegaConf.to_container(cfg.grpo, resolve=True),
        "evals": evals,
        "history": out["history"],
        "train_wall_s": float(sum(h["wall_s"] for h in out["history"])),
        "precision": precision_report(env, policy),
        # e.g. the imagination's uncertainty-gate halts and grasp-box misses over this run's iterations
        "env_counters": env.counters() if isinstance(env, CountingEnv) else None,
    }
    if evals:
        report["before"], report["after"] = evals[0], evals[-1]
        report["success_gain"] = evals[-1]["success"] - evals[0]["success"]
    if debiaser is not None:
        report["debias_state"] = debiaser.state_dict()
    return report


def value_baseline(policy, gcfg: GRPOConfig, seed: int):
    """The chunk value of ``grpo.advantage=gae`` (:class:`wmrl.rl.value.ValueBaseline`) on the
    policy's conditioning features: their size is the policy's declared ``feature_dim``, else
    ``cond_dim`` of its (or its frozen base's) ``init_config``.

    Raises:
        ValueError: a policy without a ``cond_dim`` (no features for the value to read).
    """
    from wmrl.rl.value import ValueBaseline

    ic = dict(getattr(policy, "init_config", {}) or {})
    dim = getattr(policy, "feature_dim", None) or ic.get("cond_dim", (ic.get("base") or {}).get("cond_dim"))
    if dim is None:
        raise ValueError(f"grpo.advantage=gae reads the policy's conditioning features, but {type(policy).__name__} "
                         "declares neither feature_dim nor a cond_dim in its init_config; use grpo.advantage=group")
    return ValueBaseline(int(dim), gcfg.max_chunks, hidden=gcfg.value_hidden, gamma=gcfg.gamma, lam=gcfg.gae_lambda,
                         lr=gcfg.value_lr, epochs=gcfg.value_epochs, minibatch_size=gcfg.value_minibatch_size,
                         normalize=gcfg.normalize_advantages, seed=seed)


def run(cfg: DictConfig, ctx: RunContext) -> dict:
    """GRPO post-training (see module docstring). Returns the report dict: before/after real-sim
    success with CIs, the evaluation curve, the per-iteration history, mitigation settings."""
    if cfg.get("checkpoint") in (None, "", "???"):
        raise ValueError("post-train needs checkpoint=PATH (a policy checkpoint folder, e.g. runs/bc/checkpoints/last)")
    policy_path = ctx.path(cfg.checkpoint)
    suite = instantiate(cfg.suite, tasks=list(cfg.tasks)) if cfg.get("suite") else None
    tasks = {t: suite.instruction(t) for t in suite.task_names} if suite is not None else task_instructions(cfg.tasks)
    policy, policy_cfg, eval_sampler = _policy(cfg, policy_path)
    gcfg = GRPOConfig(**OmegaConf.to_container(cfg.grpo, resolve=True))  # type: ignore[arg-type]
    check_policy(policy, gcfg)
    ref_policy = make_reference(policy) if gcfg.kl_coef > 0 or gcfg.anchor_coef > 0 else None
    env = build_env(cfg.env, suite, seed=int(cfg.seed), device=str(cfg.device))
    n_init = train_n_init(cfg.starts, suite, tasks) if int(cfg.starts.per_task) > 0 else 0
    starts_fn = _starts(cfg, ctx, suite, tasks, n_init)
    hooks = loop.GRPOHooks(evaluation=_eval_hook(cfg, suite, tasks, eval_sampler),
                           checkpoint=loop.CheckpointHook(int(cfg.checkpoint_every)))
    streams: dict[str, Any] = {}   # generators the loop's envs and rollout functions own (exact resume)
    hooks.debias = _debias_hook(cfg, suite, policy, gcfg, streams)
    replay_envs = _replay_envs(cfg, suite)
    hooks.denoise = loop.DenoiseHook(replay_envs) if replay_envs else None
    refresher = _maybe_refresher(cfg, ctx, env, suite, tasks, n_init, replay_envs)
    hooks.refresh = loop.RefreshHook(refresher, int(cfg.refresh.every)) if refresher is not None else None
    dcfg = cfg.get("distill") or {}
    if int(dcfg.get("every", 0)) > 0:
        from wmrl.rl.distill import Distiller, SuccessBuffer

        if str(cfg.env.get("name", "")) == "imagination" and not bool(dcfg.get("in_imagination", False)):
            raise ValueError("distill.every > 0 in imagination teaches the flow world-model frames and imagined "
                             "successes, 2 to 4 in 10 of which do not replay in the sim (the imagination check's "
                             "precision, docs/measurements.md): set distill.in_imagination=true to accept that "
                             "(with env.imagination.halt_uncertainty only successes the uncertainty gate passed "
                             "count), distill with env=sim, or set distill.every=0")
        first = dcfg.get("first_chunks")
        first = None if first is None else int(first)
        buffer = SuccessBuffer(int(dcfg.buffer), first_chunks=first) if int(dcfg.get("buffer", 0) or 0) > 0 else None
        hooks.distill = loop.DistillHook(Distiller(steps=int(dcfg.steps), batch_size=int(dcfg.batch_size),
                                                   lr=float(dcfg.lr), buffer=buffer,
                                                   balance_tasks=bool(dcfg.get("balance_tasks", False)),
                                                   first_chunks=first),
                                         int(dcfg.every), buffer=buffer)
    for name, e in [("env", env)] + [(f"replay{i}", e) for i, e in enumerate(replay_envs)]:
        if isinstance(e, RandomStreams):
            streams.update({f"{name}.{k}": g for k, g in e.rng_streams().items()})
    optimizer = torch.optim.Adam(trainable_parameters(policy, cfg.get("trainable")), lr=float(cfg.lr))
    writer = None
    if cfg.get("tensorboard", True):
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(str(ctx.out_dir / "tb"))
    value = value_baseline(policy, gcfg, int(cfg.seed)) if gcfg.advantage == "gae" else None
    setup = loop.GRPOSetup(policy, policy_cfg, env, optimizer, starts_fn, gcfg, ref_policy=ref_policy,
                           rng_streams=streams, writer=writer, value=value)
    loop_cfg = loop.LoopConfig(int(cfg.iterations), ctx.out_dir, seed=int(cfg.seed), resume=bool(cfg.resume),
                               progress=bool(cfg.get("progress", True)))
    out = loop.train_grpo(setup, loop_cfg, hooks)
    if writer is not None:
        writer.close()
    return _report(cfg, policy_path, tasks, out, hooks, refresher, env, policy)
