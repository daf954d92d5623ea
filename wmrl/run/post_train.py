"""``wmrl post-train``: GRPO post-training of a policy checkpoint in imagination (``env=imagination``)
or directly in the simulator (``env=sim``, the baseline), with periodic real-sim evaluation on
held-out init states, and resume from ``checkpoints/last``.

    wmrl post-train checkpoint=runs/bc/checkpoints/last env=imagination \
        env.world_model=runs/wm/checkpoints/last env.critic=runs/critic/checkpoints/last iterations=20
    wmrl post-train checkpoint=runs/bc/checkpoints/last env=sim          # the baseline

(The policy checkpoint key is ``checkpoint``: ``policy`` is the name of the policy config group.)

This is a composition root: it builds the suite (``cfg.suite``), the GRPO ChunkEnv (:func:`build_env`:
the suite's ``SimEnv``, an ``ImaginationEnv`` from world-model and critic checkpoints, or any
``env.chunk_env`` ``_target_``), the policy (checkpoint + the RL sampler ``cfg.rl_sampler``), the
real-sim evaluation (:func:`evaluate_real`), and hands them to :func:`wmrl.grpo.train_grpo`.
Mitigations of world-model reward errors (``cfg.mitigations``): ``debias`` (online debiasing from a
few real-sim rollouts, needs ``cfg.mitigations.debias.env``) and ``denoise`` (inverse-variance
weighting over ``samples`` extra imagined replays with other seeds).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any

import hydra
import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from wmrl import grpo
from wmrl.kernel.interfaces import RandomStreams
from wmrl.kernel.types import Start
from wmrl.run.common import RunContext, run_main

log = logging.getLogger("wmrl.post_train")


# ------------------------------------------------------------------------------------------
# Factories (Hydra `_target_`s of configs/env/*.yaml): the only place sim / worldmodels meet
# ------------------------------------------------------------------------------------------


def task_instructions(tasks: Any) -> dict[str, str]:
    """``tasks`` as a dict ``name -> instruction``; a list of names is resolved from the sim suite."""
    if isinstance(tasks, (dict, DictConfig)):
        return {str(k): str(v) for k, v in dict(tasks).items()}
    names = [str(t) for t in tasks]
    if not names:
        raise ValueError("tasks is empty: give a list of suite task names, e.g. tasks=[lift_red,lift_green]")
    from sim.tasks import get_task

    return {n: get_task(n).instruction for n in names}


def make_sim_env(num_envs: int, suite=None, tasks=None, **suite_kwargs):
    """The real simulator as a ChunkEnv: ``sim.suite.Suite(...).make_env(num_envs)``.

    ``suite``: a ``Suite`` (or ``None`` to build one from ``tasks`` and ``suite_kwargs``)."""
    if suite is None:
        from sim.suite import Suite

        suite = Suite(tasks=list(tasks) if tasks else None, **suite_kwargs)
    return suite.make_env(int(num_envs))


def _precision_report(env, policy) -> dict:
    """What GRPO computed in: the policy always in fp32 (its log-prob ratios would be bf16 noise
    otherwise), the world model of an imagination env at its own resolved precision (``wmrl.kernel.precision``)."""
    from wmrl.kernel.precision import Precision

    out = {"policy": Precision.fixed_fp32(next(policy.parameters()).device,
                                          "GRPO: policy log-probs and ratios are computed in fp32").as_dict()}
    wm = getattr(env, "world_model", None)
    if wm is not None and callable(getattr(wm, "precision", None)):
        out["world_model"] = wm.precision().as_dict()
    return out


def make_imagination_env(world_model: str, critic: str, num_envs: int, seed: int = 0, device: str = "cpu", **kwargs):
    """``wmrl.imagination.ImaginationEnv`` from world-model and critic checkpoint folders."""
    from wmrl.imagination import ImaginationEnv
    from wmrl.kernel.checkpoint import load_checkpoint

    wm = load_checkpoint(world_model, map_location=device).eval()
    cr = load_checkpoint(critic, map_location=device).eval()
    return ImaginationEnv(wm, cr, num_envs=int(num_envs), seed=int(seed), **kwargs)


class ContextStarts:
    """Wrap a start provider so every ``Start`` also carries the real first observation (``context``,
    1 frame) and the MuJoCo state of its init state, read once from the real sim and cached.
    Imagined rollouts then start from real frames, and online debiasing can run the same start in
    the sim."""

    def __init__(self, inner, sim_env):
        self.inner, self.sim_env, self.cache = inner, sim_env, {}

    def contextualize(self, starts: list[Start]) -> list[Start]:
        todo = [s for s in starts if (s.task_name, s.split, s.init_index) not in self.cache]
        b = self.sim_env.num_envs
        for i in range(0, len(todo), b):
            chunk = todo[i:i + b]
            padded = chunk + [chunk[-1]] * (b - len(chunk))
            obs = self.sim_env.reset(padded)
            for j, s in enumerate(chunk):
                state = self.sim_env.sim_state(j) if hasattr(self.sim_env, "sim_state") else None
                self.cache[(s.task_name, s.split, s.init_index)] = (obs.index([j]), state)
        out = []
        for s in starts:
            ctx_obs, state = self.cache[(s.task_name, s.split, s.init_index)]
            out.append(Start(task_name=s.task_name, instruction=s.instruction, init_index=s.init_index, split=s.split,
                             sim_state=state, context=ctx_obs))
        return out

    def __call__(self, iteration: int) -> list[Start]:
        return self.contextualize(self.inner(iteration))


class KeyframeStarts:
    """Keyframe starts (``wmrl.imagination.starts_from_store``): ``per_task`` (episode, step) pairs of
    each task's stored episodes per iteration, drawn reproducibly from ``iteration`` and ``seed``,
    with the real frame of that step as context. Imagined rollouts then begin mid-task and stay
    short (WoVR / World-Gymnast keyframe-initialised rollouts)."""

    def __init__(self, store_path, tasks: dict, per_task: int, seed: int = 0, min_steps_left: int = 8):
        from wmrl.kernel.storage import EpisodeStore

        self.store = EpisodeStore.open(store_path, mode="r")
        names = self.store.task_names
        self.by_task = {t: [i for i, n in enumerate(names) if n == t] for t in tasks}
        missing = [t for t, eps in self.by_task.items() if not eps]
        if missing:
            raise ValueError(f"keyframe store {store_path} has no episodes of tasks {missing}")
        self.per_task, self.seed, self.min_steps_left = int(per_task), int(seed), int(min_steps_left)

    def __call__(self, iteration: int) -> list[Start]:
        from wmrl.imagination import starts_from_store

        rng = np.random.default_rng([self.seed, 11, int(iteration)])
        return [s for t, eps in self.by_task.items()
                for s in starts_from_store(self.store, self.per_task, rng, episodes=eps,
                                           min_steps_left=self.min_steps_left)]


class MixedStarts:
    """Concatenates the starts of several providers (e.g. init states and keyframes)."""

    def __init__(self, *providers):
        self.providers = [p for p in providers if p is not None]

    def __call__(self, iteration: int) -> list[Start]:
        return [s for p in self.providers for s in p(iteration)]


@contextmanager
def using_sampler(policy, sampler):
    """Temporarily replace ``policy.sampler`` (no-op when ``sampler`` is None or the policy has none)."""
    if sampler is None or not hasattr(policy, "sampler"):
        yield policy
        return
    old = policy.sampler
    policy.sampler = sampler
    try:
        yield policy
    finally:
        policy.sampler = old


def steered_policy(policy, policy_cfg: dict, steer: DictConfig | None, device: str = "cpu"):
    """With ``steer.enabled``: wrap a flow policy in ``policies.steering.LatentNoisePolicy`` (DSRL: GRPO
    trains only a latent-noise head; a checkpoint that already is one is kept) and return it with its
    checkpoint config and its RL sampler ``LatentNoiseSampler(steer.std)``. Otherwise the inputs and
    ``None`` (the caller's ``rl_sampler``)."""
    from policies.steering import LatentNoisePolicy, LatentNoiseSampler

    if steer is None or not bool(steer.get("enabled", False)):
        if isinstance(policy, LatentNoisePolicy):
            raise ValueError("the checkpoint is a latent-noise-steered policy (LatentNoisePolicy): set steer.enabled=true "
                             "to post-train it (or start from its BC checkpoint)")
        return policy, policy_cfg, None
    if float(steer.std) <= 0:
        raise ValueError(f"steer.std must be > 0 for RL (the exploration std of the latent noise), got {steer.std}; "
                         "std 0 is the deterministic evaluation sampler")
    if isinstance(policy, LatentNoisePolicy):
        have = {"hidden": policy.init_config["hidden"], "bound": policy.bound}
        want = {"hidden": int(steer.hidden), "bound": float(steer.bound)}
        if have != want:
            raise ValueError(f"the checkpoint's noise head has {have}, steer asks for {want}: drop those overrides "
                             "to continue it, or start from the BC checkpoint for a new head")
    else:
        policy = LatentNoisePolicy(policy, hidden=int(steer.hidden), bound=float(steer.bound),
                                   sampler=LatentNoiseSampler(0.0, int(steer.num_steps))).to(device)
    return policy, policy.checkpoint_config(), LatentNoiseSampler(float(steer.std), int(steer.num_steps))


def rl_policy(policy, policy_cfg: dict, cfg: DictConfig, device: str = "cpu"):
    """The policy GRPO trains and its RL sampler from a post-train config: the latent-noise steering
    (``cfg.steer``, :func:`steered_policy`) when enabled, else ``cfg.rl_sampler`` instantiated (or
    ``None``). Returns ``(policy, checkpoint config, rl_sampler)``."""
    policy, policy_cfg, rl_sampler = steered_policy(policy, policy_cfg, cfg.get("steer"), device)
    if rl_sampler is None and cfg.get("rl_sampler"):
        rl_sampler = instantiate(cfg.rl_sampler)
    return policy, policy_cfg, rl_sampler


def load_policy(path, device: str = "cpu"):
    """Policy checkpoint -> ``(policy, constructor config dict)``."""
    from wmrl.kernel.checkpoint import load_checkpoint, read_checkpoint_config

    cfg = read_checkpoint_config(path)
    return load_checkpoint(path, map_location=device), cfg


def build_env(env_cfg: DictConfig, suite, seed: int = 0, device: str = "cpu"):
    """The GRPO ChunkEnv: ``env_cfg.chunk_env`` (any ``_target_``) if given, else the suite's SimEnv
    (``name: sim``) or an ImaginationEnv from checkpoints (``name: imagination``)."""
    if env_cfg.get("chunk_env"):
        return instantiate(env_cfg.chunk_env, seed=seed) if "seed" in env_cfg.chunk_env else instantiate(env_cfg.chunk_env)
    name = str(env_cfg.name)
    if name == "sim":
        if suite is None:
            raise ValueError("env=sim needs a suite (suite=default)")
        return make_sim_env(int(env_cfg.num_envs), suite=suite)
    if name == "imagination":
        for k in ("world_model", "critic"):
            if env_cfg.get(k) in (None, "", "???"):
                raise ValueError(f"env=imagination needs env.{k}=PATH (a {k} checkpoint folder)")
        kw = OmegaConf.to_container(env_cfg.get("imagination") or {}, resolve=True)
        return make_imagination_env(str(env_cfg.world_model), str(env_cfg.critic), int(env_cfg.num_envs), seed=seed,
                                    device=device, **kw)  # type: ignore[arg-type]
    raise ValueError(f"env.name must be 'sim' or 'imagination', got {name!r}")


def evaluate_real(policy, tasks: dict, episodes_per_task: int, num_envs: int, seed: int, suite=None, env=None,
                  max_chunks: int = 20, out_dir=None, videos_per_task: int = 0, progress: bool = False,
                  workers: int = 1, make_actor=None, make_suite=None) -> dict:
    """Real-sim success on held-out init states ``0..episodes_per_task-1`` of every task.

    With a ``suite``: :func:`wmrl.evaluation.evaluate_policy` (per-episode seeds, videos; ``workers``
    processes with ``make_actor`` / ``make_suite`` as there); with an
    explicit ``env`` (tests, custom envs): :func:`wmrl.grpo.evaluate_success`. Returns
    ``{"success", "ci95", "n", "per_task": {task: {"success", "ci95", "n"}}}``."""
    if env is not None or suite is None:
        if env is None:
            raise ValueError("evaluation needs a suite or evaluation.env")
        r = grpo.evaluate_success(env, policy, grpo.all_starts(tasks, episodes_per_task, split="eval"), max_chunks,
                                  seed=seed, progress=progress)
        r.pop("episodes", None)
        return r
    from wmrl.evaluation import evaluate_policy

    rep = evaluate_policy(policy, suite, episodes_per_task=episodes_per_task, batch_size=num_envs, seed=seed,
                          out_dir=out_dir, videos_per_task=videos_per_task, tasks=list(tasks), progress=progress,
                          workers=workers, make_actor=make_actor, make_suite=make_suite)
    out = {"success": rep["overall"]["success_rate"], "ci95": rep["overall"]["ci95"], "n": rep["overall"]["episodes"],
           "per_task": {t: {"success": v["success_rate"], "ci95": v["ci95"], "n": v["episodes"],
                            "mean_length": v["mean_length"]} for t, v in rep["tasks"].items()}}
    if "videos" in rep:
        out["videos"] = rep["videos"]
    return out


# ------------------------------------------------------------------------------------------
# run
# ------------------------------------------------------------------------------------------


def _maybe(cfg: DictConfig | None, key: str, default=None):
    return default if cfg is None else cfg.get(key, default)


def train_n_init(starts_cfg: DictConfig, suite, tasks) -> int:
    """Train init states per task that GRPO's starts draw from: ``starts.n_init``, or (null) the
    fewest the suite stores for any of ``tasks``."""
    return int(starts_cfg.get("n_init") or min(suite.num_init_states(t, "train") for t in tasks))


def trainable_parameters(policy, prefixes) -> list:
    """The parameters GRPO updates: all that require grad (``prefixes`` null), or only those whose
    name starts with one of ``prefixes`` (e.g. ``[head]``: the flow-matching action head; the vision
    and language encoders stay as BC left them). The others are frozen (``requires_grad=False``).

    Raises:
        ValueError: no parameter matches ``prefixes`` (the message lists the top-level modules)."""
    if not prefixes:
        return [p for p in policy.parameters() if p.requires_grad]
    prefixes = tuple(str(x) for x in prefixes)
    keep = []
    for name, p in policy.named_parameters():
        if name.startswith(prefixes):
            keep.append(p)
        else:
            p.requires_grad_(False)
    if not keep:
        tops = sorted({n.split(".")[0] for n, _ in policy.named_parameters()})
        raise ValueError(f"trainable={list(prefixes)} matches no parameter of the policy; its modules are {tops}")
    return keep


def _maybe_refresher(cfg: DictConfig, ctx: RunContext, env, suite, tasks: dict, n_init: int, replay_envs):
    """The world-model-in-the-loop refresher (``cfg.refresh``, :class:`wmrl.refresh.WorldModelRefresher`)
    or ``None`` when ``refresh.every`` is 0. On resume it reloads its last completed round."""
    rc = cfg.get("refresh")
    if rc is None or int(rc.get("every", 0) or 0) <= 0:
        return None
    if str(cfg.env.name) != "imagination":
        raise ValueError("refresh.every > 0 refines the world model: it needs env=imagination")
    if suite is None:
        raise ValueError("refresh.every > 0 needs a suite (the real sim the policy is rolled out in)")
    if rc.get("store") in (None, "", "???"):
        raise ValueError("refresh.every > 0 needs refresh.store=PATH: the world model's training EpisodeStore "
                         "(replay data against forgetting)")
    from wmrl.kernel.checkpoint import read_checkpoint_config
    from wmrl.refresh import WorldModelRefresher
    from worldmodels.train import RefreshFineTunes

    wm, cr = rc.worldmodel, rc.critic
    r = WorldModelRefresher(
        env, make_sim_env(int(rc.num_envs), suite=suite), tasks, ctx.out_dir / "refresh", ctx.path(rc.store),
        read_checkpoint_config(ctx.path(cfg.env.world_model)), read_checkpoint_config(ctx.path(cfg.env.critic)),
        n_init=n_init, episodes_per_task=int(rc.episodes_per_task), max_steps=int(rc.max_steps),
        replay_episodes=int(rc.replay_episodes), heldout_every=int(rc.heldout_every),
        wm_seconds=float(wm.seconds), wm_lr=float(wm.lr), wm_batch_size=int(wm.batch_size),
        wm_p_deterministic=float(wm.p_deterministic), critic_seconds=float(cr.seconds), critic_lr=float(cr.lr),
        critic_batch_size=int(cr.batch_size), imagined_fraction=float(cr.imagined_fraction),
        bank_size=int(cr.bank_size), bank_chunks=int(cr.bank_chunks), seed=int(cfg.seed),
        progress=bool(cfg.get("progress", True)), also_update=replay_envs, finetunes=RefreshFineTunes())
    if bool(cfg.resume) and r.restore() is not None:
        log.info("world-model refresh: resumed with the world model and critic of round %d", r.restored)
    return r


def run(cfg: DictConfig, ctx: RunContext) -> dict:
    """GRPO post-training (see module docstring). Returns the report dict: before/after real-sim
    success with CIs, the evaluation curve, the per-iteration history, mitigation settings."""
    if cfg.get("checkpoint") in (None, "", "???"):
        raise ValueError("post-train needs checkpoint=PATH (a policy checkpoint folder, e.g. runs/bc/checkpoints/last)")
    policy_path = ctx.path(cfg.checkpoint)
    suite = instantiate(cfg.suite, tasks=list(cfg.tasks)) if cfg.get("suite") else None
    tasks = {t: suite.instruction(t) for t in suite.task_names} if suite is not None else task_instructions(cfg.tasks)
    policy, policy_cfg = load_policy(policy_path, cfg.device)
    policy, policy_cfg, rl_sampler = rl_policy(policy, policy_cfg, cfg, str(cfg.device))
    eval_sampler = instantiate(cfg.eval_sampler) if cfg.get("eval_sampler") else None
    if eval_sampler is None and hasattr(policy, "sampler"):
        eval_sampler = policy.sampler  # the checkpoint's own (deterministic) sampler
    if rl_sampler is not None and hasattr(policy, "sampler"):
        policy.sampler = rl_sampler
    ref_policy = None
    gcfg = grpo.GRPOConfig(**OmegaConf.to_container(cfg.grpo, resolve=True))  # type: ignore[arg-type]
    grpo.check_policy(policy, gcfg)
    if gcfg.kl_coef > 0:
        ref_policy = grpo.make_reference(policy)

    env = build_env(cfg.env, suite, seed=int(cfg.seed), device=str(cfg.device))
    n_init = train_n_init(cfg.starts, suite, tasks)
    starts_fn = grpo.InitStateStarts(tasks, n_init=n_init, per_task=cfg.starts.per_task, split="train",
                                     seed=cfg.seed)
    keyframes = int(cfg.starts.get("keyframes_per_task") or 0) if cfg.starts.get("store") else 0
    if str(cfg.env.name) == "imagination":
        ctx_env = instantiate(cfg.env.context_env) if cfg.env.get("context_env") else \
            make_sim_env(int(cfg.env.get("context_num_envs", 4)), suite=suite)
        starts_fn = ContextStarts(starts_fn, ctx_env)
        if keyframes > 0:
            starts_fn = MixedStarts(starts_fn, KeyframeStarts(ctx.path(cfg.starts.store), tasks, keyframes,
                                                              seed=int(cfg.seed)))
    elif keyframes > 0:
        raise ValueError("starts.store (keyframe starts) needs env=imagination: the sim starts from init states")

    # real-sim evaluation on held-out init states
    ev = cfg.evaluation
    eval_env = instantiate(ev.env) if ev.get("env") else None

    def evaluate_fn(p, n):
        with using_sampler(p, eval_sampler):
            r = evaluate_real(p, tasks, int(ev.episodes_per_task), int(ev.num_envs), int(cfg.seed), suite=suite,
                              env=eval_env, max_chunks=int(ev.max_chunks))
        log.info("iteration %d: real-sim success %.3f %s", n, r["success"], {k: v["success"] for k, v in r["per_task"].items()})
        return r

    # generators the loop's envs and rollout functions own: saved with every checkpoint (exact resume)
    streams: dict[str, Any] = {}
    # mitigations
    mit = cfg.get("mitigations") or {}
    deb = _maybe(mit, "debias")
    debiaser = real_fn = None
    debias_starts = 0
    if deb is not None and deb.get("enabled", False):
        if deb.get("env"):
            real_env = instantiate(deb.env)
        elif suite is not None:
            real_env = make_sim_env(int(deb.get("num_envs", 4)), suite=suite)
        else:
            raise ValueError("mitigations.debias.enabled needs a real sim: a suite or mitigations.debias.env")
        debiaser = grpo.OnlineDebiaser(momentum=float(deb.momentum))
        streams["debias"] = torch.Generator().manual_seed(int(cfg.seed) + 17)
        real_fn = grpo.real_rollout_fn_for(real_env, policy, gcfg, rollouts_per_start=int(deb.rollouts_per_start),
                                           generator=streams["debias"])
        debias_starts = int(deb.starts)
    den = _maybe(mit, "denoise")
    replay_envs = []
    if den is not None and den.get("enabled", False):
        for s in range(int(den.samples)):
            replay_envs.append(build_env(cfg.env, suite, seed=int(cfg.seed) + 1000 + s, device=str(cfg.device)))

    refresher = _maybe_refresher(cfg, ctx, env, suite, tasks, n_init, replay_envs)
    for name, e in [("env", env)] + [(f"replay{i}", e) for i, e in enumerate(replay_envs)]:
        if isinstance(e, RandomStreams):
            streams.update({f"{name}.{k}": g for k, g in e.rng_streams().items()})

    params = trainable_parameters(policy, cfg.get("trainable"))
    optimizer = torch.optim.Adam(params, lr=float(cfg.lr))
    writer = None
    if cfg.get("tensorboard", True):
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(str(ctx.out_dir / "tb"))
    out = grpo.train_grpo(policy, policy_cfg, env, optimizer, starts_fn, gcfg, int(cfg.iterations), ctx.out_dir,
                          ref_policy=ref_policy, evaluate_fn=evaluate_fn if int(ev.episodes_per_task) > 0 else None,
                          eval_every=int(ev.every), checkpoint_every=int(cfg.checkpoint_every), resume=bool(cfg.resume),
                          seed=int(cfg.seed), debiaser=debiaser, real_rollout_fn=real_fn, debias_starts=debias_starts,
                          debias_every=int(_maybe(deb, "every", 1) or 1), replay_envs=replay_envs,
                          refresh_fn=refresher, refresh_every=int(cfg.refresh.every) if refresher is not None else 0,
                          writer=writer, progress=bool(cfg.get("progress", True)), rng_streams=streams)
    if writer is not None:
        writer.close()
    evals = out["evals"]
    report: dict[str, Any] = {
        "env": str(cfg.env.name),
        "policy": str(policy_path),
        "checkpoint": out["checkpoint"],
        "resumed_from": out["resumed_from"],
        "iterations": out["iterations"],
        "tasks": list(tasks),
        "mitigations": {"debias": debiaser is not None, "denoise": bool(replay_envs)},
        "steer": (OmegaConf.to_container(cfg.steer, resolve=True)
                  if cfg.get("steer") is not None and bool(cfg.steer.get("enabled", False)) else None),
        "refresh": None if refresher is None else {"every": int(cfg.refresh.every), "restored_round": refresher.restored,
                                                  "rounds": [{k: v for k, v in h.items() if k.startswith("refresh/") or k == "iteration"}
                                                             for h in out["history"] if "refresh/real_success" in h]},
        "grpo": OmegaConf.to_container(cfg.grpo, resolve=True),
        "evals": evals,
        "history": out["history"],
        "train_wall_s": float(sum(h["wall_s"] for h in out["history"])),
        "precision": _precision_report(env, policy),
    }
    if evals:
        report["before"], report["after"] = evals[0], evals[-1]
        report["success_gain"] = evals[-1]["success"] - evals[0]["success"]
    if debiaser is not None:
        report["debias_state"] = debiaser.state_dict()
    return report


@hydra.main(version_base="1.3", config_path="pkg://configs", config_name="post_train")
def main(cfg: DictConfig) -> None:
    run_main(cfg, run, "post-train")


if __name__ == "__main__":
    main()
