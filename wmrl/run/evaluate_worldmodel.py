"""``wmrl evaluate-worldmodel``: world-model and critic fidelity on held-out episodes.

Example::

    wmrl evaluate-worldmodel store=runs/collect/store world_model=runs/wm/checkpoints/last \
        critic_checkpoint=runs/critic/checkpoints/last hydra.run.dir=runs/eval_wm
    # + imagined vs real-sim success of a policy from the same starts:
    wmrl evaluate-worldmodel ... policy_check.policy=runs/bc/checkpoints/last

Report (``report.json``):
* ``horizons``: PSNR / SSIM 1..``max_chunks`` chunks ahead (autoregressive, true actions) against
  copy-last-frame, and the imagined end-effector position error in metres (``position_dims``) and
  proprio error per dimension against the start's proprio (``worldmodels.evaluate.horizon_metrics``);
* ``action_following``: one-chunk MSE with the true actions vs with another episode's actions;
* ``closing_gap`` and ``grasp_outcome``: the finger gap after the chunks that close the gripper, and
  whether 4 imagined chunks from each close tell a grasp from a miss (``worldmodels.evaluate``);
  ``grasp_outcome_lead``: the same with imagination started 4 chunks before the close, so the close is
  read from imagined frames as in a rollout;
* ``critic``: AUROC success vs failure on held-out episodes (final frames);
* ``policy_check``: success rate of a policy in ``ImaginationEnv`` and in the real ``SimEnv`` from the
  same eval init states (the imagined rollouts start from the sim's real first frame); with
  ``policy_check.replay_check.starts_per_task > 0`` also ``replay_check``: groups of imagined rollouts
  (GRPO's view) replayed open loop in the sim (``wmrl.fidelity.replay_check``);
* ``acceptance``: each target with its measured value and pass/fail.
"""

from __future__ import annotations

import hydra
import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from wmrl.run.common import RunContext, run_main


def _policy_check(cfg: DictConfig, wm, critic, ctx: RunContext) -> dict:
    """Imagined vs real-sim success of ``cfg.policy_check.policy`` from the same eval starts."""
    from wmrl.imagination import ImaginationEnv
    from wmrl.rl.evaluate import evaluate_success
    from wmrl.rl.starts import ContextStarts, all_starts
    from wmrl.run.builders import load_policy, task_instructions, using_sampler

    pc = cfg.policy_check
    policy, _ = load_policy(str(ctx.path(pc.policy)))
    policy.eval()
    suite = instantiate(pc.suite)
    tasks = task_instructions(pc.tasks if pc.get("tasks") else suite.task_names)
    starts = all_starts(tasks, int(pc.episodes_per_task), split="eval")
    sim_env = suite.make_env(int(pc.num_envs))
    sampler = instantiate(pc.sampler) if pc.get("sampler") else None
    with using_sampler(policy, sampler):
        real = evaluate_success(sim_env, policy, starts, int(pc.max_chunks), seed=int(cfg.seed), progress=True)
        ctx_starts = ContextStarts(lambda _i: starts, suite.make_env(int(pc.num_envs))).contextualize(starts)
        imag_env = ImaginationEnv(wm, critic, num_envs=int(pc.num_envs), max_chunks=int(pc.max_chunks),
                                  success_threshold=float(pc.success_threshold),
                                  success_patience=int(pc.get("success_patience", 1)), seed=int(cfg.seed))
        imag = evaluate_success(imag_env, policy, ctx_starts, int(pc.max_chunks), seed=int(cfg.seed), progress=True)
    agree = float(np.mean([a["success"] == b["success"] for a, b in zip(real["episodes"], imag["episodes"])]))
    rc = pc.get("replay_check") or {}
    replay = None
    if int(rc.get("starts_per_task", 0) or 0) > 0:
        from wmrl.fidelity import replay_check

        k = int(rc.starts_per_task)
        rs = [s for t in tasks for s in [x for x in ctx_starts if x.task_name == t][:k]]
        g = int(rc.group_size)
        with using_sampler(policy, instantiate(rc.sampler) if rc.get("sampler") else None):
            replay = replay_check(
                ImaginationEnv(wm, critic, num_envs=len(rs) * g, max_chunks=int(rc.max_chunks),
                               success_threshold=float(pc.success_threshold),
                               success_patience=int(pc.get("success_patience", 1)), seed=int(cfg.seed)),
                sim_env, policy, rs, g, int(rc.max_chunks), generator=torch.Generator().manual_seed(int(cfg.seed)),
                progress=True)
    return {"replay_check": replay, "real_success": real["success"], "real_ci95": real["ci95"], "imagined_success": imag["success"],
            "imagined_ci95": imag["ci95"], "gap_points": 100 * abs(real["success"] - imag["success"]),
            "per_start_agreement": agree, "n": real["n"],
            "real_per_task": real["per_task"], "imagined_per_task": imag["per_task"]}


def run(cfg: DictConfig, ctx: RunContext) -> dict:
    from wmrl.kernel.checkpoint import load_checkpoint
    from wmrl.run.data import load_splits
    from worldmodels.evaluate import (GRASP_LEAD_CHUNKS, action_following, closing_gap_error, critic_auroc, grasp_outcome,
                                      horizon_metrics)

    dev = cfg.device
    wm = load_checkpoint(ctx.path(cfg.world_model), map_location=dev).eval()
    for k in ("stochastic", "sampling_steps"):       # evaluate another sampler of the same weights
        if cfg.sampler.get(k) is not None:
            setattr(wm, k, type(getattr(wm, k))(cfg.sampler[k]))
    critic = load_checkpoint(ctx.path(cfg.critic_checkpoint), map_location=dev).eval() if cfg.get("critic_checkpoint") else None
    _, held, _ = load_splits(ctx.path(cfg.store), cfg.heldout_every, wm.cameras)
    gen = torch.Generator(device=dev).manual_seed(int(cfg.seed))
    report: dict = {"heldout_episodes": held.num_episodes, "heldout_success_rate": float(held.success.mean()),
                    "sampler": {"stochastic": wm.stochastic, "sampling_steps": wm.sampling_steps}}
    hm = horizon_metrics(wm, held, max_chunks=int(cfg.max_chunks), start_stride=int(cfg.start_stride), generator=gen,
                         position_dims=cfg.get("position_dims"))
    report["horizons"] = hm
    report["action_following"] = action_following(wm, held, n=int(cfg.action_following_n), seed=int(cfg.seed))
    report["closing_gap"] = closing_gap_error(wm, held)
    report["grasp_outcome"] = grasp_outcome(wm, held)
    report["grasp_outcome_lead"] = grasp_outcome(wm, held, lead_chunks=GRASP_LEAD_CHUNKS)
    if critic is not None:
        report["critic"] = critic_auroc(critic, held)
    if cfg.policy_check.get("policy"):
        report["policy_check"] = _policy_check(cfg, wm, critic, ctx)
    acc = {}
    g = hm["psnr_gain"]
    if len(g) >= 1:
        acc["psnr_1chunk_gain_db>=3"] = {"value": g[0], "pass": g[0] >= 3.0}
    if len(g) >= 4:
        acc["psnr_4chunk_gain_db>0"] = {"value": g[3], "pass": g[3] > 0.0}
    af = report["action_following"]["reduction"]
    acc["action_following_reduction>=0.2"] = {"value": af, "pass": af >= 0.2}
    if critic is not None and report["critic"]["auroc"] is not None:
        au = report["critic"]["auroc"]
        acc["critic_auroc>=0.9"] = {"value": au, "pass": au >= 0.9}
    if "policy_check" in report:
        gp = report["policy_check"]["gap_points"]
        acc["imagined_vs_real_success_gap<=15pts"] = {"value": gp, "pass": gp <= 15.0}
    report["acceptance"] = acc
    pe = hm.get("position_error") or [float("nan")] * len(hm["horizon"])
    pc = hm.get("position_error_copy") or [float("nan")] * len(hm["horizon"])
    print("horizon  psnr   copy   gain   ssim  ssim_copy  eef_err_cm  copy_cm")
    for k, p, c, s, sc, e, ec in zip(hm["horizon"], hm["psnr"], hm["psnr_copy"], hm["ssim"], hm["ssim_copy"], pe, pc):
        print(f"{k:>7} {p:6.2f} {c:6.2f} {p - c:+6.2f} {s:6.3f} {sc:9.3f} {100 * e:11.2f} {100 * ec:8.2f}")
    cg, go = report["closing_gap"], report["grasp_outcome"]
    if cg["n"]:
        print(f"finger gap after the {cg['n']} chunks that close the gripper: {100 * cg['mae_m']:.2f} cm "
              f"(copy {100 * cg['mae_copy_m']:.2f} cm)")
    if go["n"]:
        print(f"grasps imagined 4 chunks from the close: misses called {go['miss_called']} of {go['misses']}, "
              f"holds called {go['hold_called']} of {go['n'] - go['misses']}")
    gl = report["grasp_outcome_lead"]
    if gl["n"]:
        print(f"grasps imagined from {GRASP_LEAD_CHUNKS} chunks before the close: misses called {gl['miss_called']} of "
              f"{gl['misses']}, holds called {gl['hold_called']} of {gl['n'] - gl['misses']}, imagined holds real "
              f"{gl['hold_precision']}")
    for k, v in acc.items():
        print(f"{k}: {v['value']:.3f} {'PASS' if v['pass'] else 'FAIL'}")
    return report


@hydra.main(version_base="1.3", config_path="pkg://configs", config_name="evaluate_worldmodel")
def main(cfg: DictConfig) -> None:
    run_main(cfg, run, "evaluate-worldmodel")


if __name__ == "__main__":
    main()
