"""``wmrl pipeline suite=libero_<name>``: the loop on the original LIBERO suites (issue #22; not an
entry point: ``wmrl.run.pipeline.run`` calls :func:`run` when the suite is a LIBERO one).

Stages (each in its own sub-directory of the run with ``config.yaml`` / ``report.json``; resumed like
the main pipeline's, :class:`wmrl.run.stages.Stages`):

1. ``collect``     the scripted libero_object expert (``scripts/libero_expert.py``, privileged object and
   basket poses) on ``libero.demos.placements`` object placements per task drawn by the env's own
   sampler (never an official init state: those are the evaluation's), both cameras at
   ``libero.image_size``, in ``libero.demos.workers`` processes of the LIBERO environment, merged into
   ``collect/demos.zarr``. Its expert success and the LIBERO sim's control steps/s (one process,
   cameras rendered, no network in the loop) are in its report.
2. ``bc``          ``wmrl train-policy`` on the successful demos.
3. ``worldmodel`` / ``critic``  ``wmrl train-worldmodel`` / ``train-critic`` on the demos.
4. ``eval_before`` the BC policy on the official init states ``libero.inits`` of the tasks, deployed
   to LIBERO env workers through the robot bridge (``wmrl.run.libero_eval``).
5. ``grpo``        GRPO in imagination (``wmrl post-train env=imagination``), its starts the first
   frames of the demos (``starts.per_task=0``, ``starts.first_steps=1``): nothing of LIBERO is used.
6. ``eval_after``  the GRPO policy on the same official init states.
7. ``report.json`` success per task before / after with Wilson 95 % intervals, each stage's time, and
   imagination's control steps/s beside the LIBERO sim's (``speed``), measured in this run;
   ``success_before_after.png``.

Example (3 tasks, 20 placements of demos per task, 20 official init states each)::

    wmrl pipeline suite=libero_object libero.tasks=[0,2,4]
"""

from __future__ import annotations

import json
import logging
import subprocess
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from wmrl.rl.evaluate import wilson_interval
from wmrl.run.common import RunContext
from wmrl.run.stages import Stages, module_run, stage_config, to_container

log = logging.getLogger("wmrl.pipeline.libero")
REPO = Path(__file__).resolve().parents[2]
ORDER = ("collect", "bc", "worldmodel", "critic", "eval_before", "grpo", "eval_after")


def _split(items: list, n: int) -> list[list]:
    return [items[i::n] for i in range(n) if items[i::n]]


def collect_demos(cfg: DictConfig, ctx: RunContext, py: Path, task_indices: list[int]) -> dict:
    """Stage 1: the scripted expert on sampled placements, in ``libero.demos.workers`` LIBERO processes
    (placements dealt round-robin), merged into ``ctx.out_dir/demos.zarr``.

    Raises:
        RuntimeError: a collection process failed (its log's tail in the message).
    """
    from wmrl.run.data import merge_stores

    L = cfg.libero
    n, workers = int(L.demos.placements), max(1, int(L.demos.workers))
    size = [int(L.image_size[0]), int(L.image_size[1])]
    parts = _split(list(range(n)), workers)
    procs = []
    from wmrl.run.libero_eval import _worker_env

    for w, ks in enumerate(parts):
        out = ctx.out_dir / f"worker{w}"
        out.mkdir(parents=True, exist_ok=True)
        args = [str(py), str(REPO / "scripts" / "libero_expert.py"), "--tasks", ",".join(map(str, task_indices)),
                "--inits", ",".join(map(str, ks)), "--placement", "sampled", "--seed", str(int(cfg.seed)),
                "--size", str(size[0]), str(size[1]), "--store", str(out / "demos.zarr"), "--out", str(out / "expert.json")]
        f = open(out / "expert.log", "w")  # noqa: SIM115 - closed below
        procs.append((subprocess.Popen(args, cwd=REPO, env=_worker_env(), stdout=f, stderr=subprocess.STDOUT), f, out))
        log.info("collect: expert process %d (pid %d) on %d placements x %d tasks", w, procs[-1][0].pid, len(ks),
                 len(task_indices))
    for p, f, out in procs:
        rc = p.wait()
        f.close()
        if rc != 0:
            tail = "\n".join((out / "expert.log").read_text(errors="replace").strip().splitlines()[-8:])
            raise RuntimeError(f"the LIBERO expert process in {out} failed (exit status {rc}):\n{tail}")
    reps = [json.loads((out / "expert.json").read_text()) for _, _, out in procs]
    rows = [r for rep in reps for r in rep["episodes"]]
    merged = merge_stores([out / "demos.zarr" for _, _, out in procs], ctx.out_dir / "demos.zarr", "scripted:libero_object")
    per_task: dict[str, list[bool]] = {}
    for r in rows:
        per_task.setdefault(r["task"], []).append(bool(r["success"]))
    steps = sum(int(r["steps"]) for r in rows)
    proc_s = sum(float(rep["time_s"]) for rep in reps)
    return {"placement": "sampled (the env's own sampler; no official init state)", "episodes": len(rows),
            "expert_success": {t: {"successes": sum(v), "episodes": len(v), "ci95": list(wilson_interval(sum(v), len(v)))}
                               for t, v in per_task.items()},
            "store": merged["path"], "control_steps": steps, "process_seconds": round(proc_s, 1),
            "libero_steps_per_s_per_process": steps / max(proc_s, 1e-9), "image_size": size, "workers": len(procs)}


def _eval(cfg: DictConfig, ctx: RunContext, checkpoint: Path, tasks: list) -> dict:
    from wmrl.run.libero_eval import run_libero

    L = cfg.libero
    suite = to_container(cfg.suite)
    suite["inits"] = [int(k) for k in L.inits]
    suite["image_size"] = [int(L.image_size[0]), int(L.image_size[1])]
    suite["frames"] = str(L.get("frames", "every_step"))
    if L.get("request_threshold") is not None:
        suite["worker_overrides"] = list(suite.get("worker_overrides") or []) + [
            f"control.request_threshold={int(L.request_threshold)}"]
    ecfg = OmegaConf.create({"suite": suite, "checkpoint": str(checkpoint), "tasks": tasks, "seed": int(cfg.seed),
                             "workers": int(L.workers), "device": str(cfg.device),
                             "videos_per_task": int(cfg.videos.per_task), "video_camera": "agentview"})
    return run_libero(ecfg, ctx)


def grpo_overrides(stages_cfg: DictConfig, libero_cfg: DictConfig) -> dict:
    """``libero.grpo`` merged over ``stages.grpo`` as a plain dict (the composed config is in struct
    mode, where ``libero.grpo`` may add keys ``stages.grpo`` does not have, e.g. ``starts.first_steps``)."""
    return to_container(OmegaConf.merge(OmegaConf.create(to_container(stages_cfg.get("grpo") or {})),
                                        OmegaConf.create(to_container(libero_cfg.get("grpo") or {}))))


def _imagination_speed(cfg: DictConfig, wm_ckpt: Path, critic_ckpt: Path, store: Path, tasks: dict) -> dict:
    """Imagined control steps/s of this run's world model + critic (batch ``libero.speed.batch_size``,
    random chunks from the demos' first frames; ``wmrl bench imagination``'s measurement, ``wmrl.run.measure``)."""
    import torch

    from wmrl.imagination import ImaginationEnv
    from wmrl.kernel.checkpoint import load_checkpoint
    from wmrl.rl.starts import KeyframeStarts
    from wmrl.run.measure import random_chunks, timed_chunks

    wm = load_checkpoint(wm_ckpt, map_location=str(cfg.device)).eval()
    critic = load_checkpoint(critic_ckpt, map_location=str(cfg.device)).eval()
    B, H, D = int(cfg.libero.speed.batch_size), int(wm.chunk_size), int(wm.action_dim)
    first = KeyframeStarts(store, tasks, per_task=1, seed=int(cfg.seed), first_steps=1)
    starts = [s for i in range(B) for s in first(i)][:B]
    env = ImaginationEnv(wm, critic, num_envs=B, max_chunks=10 ** 6, success_threshold=2.0, seed=int(cfg.seed))
    with torch.no_grad():
        timed_chunks(env, starts, random_chunks(1, B, H, D, int(cfg.seed) + 1))
        sec, steps = timed_chunks(env, starts, random_chunks(int(cfg.libero.speed.chunks), B, H, D, int(cfg.seed) + 2))
    return {"control_steps": steps, "seconds": round(sec, 3), "steps_per_s": steps / sec, "batch_size": B,
            "threads": torch.get_num_threads()}


def _rates(rep: dict) -> dict:
    return {t: {"success": v["success_rate"], "ci95": v["ci95"], "successes": v["successes"], "episodes": v["episodes"]}
            for t, v in rep["per_task"].items()}


def run(cfg: DictConfig, ctx: RunContext) -> dict:
    """The loop on a LIBERO suite (see the module docstring). Returns the report.

    Raises:
        ValueError: no LIBERO environment (run ``bash scripts/setup_libero.sh``), a task the suite does not
            have, or ``libero.tasks`` not of libero_object (the scripted expert's suite).
    """
    from wmrl.run.libero_eval import libero_python, plan_episodes

    if str(cfg.suite.name) != "libero_object":
        raise ValueError(f"wmrl pipeline on LIBERO collects its demos with the libero_object scripted expert; "
                         f"suite={cfg.suite.name} has no expert (use suite=libero_object)")
    py = libero_python(cfg.suite)
    L = cfg.libero
    plan = plan_episodes(py, str(cfg.suite.name), list(L.tasks), [0])
    task_idx = [e["task_index"] for e in plan]
    tasks = {e["task"]: e["instruction"] for e in plan}
    saved = OmegaConf.to_container(cfg, resolve=True)
    saved.pop("presets", None)
    (ctx.out_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(saved)))
    stages = Stages(ctx, resume=bool(cfg.resume), order=list(ORDER))
    common = {"seed": int(cfg.seed), "num_threads": int(getattr(ctx, "num_threads", 0) or 0), "device": cfg.device}
    S, out = cfg.stages, ctx.out_dir
    demos = out / "collect" / "demos.zarr"

    stages.run("collect", OmegaConf.create({**common, "libero": to_container(L), "tasks": task_idx}),
               lambda c_, x_: collect_demos(cfg, x_, py, task_idx))

    def entry(stage: str, over: dict) -> dict:
        return stages.run(stage, stage_config(cfg, stage, over), module_run({"bc": "train_policy",
                                                                            "worldmodel": "train_worldmodel",
                                                                            "critic": "train_critic",
                                                                            "grpo": "post_train"}[stage]))

    entry("bc", {**common, **to_container(S.bc), "store": str(demos), "only_successful": True})
    bc_ckpt = out / "bc" / "checkpoints" / "last"
    # the world model and critic take LIBERO's frame size and proprio (8-D) from the demos' store
    from wmrl.kernel.storage import EpisodeStore

    st = EpisodeStore.open(demos, mode="r")
    shape = {"image_size": int(next(iter(st.cameras.values()))[0]), "state_dim": int(st.state_dim)}
    wm_over = to_container(OmegaConf.merge({"worldmodel": shape}, S.worldmodel or {}))
    wm_rep = entry("worldmodel", {**common, **wm_over, "store": str(demos)})
    wm_ckpt = out / "worldmodel" / "checkpoints" / "last"
    critic_over = to_container(OmegaConf.merge({"critic": shape}, S.critic or {})) or {}
    critic_over["imagined"] = {**(critic_over.get("imagined") or {}), "world_model": str(wm_ckpt)}
    entry("critic", {**common, **critic_over, "store": str(demos)})
    critic_ckpt = out / "critic" / "checkpoints" / "last"

    ev = {**common, "libero": to_container(L), "tasks": task_idx}
    before = stages.run("eval_before", OmegaConf.create({**ev, "checkpoint": str(bc_ckpt)}),
                        lambda c_, x_: _eval(cfg, x_, bc_ckpt, task_idx))
    g = grpo_overrides(S, L)
    grpo_cfg = {**common, **g, "checkpoint": str(bc_ckpt), "tasks": tasks, "suite": None,
                "starts": {**(g.get("starts") or {}), "store": str(demos)},
                "refresh": {**(g.get("refresh") or {}), "every": 0}, "evaluation": {"episodes_per_task": 0},
                "env": {**(g.get("env") or {}), "world_model": str(wm_ckpt), "critic": str(critic_ckpt),
                        "context_starts": False}}
    grep = entry("grpo", grpo_cfg)
    grpo_ckpt = out / "grpo" / "checkpoints" / "last"
    after = stages.run("eval_after", OmegaConf.create({**ev, "checkpoint": str(grpo_ckpt)}),
                       lambda c_, x_: _eval(cfg, x_, grpo_ckpt, task_idx))

    col = stages.reports["collect"]
    imag = _imagination_speed(cfg, wm_ckpt, critic_ckpt, demos, tasks)
    lib_sps = float(col["libero_steps_per_s_per_process"])
    b, a = _rates(before), _rates(after)
    per_task = {t: {"before": b[t]["success"], "before_ci95": b[t]["ci95"], "after": a[t]["success"],
                    "after_ci95": a[t]["ci95"], "gain": a[t]["success"] - b[t]["success"]} for t in b}
    history = grep.get("history") or [{}]
    report: dict[str, Any] = {
        "suite": str(cfg.suite.name), "seed": int(cfg.seed), "tasks": tasks, "official_inits": [int(k) for k in L.inits],
        "demos": {"placements_per_task": int(L.demos.placements), "expert_success": col["expert_success"]},
        "stages": {k: {"wall_time_s": v} for k, v in stages.wall.items()},
        "total_wall_time_s": round(sum(stages.wall.values()), 3),
        "before": before["overall"], "after": after["overall"],
        "success_gain": after["overall"]["success_rate"] - before["overall"]["success_rate"],
        "per_task": per_task,
        "grpo": {"iterations": grep.get("iterations"), "imagined_success_first": history[0].get("success_rate"),
                 "imagined_success_last": history[-1].get("success_rate")},
        "worldmodel_horizons": wm_rep.get("heldout_horizons"),
        "speed": {"libero_steps_per_s_per_process": lib_sps, "imagination_steps_per_s": imag["steps_per_s"],
                  "imagination_over_libero": imag["steps_per_s"] / max(lib_sps, 1e-9), "imagination": imag,
                  "libero": "scripted expert in one LIBERO process, both cameras at libero.image_size (collect stage)"},
        "checkpoints": {"bc": str(bc_ckpt), "worldmodel": str(wm_ckpt), "critic": str(critic_ckpt), "grpo": str(grpo_ckpt)},
    }
    try:
        from wmrl.run.figures import plot_before_after

        report["plots"] = {"success_before_after": str(plot_before_after(
            {"per_task": {t: {"success": v["before"], "ci95": v["before_ci95"]} for t, v in per_task.items()},
             "success": report["before"]["success_rate"], "ci95": report["before"]["ci95"]},
            {"per_task": {t: {"success": v["after"], "ci95": v["after_ci95"]} for t, v in per_task.items()},
             "success": report["after"]["success_rate"], "ci95": report["after"]["ci95"]},
            out / "success_before_after.png", title=f"{cfg.suite.name}: official init states, 95 % Wilson CI"))}
    except (ImportError, KeyError, ValueError) as e:  # a plot must not lose the figures
        log.warning("no before/after plot: %s", e)
    log.info("LIBERO %s: success %.3f -> %.3f (gain %+.3f); imagination %.0f vs LIBERO %.1f control steps/s (%.0fx)",
             cfg.suite.name, report["before"]["success_rate"], report["after"]["success_rate"], report["success_gain"],
             imag["steps_per_s"], lib_sps, report["speed"]["imagination_over_libero"])
    return report

