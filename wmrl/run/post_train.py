"""``wmrl post-train``: GRPO post-training of a policy checkpoint in imagination (``env=imagination``)
or directly in the simulator (``env=sim``, the baseline), with periodic real-sim evaluation on
held-out init states, and resume from ``checkpoints/last``.

    wmrl post-train policy=runs/bc/checkpoints/last env=imagination \
        env.world_model=runs/wm/checkpoints/last env.critic=runs/critic/checkpoints/last iterations=20

This is a composition root: it builds the ChunkEnv (``cfg.env.chunk_env``, a ``_target_``), the
policy (checkpoint + the RL sampler ``cfg.rl_sampler``), the real-sim evaluation env
(``cfg.evaluation.env``), and hands them to :func:`wmrl.grpo.train_grpo`.
Mitigations of world-model reward errors (``cfg.mitigations``): ``debias`` (online debiasing from a
few real-sim rollouts, needs ``cfg.mitigations.debias.env``) and ``denoise`` (inverse-variance
weighting over ``samples`` extra imagined replays with other seeds).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any

import hydra
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from wmrl import grpo
from wmrl.run.common import RunContext
from wmrl.types import Obs, Start

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


def make_sim_env(num_envs: int, image_size=(64, 64), cameras=("agentview", "robot0_eye_in_hand"),
                 render: dict | None = None, auto_reset: bool = True, device: str = "cpu"):
    """The real simulator as a ChunkEnv: ``sim.env.SimEnv`` over the suite's init states."""
    from sim import init_states
    from sim.env import SimEnv

    return SimEnv(int(num_envs), init_states=init_states.get, cameras=tuple(cameras), image_size=tuple(image_size),
                  render=dict(render) if render else None, auto_reset=auto_reset, device=device)


def make_imagination_env(world_model: str, critic: str, num_envs: int, seed: int = 0, device: str = "cpu", **kwargs):
    """``wmrl.imagination.ImaginationEnv`` from world-model and critic checkpoint folders."""
    from wmrl.checkpoint import load_checkpoint
    from wmrl.imagination import ImaginationEnv

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


def load_policy(path, device: str = "cpu"):
    """Policy checkpoint -> ``(policy, constructor config dict)``."""
    from wmrl.checkpoint import load_checkpoint, read_checkpoint_config

    cfg = read_checkpoint_config(path)
    return load_checkpoint(path, map_location=device), cfg


# ------------------------------------------------------------------------------------------
# run
# ------------------------------------------------------------------------------------------


def _maybe(cfg: DictConfig | None, key: str, default=None):
    return default if cfg is None else cfg.get(key, default)


def run(cfg: DictConfig, ctx: RunContext) -> dict:
    """GRPO post-training (see module docstring). Returns the report dict: before/after real-sim
    success with CIs, the evaluation curve, the per-iteration history, mitigation settings."""
    if cfg.get("policy") in (None, "", "???"):
        raise ValueError("post-train needs policy=PATH (a policy checkpoint folder, e.g. runs/bc/checkpoints/last)")
    policy_path = ctx.path(cfg.policy)
    tasks = task_instructions(cfg.tasks)
    policy, policy_cfg = load_policy(policy_path, cfg.device)
    rl_sampler = instantiate(cfg.rl_sampler) if cfg.get("rl_sampler") else None
    eval_sampler = instantiate(cfg.eval_sampler) if cfg.get("eval_sampler") else None
    if rl_sampler is not None and hasattr(policy, "sampler"):
        policy.sampler = rl_sampler
    ref_policy = None
    gcfg = grpo.GRPOConfig(**OmegaConf.to_container(cfg.grpo, resolve=True))  # type: ignore[arg-type]
    if gcfg.kl_coef > 0:
        ref_policy = grpo.make_reference(policy)

    env = instantiate(cfg.env.chunk_env)
    starts_fn = grpo.InitStateStarts(tasks, n_init=cfg.starts.n_init, per_task=cfg.starts.per_task, split="train",
                                     seed=cfg.seed)
    needs_context = bool(cfg.env.get("needs_context", False))
    ctx_env = None
    if needs_context:
        ctx_env = instantiate(cfg.env.context_env)
        starts_fn = ContextStarts(starts_fn, ctx_env)

    # real-sim evaluation on held-out init states
    ev = cfg.evaluation
    eval_env = instantiate(ev.env) if ev.get("env") else None
    eval_starts = grpo.all_starts(tasks, int(ev.episodes_per_task), split="eval")

    def evaluate_fn(p, n):
        with using_sampler(p, eval_sampler):
            r = grpo.evaluate_success(eval_env, p, eval_starts, int(ev.max_chunks), seed=int(cfg.seed))
        r.pop("episodes", None)
        log.info("iteration %d: real-sim success %.3f %s", n, r["success"], {k: v["success"] for k, v in r["per_task"].items()})
        return r

    # mitigations
    mit = cfg.get("mitigations") or {}
    deb = _maybe(mit, "debias")
    debiaser = real_fn = None
    debias_starts = 0
    if deb is not None and deb.get("enabled", False):
        real_env = instantiate(deb.env) if deb.get("env") else eval_env
        if real_env is None:
            raise ValueError("mitigations.debias.enabled needs a real-sim env (mitigations.debias.env or evaluation.env)")
        debiaser = grpo.OnlineDebiaser(momentum=float(deb.momentum))
        real_fn = grpo.real_rollout_fn_for(real_env, policy, gcfg, rollouts_per_start=int(deb.rollouts_per_start),
                                           generator=torch.Generator().manual_seed(int(cfg.seed) + 17))
        debias_starts = int(deb.starts)
    den = _maybe(mit, "denoise")
    replay_envs = []
    if den is not None and den.get("enabled", False):
        for s in range(int(den.samples)):
            replay_envs.append(instantiate(cfg.env.chunk_env, seed=int(cfg.seed) + 1000 + s))

    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=float(cfg.lr))
    writer = None
    if cfg.get("tensorboard", True):
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(str(ctx.out_dir / "tb"))
    out = grpo.train_grpo(policy, policy_cfg, env, optimizer, starts_fn, gcfg, int(cfg.iterations), ctx.out_dir,
                          ref_policy=ref_policy, evaluate_fn=evaluate_fn if eval_env is not None else None,
                          eval_every=int(ev.every), checkpoint_every=int(cfg.checkpoint_every), resume=bool(cfg.resume),
                          seed=int(cfg.seed), debiaser=debiaser, real_rollout_fn=real_fn, debias_starts=debias_starts,
                          debias_every=int(_maybe(deb, "every", 1) or 1), replay_envs=replay_envs,
                          writer=writer, progress=bool(cfg.get("progress", True)))
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
        "grpo": OmegaConf.to_container(cfg.grpo, resolve=True),
        "evals": evals,
        "history": out["history"],
        "train_wall_s": float(sum(h["wall_s"] for h in out["history"])),
    }
    if evals:
        report["before"], report["after"] = evals[0], evals[-1]
        report["success_gain"] = evals[-1]["success"] - evals[0]["success"]
    if debiaser is not None:
        report["debias_state"] = debiaser.state_dict()
    return report


@hydra.main(version_base="1.3", config_path="pkg://configs", config_name="post_train")
def main(cfg: DictConfig) -> None:
    ctx = RunContext(cfg)
    ctx.finish(run(cfg, ctx))


if __name__ == "__main__":
    main()
