"""``wmrl bench grpo``: wall-clock time of GRPO in imagination and of GRPO in the simulator to reach the
same real-sim success, and their ratio.

Both runs start from the same policy checkpoint (``configs/bench_grpo.yaml``: ``post_train`` overrides
common to both, deep-merged with per-env overrides; by default the pipeline's GRPO in imagination and
iterated filtered BC with task-balanced batches in the sim, issue 21's recipes), are evaluated on the same held-out
init states every ``evaluation.every`` iterations, and the time counted is the training time
(rollouts + updates; evaluation excluded) until the first evaluation at or above the target success.
The target is ``target_success`` if given, else the lower of the two runs' best real-sim success
(the highest success both reach). Figures are printed and written to ``report.json``.
"""

from __future__ import annotations

import logging
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from wmrl.run.common import RunContext, run_main

log = logging.getLogger("wmrl.bench_grpo")


def time_to_success(history: list[dict], evals: list[dict], target: float) -> tuple[float | None, int | None]:
    """Training seconds (sum of ``history[i]["wall_s"]``) up to the first evaluation whose real-sim
    success is ``>= target``; ``(None, None)`` when never reached. Evaluation at iteration 0 counts as
    0 s. World-model refresh rounds (``refresh/wall_s``: real rollouts and fine-tuning) count as
    training time."""
    for e in sorted(evals, key=lambda e: e["iteration"]):
        if e["success"] >= target - 1e-9:
            n = int(e["iteration"])
            return float(sum(h["wall_s"] + h.get("refresh/wall_s", 0.0) for h in history if h["iteration"] <= n)), n
    return None, None


def compare(runs: dict[str, dict], target: float | None = None) -> dict[str, Any]:
    """``runs``: env name -> post-train report (``history``, ``evals``). Returns the target, time and
    iteration to reach it per env, and ``ratio = time_sim / time_imagination``."""
    best = {k: max(e["success"] for e in r["evals"]) for k, r in runs.items()}
    start = max(r["evals"][0]["success"] for r in runs.values())
    if target is None:
        target = min(best.values())
        if target <= start:  # nobody improved: the comparison is empty, say so
            target = None
    out: dict[str, Any] = {"target_success": target, "best_success": best, "start_success": start}
    for k, r in runs.items():
        t, n = (None, None) if target is None else time_to_success(r["history"], r["evals"], target)
        out[k] = {"time_s": t, "iteration": n,
                  "s_per_iteration": float(sum(h["wall_s"] + h.get("refresh/wall_s", 0.0) for h in r["history"])
                                           / max(1, len(r["history"])))}
    ti, ts = out.get("imagination", {}).get("time_s"), out.get("sim", {}).get("time_s")
    out["ratio_sim_over_imagination"] = (ts / ti) if (ti and ts) else None
    out["iteration_time_ratio"] = (out["sim"]["s_per_iteration"] / out["imagination"]["s_per_iteration"]
                                   if "sim" in out and "imagination" in out and out["imagination"]["s_per_iteration"] else None)
    return out


def run_overrides(cfg: DictConfig, env_name: str, path=lambda p: p) -> dict[str, Any]:
    """The ``post_train`` overrides of one of the two runs: for the imagination run with
    ``cfg.pipeline_grpo``, ``configs/pipeline.yaml``'s ``stages.grpo``; over it ``cfg.post_train`` and
    ``cfg[env_name]`` (``"imagination"`` or ``"sim"``), deep-merged, plus the checkpoints; the imagination run also
    gets the world model, the critic and ``cfg.store`` for its keyframe starts. ``path`` resolves
    paths (the run context's). Raises ``ValueError`` when the imagination run asks for keyframe starts
    and no ``store`` is given."""
    base = OmegaConf.create({"seed": cfg.seed, "num_threads": cfg.num_threads, "device": cfg.device,
                             "checkpoint": str(path(cfg.checkpoint))})
    recipe = {}
    if env_name == "imagination" and cfg.get("pipeline_grpo"):
        from wmrl.run.stages import compose_stage_config

        recipe = compose_stage_config("pipeline").stages.grpo
    over = OmegaConf.merge(base, recipe, cfg.get("post_train") or {}, cfg.get(env_name) or {})
    if env_name == "imagination":
        over = OmegaConf.merge(over, {"env": {"world_model": str(path(cfg.wm_checkpoint)),
                                              "critic": str(path(cfg.critic_checkpoint))}})
        if cfg.get("store"):
            over = OmegaConf.merge(over, {"starts": {"store": str(path(cfg.store))}})
        elif OmegaConf.select(over, "starts.keyframes_per_task", default=0) and not OmegaConf.select(over, "starts.store"):
            raise ValueError("wmrl bench grpo: the imagination run starts from keyframes "
                             f"(imagination.starts.keyframes_per_task={over.starts.keyframes_per_task}) but no store is "
                             "given: add store=<pipeline run>/bc_rollouts/demos_and_rollouts.zarr, or "
                             "imagination={starts: {keyframes_per_task: 0}}")
    return OmegaConf.to_container(over, resolve=True)


def run(cfg: DictConfig, ctx: RunContext) -> dict:
    from wmrl.run import grpo_job
    from wmrl.run.stages import compose_stage_config

    reports = {}
    for env_name in ("imagination", "sim"):
        over = run_overrides(cfg, env_name, ctx.path)
        sub_cfg = compose_stage_config("post_train", over, groups=[f"env={env_name}"])
        sub = ctx.child(env_name, sub_cfg)
        rep = grpo_job.run(sub_cfg, sub)
        sub.finish(rep)
        reports[env_name] = rep
    res = compare(reports, cfg.get("target_success"))
    lines = [f"GRPO to reach real-sim success {res['target_success']}:"]
    for k in ("imagination", "sim"):
        r = res[k]
        lines.append(f"  {k:<12} time {r['time_s']} s (iteration {r['iteration']}), {r['s_per_iteration']:.2f} s/iteration, "
                     f"best success {res['best_success'][k]:.3f}")
    lines.append(f"  ratio sim / imagination: {res['ratio_sim_over_imagination']}  "
                 f"(per iteration: {res['iteration_time_ratio']})")
    print("\n".join(lines))
    return {**res, "runs": {k: {"evals": r["evals"], "train_wall_s": r["train_wall_s"]} for k, r in reports.items()}}


@hydra.main(version_base="1.3", config_path="pkg://configs", config_name="bench_grpo")
def main(cfg: DictConfig) -> None:
    run_main(cfg, run, "bench grpo")


if __name__ == "__main__":
    main()
