"""``wmrl imagination-check``: before GRPO, does a world model + critic rank a policy's rollouts like
the sim? The policy (with GRPO's RL sampler or latent-noise steering) is rolled out in imagination in
groups from GRPO's first train init states (and, with ``keyframes_per_task``, from keyframes of GRPO's
``starts.store`` as GRPO draws them), and the same actions are replayed open loop in the sim
(:func:`wmrl.fidelity.replay_check`). The pipeline's ``imagination_check`` stage.

Report: imagined and replayed success, within-group pair accuracy, precision of imagined successes,
mixed groups, per task (``wmrl.fidelity.replay_check``), and the sampler used.
"""

from __future__ import annotations

import logging

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from wmrl.run.common import RunContext, run_main

log = logging.getLogger("wmrl.imagination_check")


def run(cfg: DictConfig, ctx: RunContext) -> dict:
    from wmrl.fidelity import replay_check
    from wmrl.rl.starts import ContextStarts, InitStateStarts, KeyframeStarts
    from wmrl.run.builders import (
        build_suite,
        load_policy,
        make_imagination_env,
        make_sim_env,
        rl_policy,
        train_n_init,
        with_suite,
    )

    suite_cfg = OmegaConf.to_container(cfg.suite, resolve=True)
    if cfg.get("tasks"):
        suite_cfg["tasks"] = list(cfg.tasks)
    suite = build_suite(suite_cfg)
    tasks = {t: suite.instruction(t) for t in suite.task_names}
    g = cfg.grpo
    policy, policy_cfg = load_policy(ctx.path(cfg.checkpoint), str(cfg.device))
    policy, _, rl_sampler = rl_policy(policy, policy_cfg, g, str(cfg.device))
    policy.eval()
    if rl_sampler is not None:
        policy.sampler = rl_sampler
    group = int(g.group_size)
    n_init = train_n_init(OmegaConf.create({"n_init": g.get("n_init")}), suite, tasks)
    per_task, keyframes = int(cfg.starts_per_task), int(cfg.get("keyframes_per_task") or 0)
    if per_task < 0 or keyframes < 0 or per_task + keyframes == 0:
        raise ValueError(f"the imagination check needs starts: starts_per_task={per_task} and keyframes_per_task="
                         f"{keyframes} (both >= 0, at least one > 0)")
    if keyframes and not cfg.get("store"):
        raise ValueError("keyframes_per_task > 0 needs store=<EpisodeStore with sim states> (GRPO's starts.store, "
                         "e.g. the pipeline's bc_rollouts/demos_and_rollouts.zarr)")
    sim_env = make_sim_env(int(cfg.num_envs), suite=suite)        # renders the context frames, then replays
    starts = []
    if per_task:
        starts = InitStateStarts(tasks, n_init=n_init, per_task=per_task, split="train", seed=int(cfg.seed))(0)
        starts = ContextStarts(None, sim_env).contextualize(starts)
    if keyframes:   # mid-episode real frames with their MuJoCo states, drawn as GRPO draws its keyframe starts
        kf = KeyframeStarts(ctx.path(cfg.store), tasks, keyframes, seed=int(cfg.seed))(0)
        if any(s.sim_state is None for s in kf):
            raise ValueError(f"store {cfg.store} holds no sim states: its keyframes cannot be replayed in the sim")
        starts = starts + kf
    kw = with_suite(OmegaConf.to_container(g.env.get("imagination"), resolve=True) or {}, suite)
    imag = make_imagination_env(str(ctx.path(g.env.world_model)), str(ctx.path(g.env.critic)), len(starts) * group,
                                seed=int(cfg.seed), device=str(cfg.device), **kw)
    r = replay_check(imag, sim_env, policy, starts, group, int(g.max_chunks),
                     generator=torch.Generator().manual_seed(int(cfg.seed)), progress=True)
    r["sampler"] = repr(policy.sampler)  # the RL sampler, or the latent-noise steering's
    r.update(imag.counters())   # grasp_misses: closes the grasp box judged misses; halted: slots the uncertainty gate halted
    _log_verdict(r)
    return r


def _log_verdict(r: dict) -> None:
    acc_s = "n/a (no group with both outcomes in the sim)" if r["pair_accuracy"] is None else f"{r['pair_accuracy']:.2f} (0.5 = chance)"
    log.info("imagination check: imagined success %.3f, the same actions replayed in the sim %.3f; within-group "
             "pair accuracy %s, %d/%d groups mixed in imagination, %d in the sim",
             r["imagined_success"], r["replayed_success"], acc_s, r["mixed_groups_imagined"],
             r["groups"], r["mixed_groups_real"])
    w = r.get("outcome_paths", {}).get("imagined_only")
    if w and w["n"]:
        log.info("imagination check: %d imagined successes fail in the sim; at their last chunk the imagined end "
                 "effector is %.2f cm (median) from the replayed one (%d over 2 cm), finger gap %.2f cm imagined vs "
                 "%.2f cm replayed", w["n"], w["ee_err_cm_median"], w["far"], w["gap_imagined_cm_median"],
                 w["gap_replayed_cm_median"])
    acc, prec = r["pair_accuracy"], r["precision"]
    if (acc is not None and acc < 0.6) or (prec is not None and prec < 0.5):
        log.warning("imagination check: the world model and critic reward actions that fail in the sim (pair "
                    "accuracy %s, precision of imagined successes %s); GRPO in imagination is unlikely to improve "
                    "real success. Train the world model longer or on more episodes (stages.worldmodel), or "
                    "compare with env=sim (wmrl bench grpo)", acc, prec)


@hydra.main(version_base="1.3", config_path="pkg://configs", config_name="imagination_check")
def main(cfg: DictConfig) -> None:
    run_main(cfg, run, "imagination_check")


if __name__ == "__main__":
    main()
