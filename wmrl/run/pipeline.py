"""``wmrl pipeline``: the main job, from demonstrations to a policy improved in imagination, with the
evidence.

Stages (each in its own sub-directory of the run, with its own ``config.yaml`` and ``report.json``;
each is a ``run(cfg, ctx)`` of its entry-point module, called in process):

1. ``collect``      noisy scripted demos of the suite tasks -> EpisodeStore (``wmrl collect``)
2. ``bc``           behaviour cloning of the flow-matching VLA policy (``wmrl train-policy``)
3. ``bc_rollouts``  real-sim rollouts of the BC policy from train init states -> EpisodeStore
4. ``worldmodel`` / ``critic``  trained on demos + BC rollouts (``wmrl train-worldmodel`` / ``train-critic``;
   the critic also on frames of this world model, ``stages.critic.imagined``)
5. ``imagination_check``  the BC policy's imagined rollouts (GRPO's groups, sampler and horizon)
   replayed open loop in the sim: does imagination reward actions that work? (``wmrl.fidelity``;
   ``imagination_check.starts_per_task=0 imagination_check.keyframes_per_task=0`` skips it)
6. ``eval_before``  real-sim success of the BC policy on the held-out (eval) init states
7. ``grpo``         GRPO in imagination (``wmrl post-train env=imagination``)
8. ``eval_after``   real-sim success of the post-trained policy on the same held-out init states
9. ``report.json`` (wall time per stage, success per task before/after with Wilson 95 % CIs, the world
   model's held-out PSNR gain and end-effector position error per horizon), plots
   (``success_before_after.png``, ``imagined_vs_real.png``) and videos (``videos/*.mp4``).

``suite=libero_object`` runs the loop on the original LIBERO suite instead (``wmrl.run.libero_pipeline``:
LIBERO env workers for demos and evaluation, the ``libero`` settings below).

``preset=debug`` shrinks every stage so that the whole loop runs in about a minute (tests).
Every ``stages.<stage>`` key is checked against that stage's own config before anything runs (an
unknown key or a value of the wrong type is an error, not a setting silently ignored 20 minutes later).
With ``resume=true`` (default) a stage whose ``report.json`` exists is not run again, provided it was run
with the same settings (``stage_inputs.json``); otherwise the pipeline stops and says which stage
directories to remove (it never overwrites results).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from wmrl.kernel.types import Start
from wmrl.refresh import store_like
from wmrl.rl.rollout import record_episodes
from wmrl.run import machine
from wmrl.run.common import RunContext, run_main
from wmrl.run.data import merge_stores
from wmrl.run.figures import plot_before_after, plot_imagined_vs_real, real_curve
from wmrl.run.stages import (
    STAGE_CONFIGS,
    STAGE_ORDER,
    SettingsRefused,
    Stages,
    apply_preset,
    check_stage_overrides,
    command_line_overrides,
    module_run,
    stage_config,
    to_container,
)

log = logging.getLogger("wmrl.pipeline")


# ------------------------------------------------------------------------------------------
# Stores (BC rollouts are recorded by wmrl.refresh.record_episodes)
# ------------------------------------------------------------------------------------------


# ------------------------------------------------------------------------------------------
# Plots and videos
# ------------------------------------------------------------------------------------------


def _eval_policy(policy_path: Path, cfg: DictConfig, tasks: dict, suite, out_dir: Path | None, videos: int) -> dict:
    from functools import partial

    from wmrl.run.builders import build_actor, build_suite, evaluate_real

    suite_cfg = to_container(cfg.suite)
    sampler_cfg = to_container(cfg.eval_sampler) if cfg.get("eval_sampler") else None
    make_actor = partial(build_actor, str(policy_path), 0.0, suite_cfg, str(cfg.device), sampler_cfg)
    r = evaluate_real(make_actor(), tasks, int(cfg.evaluation.episodes_per_task), int(cfg.evaluation.num_envs),
                      int(cfg.seed), suite=suite, out_dir=out_dir, videos_per_task=videos, progress=True,
                      workers=int(cfg.evaluation.get("workers") or 1), make_actor=make_actor,
                      make_suite=partial(build_suite, suite_cfg))
    r["policy"] = str(policy_path)
    return r


def run(cfg: DictConfig, ctx: RunContext) -> dict:
    """The main job (see module docstring). Returns the report: ``stages`` (wall time per stage),
    ``before`` / ``after`` (success per task with CIs), ``success_gain``, paths of plots, videos and
    checkpoints.

    Raises:
        SettingsRefused: an unknown preset, bad stage settings, or a resume that would mix results of
            other settings (:class:`ResumeRefused`). Nothing has run; a run directory that had a
            ``config.yaml`` gets it back (it describes the results there).
        ValueError: bad input data.
    """
    try:
        cfg = apply_preset(cfg, *command_line_overrides())
        check_stage_overrides(cfg)
        if cfg.suite.get("libero"):  # the original LIBERO suites: LIBERO env workers (wmrl.run.libero_pipeline)
            from wmrl.run.libero_pipeline import run as run_libero_pipeline

            return run_libero_pipeline(cfg, ctx)
        return _run(cfg, ctx)
    except SettingsRefused:
        ctx.restore_config()
        raise


@dataclass
class _Job:
    """What every stage of one pipeline run shares."""

    cfg: DictConfig
    ctx: RunContext
    stages: Stages
    suite: Any
    suite_cfg: dict
    tasks: dict[str, str]
    common: dict[str, Any]

    @property
    def out(self) -> Path:
        return self.ctx.out_dir

    def config(self, stage: str, overrides: dict) -> DictConfig:
        """The stage's entry-point config (``STAGE_CONFIGS``) with the pipeline's groups and ``overrides``."""
        return stage_config(self.cfg, stage, overrides)

    def run_entry(self, stage: str, cfg: DictConfig, module: str | None = None) -> dict:
        """Run stage ``stage`` as the ``run()`` of its entry point (``module``, else ``STAGE_CONFIGS``'s)."""
        return self.stages.run(stage, cfg, module_run(module or STAGE_CONFIGS[stage][0]))


def _start(cfg: DictConfig, ctx: RunContext) -> tuple[_Job, dict | None]:
    """Save the config, build the suite, announce the estimate; the shared state of every stage."""
    saved = OmegaConf.to_container(cfg, resolve=True)
    saved.pop("presets", None)           # the applied one is merged in (and named by `preset`)
    (ctx.out_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(saved)))
    suite_cfg = to_container(cfg.suite)
    suite_cfg["tasks"] = list(cfg.tasks)
    suite = hydra.utils.instantiate(suite_cfg)
    tasks = {t: suite.instruction(t) for t in suite.task_names}
    estimate = machine.announce_estimate(cfg, suite) if cfg.get("estimate", True) else None
    stages = Stages(ctx, resume=bool(cfg.resume),
                    order=[n for n in STAGE_ORDER if n != "imagination_check" or _checks_fidelity(cfg)])
    # threads chosen once, at the start (wmrl.run.common.resolve_threads), for every stage: a stage that
    # chose again could see the previous stage's workers still exiting and change the thread count
    common = {"seed": int(cfg.seed), "num_threads": int(getattr(ctx, "num_threads", 0) or 0), "device": cfg.device}
    return _Job(cfg, ctx, stages, suite, suite_cfg, tasks, common), estimate


def _checks_fidelity(cfg: DictConfig) -> bool:
    return machine.imagination_check_starts(cfg.get("imagination_check")) > 0


def _bc_rollouts(job: _Job, demos: Path, bc_ckpt: Path, scfg: DictConfig) -> dict:
    """Stage 3: real-sim rollouts of the BC policy from train init states, stored beside the demos."""
    from wmrl.kernel.storage import EpisodeStore
    from wmrl.run.builders import load_policy, make_sim_env, using_sampler

    out, seed, task_list = job.out / "bc_rollouts", int(job.cfg.seed), list(job.tasks)
    rollouts, mixed = out / "rollouts.zarr", out / "demos_and_rollouts.zarr"
    policy, _ = load_policy(bc_ckpt, job.cfg.device)
    policy.eval()
    env = make_sim_env(int(scfg.num_envs), suite=job.suite)
    n = int(scfg.episodes_per_task)
    rng = np.random.default_rng([seed, 3])
    starts = [Start(task_name=t, instruction=job.tasks[t], init_index=int(k), split="train")
              for t in task_list for k in rng.choice(int(scfg.n_init), size=n, replace=False)]
    sampler = hydra.utils.instantiate(scfg.sampler) if scfg.get("sampler") else None
    with using_sampler(policy, sampler):
        eps = record_episodes(env, policy, starts, int(scfg.max_steps),
                              generator=torch.Generator().manual_seed(seed + 5), source="bc_rollout", progress=True)
    st = store_like(EpisodeStore.open(demos, "r"), rollouts, "bc_rollout")
    for e in eps:
        st.append(e)
    merge_stores([demos, rollouts], mixed)
    succ = {t: float(np.mean([e.success for e in eps if e.task_name == t])) for t in task_list}
    return {"episodes": len(eps), "success_per_task": succ, "store": str(rollouts), "mixed_store": str(mixed)}


def _learn_stages(job: _Job) -> dict[str, Any]:
    """Stages 1-4: demos, BC, BC rollouts, world model and critic. Returns their paths and the
    world model's report."""
    S, common, out = job.cfg.stages, job.common, job.out
    demos = out / "collect" / "demos.zarr"
    job.run_entry("collect", job.config("collect", {**common, **to_container(S.collect), "suite": job.suite_cfg,
                                                    "tasks": list(job.tasks), "out": str(demos)}))
    job.run_entry("bc", job.config("bc", {**common, **to_container(S.bc), "store": str(demos)}))
    bc_ckpt = out / "bc" / "checkpoints" / "last"
    mixed = out / "bc_rollouts" / "demos_and_rollouts.zarr"
    job.stages.run("bc_rollouts", OmegaConf.create({**common, **to_container(S.bc_rollouts)}),
                   lambda scfg, sctx: _bc_rollouts(job, demos, bc_ckpt, scfg))
    wm_rep = job.run_entry("worldmodel", job.config("worldmodel", {**common, **to_container(S.worldmodel),
                                                                   "store": str(mixed)}))
    wm_ckpt = out / "worldmodel" / "checkpoints" / "last"
    critic_over = to_container(S.critic) or {}
    critic_over["imagined"] = {**(critic_over.get("imagined") or {}), "world_model": str(wm_ckpt)}
    job.run_entry("critic", job.config("critic", {**common, **critic_over, "store": str(mixed)}))
    return {"bc": bc_ckpt, "mixed": mixed, "worldmodel": wm_ckpt, "critic": out / "critic" / "checkpoints" / "last",
            "wm_report": wm_rep}


def _grpo_config(job: _Job, paths: dict) -> DictConfig:
    S = job.cfg.stages
    return job.config("grpo", {
        **job.common, **to_container(S.grpo), "checkpoint": str(paths["bc"]), "tasks": list(job.tasks),
        "suite": job.suite_cfg,
        "starts": {**(to_container(S.grpo.get("starts", {})) or {}), "store": str(paths["mixed"])},   # keyframes: demos + rollouts
        "refresh": {**(to_container(S.grpo.get("refresh", {})) or {}), "store": str(paths["mixed"])},  # replay: the world model's data
        "env": _calibrated_env(to_container(S.grpo.get("env", {}) or {}), paths.get("wm_report") or {}) |
               {"world_model": str(paths["worldmodel"]), "critic": str(paths["critic"])}})


def _calibrated_env(env: dict, wm_report: dict) -> dict:
    """GRPO's env config with ``imagination.halt_uncertainty: calibrated`` replaced by the world
    model's held-out threshold (``heldout_horizons.halt_uncertainty_tau_m``, m).

    Raises:
        ValueError: ``calibrated`` for a world model whose report has no threshold (no dynamics ensemble,
            or ``eval_horizon_chunks: 0``).
    """
    imag = dict(env.get("imagination") or {})
    if imag.get("halt_uncertainty") != "calibrated":
        return env
    tau = (wm_report.get("heldout_horizons") or {}).get("halt_uncertainty_tau_m")
    if tau is None:
        raise ValueError("stages.grpo.env.imagination.halt_uncertainty=calibrated needs a world model with a dynamics "
                         "ensemble (stage_groups.worldmodel=[\"worldmodel=dynamics\"]) and stages.worldmodel.eval_horizon_chunks > 0; "
                         "or give a number (m)")
    return {**env, "imagination": {**imag, "halt_uncertainty": float(tau)}}


def check_keyframes(check: dict, starts) -> dict:
    """The imagination check's settings (``check``, the pipeline's ``imagination_check``) with its
    keyframes drawn as GRPO draws its own: GRPO's ``starts.store`` and, when set, its
    ``first_steps`` and ``success_fraction`` (unset keys stay out, so earlier runs' check settings
    are unchanged). Without keyframes ``check`` is returned as it is."""
    check = dict(check)
    if int(check.get("keyframes_per_task") or 0) > 0:
        check["store"] = starts.get("store")
        for key in ("first_steps", "success_fraction"):
            if starts.get(key) is not None:
                check[key] = starts[key]
    return check


def _imagination_check(job: _Job, gcfg: DictConfig, bc_ckpt: Path) -> dict | None:
    """Stage 5 (``wmrl imagination-check``), with what it takes from GRPO's config."""
    if not _checks_fidelity(job.cfg):
        return None
    used = {"rl_sampler": gcfg.get("rl_sampler"), "steer": gcfg.get("steer"), "group_size": gcfg.grpo.group_size,
            "max_chunks": gcfg.grpo.max_chunks, "n_init": gcfg.starts.get("n_init"),
            "env": {k: gcfg.env.get(k) for k in ("world_model", "critic", "imagination")}}
    check = check_keyframes(to_container(job.cfg.imagination_check), gcfg.starts)
    c = OmegaConf.create({**job.common, **check, "grpo": to_container(used),
                          "checkpoint": str(bc_ckpt), "suite": job.suite_cfg, "tasks": list(job.tasks)})
    return job.run_entry("imagination_check", c, module="imagination_check")


def _policy_stages(job: _Job, paths: dict) -> dict[str, Any]:
    """Stages 5-8: imagination check, real-sim evaluation before, GRPO in imagination, evaluation after."""
    gcfg = _grpo_config(job, paths)
    fid = _imagination_check(job, gcfg, paths["bc"])
    cfg, nv = job.cfg, int(job.cfg.videos.per_task)
    ev = {**job.common, "suite": job.suite_cfg, "tasks": list(job.tasks), "evaluation": to_container(cfg.evaluation),
          "eval_sampler": to_container(cfg.get("eval_sampler")), "videos_per_task": nv}
    bc_ckpt, grpo_ckpt = paths["bc"], job.out / "grpo" / "checkpoints" / "last"
    before = job.stages.run("eval_before", OmegaConf.create({**ev, "checkpoint": str(bc_ckpt)}),
                            lambda c_, x_: _eval_policy(bc_ckpt, cfg, job.tasks, job.suite, x_.out_dir, nv))
    grep = job.run_entry("grpo", gcfg)
    after = job.stages.run("eval_after", OmegaConf.create({**ev, "checkpoint": str(grpo_ckpt)}),
                           lambda c_, x_: _eval_policy(grpo_ckpt, cfg, job.tasks, job.suite, x_.out_dir, nv))
    return {"fid": fid, "before": before, "grpo": grep, "after": after, "grpo_ckpt": grpo_ckpt}


def _run(cfg: DictConfig, ctx: RunContext) -> dict:
    """:func:`run` with the preset applied and the stage settings checked."""
    job, estimate = _start(cfg, ctx)
    paths = _learn_stages(job)
    res = _policy_stages(job, paths)
    report = _report(job, paths, res)
    report["estimate"] = machine.compare_estimate(estimate, report["total_wall_time_s"])
    if not report["comparable_with_reference"]:
        log.warning("NOT COMPARABLE with the reference figures: %s", "; ".join(report["not_comparable_because"]))
    log.info("success before %.3f -> after %.3f (gain %+.3f)", res["before"]["success"], res["after"]["success"],
             report["success_gain"])
    return report


def _report(job: _Job, paths: dict, res: dict) -> dict[str, Any]:
    """Stage 9: plots, videos and ``report.json``."""
    cfg, out, stages, task_list = job.cfg, job.out, job.stages, list(job.tasks)
    before, after, grep = res["before"], res["after"], res["grpo"]
    plots = {"success_before_after": str(plot_before_after(before, after, out / "success_before_after.png")),
             "imagined_vs_real": str(plot_imagined_vs_real(grep.get("history", []), real_curve(grep, before, after),
                                                            out / "imagined_vs_real.png"))}
    videos = [str(out / "eval_before" / v) for v in before.get("videos", [])] + \
        [str(out / "eval_after" / v) for v in after.get("videos", [])]
    per_task = {t: {"before": before["per_task"][t]["success"], "before_ci95": before["per_task"][t]["ci95"],
                    "after": after["per_task"][t]["success"], "after_ci95": after["per_task"][t]["ci95"],
                    "gain": after["per_task"][t]["success"] - before["per_task"][t]["success"]} for t in task_list}
    history = grep.get("history") or [{}]
    report: dict[str, Any] = {
        "preset": cfg.get("preset"),
        "seed": int(cfg.seed),
        "tasks": task_list,
        "episodes_per_task": int(cfg.evaluation.episodes_per_task),
        "stages": {k: {"wall_time_s": v} for k, v in stages.wall.items()},
        # the pipeline's time: all stages, also those reused on resume (this command's own time is
        # `wall_time_s`, added when the report is written)
        "total_wall_time_s": round(sum(stages.wall.values()), 3),
        "before": {"success": before["success"], "ci95": before["ci95"]},
        "after": {"success": after["success"], "ci95": after["ci95"]},
        "success_gain": after["success"] - before["success"],
        "per_task": per_task,
        "grpo": {"iterations": grep.get("iterations"), "mitigations": grep.get("mitigations"),
                 "refresh": grep.get("refresh"), "steer": grep.get("steer"),
                 "env_counters": grep.get("env_counters"),   # the uncertainty gate's halts, the grasp box's misses
                 "imagined_success_first": history[0].get("success_rate"),
                 "imagined_success_last": history[-1].get("success_rate")},
        "imagination_check": res["fid"],
        "worldmodel_horizons": paths["wm_report"].get("heldout_horizons"),   # held-out fidelity 1..N chunks ahead (true actions)
        "checkpoints": {"bc": str(paths["bc"]), "worldmodel": str(paths["worldmodel"]), "critic": str(paths["critic"]),
                        "grpo": str(res["grpo_ckpt"])},
        "plots": plots,
        "videos": videos,
    }
    report.update(machine.budget_summary(stages.reports))
    report["precision"] = {n: stages.reports.get(n, {}).get("precision") for n in ("bc", "worldmodel", "critic", "grpo")}
    report["threads"] = {"num_threads": job.common["num_threads"], "reason": getattr(job.ctx, "threads_reason", None)}
    return report


@hydra.main(version_base="1.3", config_path="pkg://configs", config_name="pipeline")
def main(cfg: DictConfig) -> None:
    run_main(cfg, run, "pipeline")


if __name__ == "__main__":
    main()
