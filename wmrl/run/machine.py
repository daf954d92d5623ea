"""What this machine is and how long the default pipeline takes on it (``wmrl doctor``, and the
pipeline's start-up estimate). A helper of the composition roots, not an entry point.

:func:`calibrate` times one unit of each kind of work the pipeline does, at the pipeline's own
sizes and precision (about 10-15 s): a simulator control step with the suite's cameras rendered,
a BC step, a world-model training step, a critic step, an imagined chunk per rollout (world model +
critic) and a policy action chunk per environment. :func:`estimate_pipeline` turns them into a
time per stage: ``k_stage * units(stage config) * unit cost(calibration)``, where the work units
come from the stage settings (steps, episodes x step limits, rollouts x chunks) and ``k_stage``
(what a stage spends beyond its units: data loading, evaluation, checkpoints, several workers) was
fitted once from a measured default run and its own calibration on the reference CPU
(:data:`REFERENCE`). On another machine the unit costs change and ``k`` is kept.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import time
from typing import Any, Callable

import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("wmrl.machine")

# A default `wmrl pipeline` (seed 1) and the calibration it printed at its start, on the reference
# machine: Intel Xeon (Sapphire Rapids), 2 cores, AVX-512 with AVX512_BF16 and AMX, 24 GiB; bf16
# autocast for BC and the world model. REFERENCE[stage] = (measured wall s, work units, unit cost s)
# from that run's report.json ("stages", "estimate.units", "estimate.calibration"); k = time / (units * cost).
# (`python -m wmrl.run.machine REPORT.json` prints these rows from a run's report.)
REFERENCE_RUN = "default pipeline at 13799a3, seed 1, 1650 s, on the reference CPU above"
REFERENCE: dict[str, tuple[float, float, float]] = {
    "collect": (112.2, 10800.0, 0.0249571),
    "bc": (204.0, 3600.0, 0.0587701),
    "bc_rollouts": (56.7, 3840.0, 0.0249571),
    "worldmodel": (599.7, 700.0, 0.259982),
    "critic": (162.6, 1600.0, 0.0494175),
    "imagination_check": (202.4, 1872.0, 0.00426332),
    "eval_before": (125.8, 18000.0, 0.0249571),
    "grpo": (95.6, 18720.0, 0.00426332),
    "eval_after": (91.0, 18000.0, 0.0249571),
}


@contextlib.contextmanager
def _rng_kept():
    """Run a block without touching the global torch / numpy / random generators."""
    py, npst = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(npst)


def _median_s(fn: Callable[[], Any], runs: int, warmup: int = 1) -> float:
    """Median seconds of ``fn()`` (``wmrl.run.measure.time_ms``, which gives milliseconds)."""
    from wmrl.run.measure import time_ms

    return float(np.median(time_ms(fn, runs, warmup))) / 1000.0


def pipeline_suite(cfg: DictConfig):
    """The suite the pipeline ``cfg`` runs (its ``suite`` with its ``tasks``)."""
    sc = OmegaConf.to_container(cfg.suite, resolve=True)
    sc["tasks"] = list(cfg.tasks)
    return instantiate(sc)


def _stage_config(cfg: DictConfig, name: str) -> DictConfig:
    """Stage ``name``'s config as the pipeline ``cfg`` runs it (``stages.<name>`` merged on)."""
    from wmrl.run.stages import stage_config

    return stage_config(cfg, name, OmegaConf.to_container(cfg.stages.get(name) or {}, resolve=True))


def calibrate(cfg: DictConfig, progress: Callable[[str], None] | None = None, suite=None) -> dict[str, float]:
    """Seconds per unit of work at the pipeline config ``cfg``'s sizes and precision, on this machine
    with the current torch thread count, timed by the benchmarks' own pieces (``wmrl.run.measure``).
    ``suite``: the pipeline's (:func:`pipeline_suite` when ``None``). Leaves the global RNGs as they were.

    Returns ``{"sim_step_s", "bc_step_s", "wm_step_s", "critic_step_s", "imagine_per_rollout_s",
    "policy_per_env_s", "policy_sde_per_rollout_s", "calibration_s"}``.
    """
    from wmrl.run.measure import sim_rates

    say = progress or (lambda s: None)
    t_start = time.perf_counter()
    out: dict[str, float] = {}
    with _rng_kept(), torch.no_grad():
        suite = suite if suite is not None else pipeline_suite(cfg)
        say("simulator step (rendered)")
        sim = sim_rates(suite, suite.task_names[0], suite.cameras, dataclasses.asdict(suite.render), 40, 5)
        out["sim_step_s"] = 1.0 / sim["steps_per_s"]
    with _rng_kept():
        say("BC step")
        policy = _time_bc(cfg, suite, out)
    with _rng_kept():
        say("world-model step")
        wm = _time_world_model(cfg, out, suite)
    with _rng_kept():
        say("critic step")
        critic = _time_critic(cfg, out)
    with _rng_kept(), torch.no_grad():
        say("imagined chunk")
        _time_imagination(cfg, policy, wm, critic, out)
    out["calibration_s"] = time.perf_counter() - t_start
    return out


def _time_bc(cfg: DictConfig, suite, out: dict[str, float]):
    """``bc_step_s`` and ``policy_per_env_s`` into ``out``; returns the (eval-mode) policy."""
    from wmrl.kernel.precision import resolve_bf16
    from wmrl.run.measure import bc_step_fn, policy_for_bench, random_obs

    bc = _stage_config(cfg, "bc")
    policy, _ = policy_for_bench(OmegaConf.create({"policy": OmegaConf.to_container(bc.policy, resolve=True),
                                               "cameras": list(suite.cameras), "image_size": list(suite.image_size),
                                               "state_dim": suite.state_dim, "action_dim": suite.action_space.dim,
                                               "action_space": suite.action_space.to_dict()}))
    b = int(bc.train.batch_size)
    prec = resolve_bf16(bc.train.get("bf16", "auto"), "cpu", "BC")
    out["bc_step_s"] = _median_s(bc_step_fn(policy, b, prec.bf16, "cpu"), 5, 2)
    policy.eval()
    with torch.no_grad():
        ne = int(cfg.evaluation.num_envs)
        oe = random_obs(policy, ne)
        out["policy_per_env_s"] = _median_s(lambda: policy.sample(oe), 3) / ne
    return policy


def _time_world_model(cfg: DictConfig, out: dict[str, float], suite):
    """``wm_step_s`` into ``out``; returns the world model (action space: the suite's, as the
    pipeline's store will have it)."""
    from types import SimpleNamespace

    from wmrl.run.data import fill_action_space

    wmc = _stage_config(cfg, "worldmodel")
    wcfg = OmegaConf.to_container(wmc.worldmodel, resolve=True)
    fill_action_space(wcfg, SimpleNamespace(action_space=suite.action_space, action_dim=suite.action_space.dim))
    wm = instantiate(wcfg, _convert_="all")
    wm.set_norm_stats(torch.randn(16, wm.state_dim), torch.randn(16, wm.state_dim))
    bw = int(wmc.train.batch_size)
    ch = 3 * len(wm.cameras)
    hw = wm.image_size
    f0 = torch.randint(0, 256, (bw, ch, *hw), dtype=torch.uint8)
    f1 = torch.randint(0, 256, (bw, ch, *hw), dtype=torch.uint8)
    pr, a = torch.randn(bw, wm.state_dim), torch.rand(bw, wm.chunk_size, wm.action_dim) * 2 - 1
    wopt = torch.optim.AdamW(wm.parameters(), lr=1e-4)
    wm.train()

    def wm_step():
        loss = wm.loss(f0, pr, a, f1, pr)["loss"]
        wopt.zero_grad(set_to_none=True)
        loss.backward()
        wopt.step()

    out["wm_step_s"] = _median_s(wm_step, 2, 1)
    return wm


def _time_critic(cfg: DictConfig, out: dict[str, float]):
    """``critic_step_s`` into ``out``; returns the critic."""
    cc = _stage_config(cfg, "critic")
    ccfg = OmegaConf.to_container(cc.critic, resolve=True)
    ccfg["text_encoder"] = "none"   # embeddings are cached per instruction in use
    critic = instantiate(ccfg, _convert_="all")
    if critic.use_proprio:
        critic.set_norm_stats(torch.randn(16, critic.state_dim))
    bc_ = int(cc.train.batch_size)
    size = (critic.image_size,) * 2 if isinstance(critic.image_size, int) else critic.image_size
    fr = torch.randint(0, 256, (bc_, 3 * len(critic.cameras), *size), dtype=torch.uint8)
    pp, tg = torch.randn(bc_, critic.state_dim), torch.rand(bc_)
    copt = torch.optim.AdamW(critic.parameters(), lr=1e-4)
    critic.train()

    def critic_step():
        loss = critic.loss(fr, pp, ["lift the red cube"] * bc_, tg, (tg > 0.5).float())["loss"]
        copt.zero_grad(set_to_none=True)
        loss.backward()
        copt.step()

    out["critic_step_s"] = _median_s(critic_step, 4, 1)
    return critic


def _time_imagination(cfg: DictConfig, policy, wm, critic, out: dict[str, float]) -> None:
    """``imagine_per_rollout_s`` and ``policy_sde_per_rollout_s`` (GRPO's RL sampler) into ``out``."""
    from wmrl.run.builders import using_sampler
    from wmrl.run.measure import random_obs

    g = _stage_config(cfg, "grpo")
    nb = int(g.env.num_envs)
    wm.eval()
    critic.eval()
    ctx = random_obs(wm, nb)
    state = wm.init(ctx)
    acts = torch.rand(nb, wm.chunk_size, wm.action_dim) * 2 - 1

    def imagine():
        _, pred = wm.imagine(state, acts)
        critic.evaluate(pred)

    out["imagine_per_rollout_s"] = _median_s(imagine, 2, 1) / nb
    sampler = instantiate(g.rl_sampler) if g.get("rl_sampler") else None
    op = random_obs(policy, nb)
    with using_sampler(policy, sampler):
        out["policy_sde_per_rollout_s"] = _median_s(lambda: policy.sample(op), 2, 1) / nb


def imagination_check_starts(check) -> int:
    """Starts per task of the pipeline's ``imagination_check`` config (init states + keyframes); 0 skips it."""
    check = check or {}
    return int(check.get("starts_per_task", 0) or 0) + int(check.get("keyframes_per_task", 0) or 0)


def work_units(cfg: DictConfig, suite=None) -> dict[str, dict[str, float]]:
    """Per stage, the work units it plans (``units``) and the calibration keys whose per-unit sum is
    its unit cost (``costs``), from the pipeline config ``cfg`` (stage settings as the pipeline merges
    them onto the stage configs' defaults where it leaves them out)."""
    suite = suite if suite is not None else pipeline_suite(cfg)
    tasks = list(cfg.tasks)
    limits = [suite.task(t).max_steps for t in tasks]

    col, bc, wm, cr, g = (_stage_config(cfg, n) for n in ("collect", "bc", "worldmodel", "critic", "grpo"))
    br = cfg.stages.bc_rollouts
    ev, ic = cfg.evaluation, cfg.get("imagination_check") or {}
    chunk = int(g.grpo.get("max_chunks", 12))
    units = {
        "collect": (int(col.episodes_per_task) * sum(limits), ("sim_step_s",)),
        "bc": (int(bc.steps), ("bc_step_s",)),
        "bc_rollouts": (int(br.episodes_per_task) * len(tasks) * int(br.max_steps), ("sim_step_s",)),
        "worldmodel": (int(wm.train.steps), ("wm_step_s",)),
        "critic": (int(cr.train.steps), ("critic_step_s",)),
        "imagination_check": (imagination_check_starts(ic) * len(tasks) * int(g.grpo.group_size) * chunk,
                              ("imagine_per_rollout_s", "policy_sde_per_rollout_s")),
        "eval_before": (int(ev.episodes_per_task) * sum(limits), ("sim_step_s",)),
        "grpo": (int(g.iterations) * int(g.env.num_envs) * chunk, ("imagine_per_rollout_s", "policy_sde_per_rollout_s")),
        "eval_after": (int(ev.episodes_per_task) * sum(limits), ("sim_step_s",)),
    }
    return {k: {"units": float(u), "costs": list(c)} for k, (u, c) in units.items()}


def estimate_pipeline(cfg: DictConfig, calib: dict[str, float], suite=None) -> dict[str, Any]:
    """Estimated wall time of the pipeline ``cfg`` on the machine ``calib`` was measured on.

    Returns ``{"total_s", "stages": {stage: s}, "units": {...}, "calibration": calib, "reference": ...}``;
    ``total_s`` is ``None`` (with a reason) while :data:`REFERENCE` holds no fitted run."""
    units = work_units(cfg, suite)
    stages: dict[str, float] = {}
    missing = []
    for name, u in units.items():
        cost = sum(calib[c] for c in u["costs"])
        ref = REFERENCE.get(name)
        if ref is None:
            missing.append(name)
            continue
        t_ref, u_ref, c_ref = ref
        k = t_ref / max(u_ref * c_ref, 1e-12)
        stages[name] = k * u["units"] * cost
    out: dict[str, Any] = {"units": units, "calibration": calib, "reference": REFERENCE_RUN}
    if missing:
        out.update(total_s=None, stages=stages, missing=missing,
                   why=f"no reference figures for {', '.join(missing)} (wmrl.run.machine.REFERENCE)")
        return out
    out.update(total_s=float(sum(stages.values()) + calib.get("calibration_s", 0.0)),
               stages={k: round(v, 1) for k, v in stages.items()})
    return out


def unit_cost(units: dict, calib: dict, name: str) -> float:
    """The per-unit cost of stage ``name`` (sum of its calibration keys)."""
    return float(sum(calib[c] for c in units[name]["costs"]))


def budget_summary(reports: dict[str, dict]) -> dict[str, Any]:
    """Steps done of steps planned for every training stage of a pipeline (``reports``: stage ->
    report), and whether a time cap cut any short: then the run is not comparable with the reference
    figures, which ran every planned step. Returns ``budgets``, ``comparable_with_reference`` and
    ``not_comparable_because`` (one line per stage cut)."""
    budgets = {n: {"steps": reports[n].get("steps"), "steps_planned": reports[n].get("steps_planned"),
                   "cut_by_budget": bool(reports[n].get("cut_by_budget", False))}
               for n in ("bc", "worldmodel", "critic") if n in reports}
    why = [f"{n} ran {b['steps']} of {b['steps_planned']} planned steps (its time budget)"
           for n, b in budgets.items() if b["cut_by_budget"]]
    return {"budgets": budgets, "comparable_with_reference": not why, "not_comparable_because": why}


def announce_estimate(cfg: DictConfig, suite=None) -> dict | None:
    """Calibrate this machine for the pipeline ``cfg`` and log its estimated time; ``None`` (with a
    warning) if the calibration fails, which never stops a run."""
    try:
        log.info("calibrating this machine for a time estimate (estimate=false skips it) ...")
        est = estimate_pipeline(cfg, calibrate(cfg, suite=suite), suite)
    except Exception as e:  # an estimate is advice
        log.warning("time estimate skipped: calibration failed (%s: %s)", type(e).__name__, e)
        return None
    if est.get("total_s"):
        parts = ", ".join(f"{k} {v:.0f}" for k, v in est["stages"].items())
        log.info("estimated pipeline time on this machine: %.1f min (%s s)", est["total_s"] / 60, parts)
    else:
        log.info("no time estimate: %s", est.get("why"))
    return est


def compare_estimate(est: dict | None, stages_s: float) -> dict | None:
    """``est`` with the measured time added: ``measured_total_s`` (the stages' wall time plus the
    calibration's) and ``estimate_over_measured``."""
    if est is None:
        return None
    est = dict(est)
    est["measured_total_s"] = round(stages_s + float(est["calibration"].get("calibration_s", 0.0)), 1)
    if est.get("total_s"):
        est["estimate_over_measured"] = round(est["total_s"] / max(est["measured_total_s"], 1e-9), 3)
    return est


def reference_from_report(report: dict) -> dict[str, tuple[float, float, float]]:
    """:data:`REFERENCE` entries from a default pipeline's ``report.json`` (its ``stages`` wall times and
    the ``estimate`` block with ``units`` and ``calibration`` it recorded at its start)."""
    est = report.get("estimate") or {}
    if not est.get("units") or not est.get("calibration"):
        raise ValueError("the report has no estimate block (run the pipeline with estimate=true)")
    units, calib = est["units"], est["calibration"]
    return {s: (round(float(report["stages"][s]["wall_time_s"]), 1), float(units[s]["units"]),
                float(f"{unit_cost(units, calib, s):.6g}")) for s in units if s in report["stages"]}


if __name__ == "__main__":  # python -m wmrl.run.machine REPORT.json: print REFERENCE fitted from a run
    import json
    import sys

    for stage, row in reference_from_report(json.loads(open(sys.argv[1]).read())).items():
        print(f'    "{stage}": {row},')
