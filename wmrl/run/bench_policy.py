"""``wmrl bench policy``: inference latency per action chunk at batch 1 and BC training speed.

    wmrl bench policy [num_threads=2] [checkpoint=runs/bc/checkpoints/last] [policy=tiny] [neighbour.enabled=false]

Prints and reports (``report.json``):

* ``inference_ms``: median / p90 wall time of ``policy.sample(obs)`` at batch 1 for the Euler ODE
  sampler (evaluation) and the SDE sampler (GRPO; includes computing the chain log-prob), each with
  the policy's ``num_steps``; the instruction embedding is cached after the first call, as in use;
* ``bc``: median time of one BC step (forward, backward, AdamW, EMA) at ``batch_size`` on random
  windows of the default sizes, for the default precision (``bf16=auto``, ``wmrl.kernel.precision``), fp32
  and bf16 side by side; ``default_over_fp32`` (on a CPU without native bf16 the default is fp32, so
  about 1.0), samples/s and the estimated wall time of ``bc_steps`` steps, next to the budgets
  (50 ms, 8 min);
* ``neighbour``: BC steps/s in fresh processes, alone and beside a CPU-bound process the benchmark
  pins to one core, with the defaults (``num_threads=auto``) and with a thread on every core under
  OpenMP's spinning and passive wait policies, and each ``ratio`` (with neighbour / alone).

Figures are wall-clock on this machine with ``num_threads`` torch threads (the neighbour part: its
own thread choice); other processes slow them down. Timings are never asserted in tests.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import hydra
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from wmrl.kernel.precision import resolve_bf16
from wmrl.run.common import RunContext, run_main
from wmrl.run.measure import bc_step_fn, policy_for_bench, random_obs, time_ms

log = logging.getLogger("wmrl.bench_policy")


def run(cfg: DictConfig, ctx: RunContext) -> dict:
    from policies.samplers import EulerODESampler, SDESampler

    policy, trained = policy_for_bench(cfg)
    policy.eval()
    k = int(getattr(policy.sampler, "num_steps", 10))
    obs = random_obs(policy, 1)
    report: dict = {"policy": cfg.get("checkpoint") or OmegaConf.select(cfg, "policy._target_"),
                    "trained_checkpoint": trained, "num_threads": torch.get_num_threads(),
                    "num_params": sum(p.numel() for p in policy.parameters()), "inference_ms": {}}
    for name, sampler in (("ode", EulerODESampler(k)), ("sde", SDESampler(k, 0.5))):
        policy.sampler = sampler
        gen = torch.Generator().manual_seed(0)
        ms = time_ms(lambda: policy.sample(obs, gen), int(cfg.inference_runs), 5)
        report["inference_ms"][name] = {"num_steps": k, "median": float(np.median(ms)), "p90": float(np.percentile(ms, 90))}
        print(f"inference ({name}, K={k}, batch 1): median {np.median(ms):.1f} ms, p90 {np.percentile(ms, 90):.1f} ms "
              f"per chunk (budget {cfg.budget_inference_ms} ms)")

    # BC step timing on random windows of the policy's sizes: the default precision (bf16=auto) beside
    # explicit fp32 and bf16, side by side in this process
    b = int(cfg.batch_size)
    device_type = "cpu" if str(cfg.device) == "cpu" else "cuda"
    default_prec = resolve_bf16(cfg.get("bf16", "auto"), device_type, "BC")
    modes = {"default": default_prec, "fp32": resolve_bf16(False, device_type, "BC"),
             "bf16": resolve_bf16(True, device_type, "BC")}
    report["bc"] = {"batch_size": b, "bc_steps": int(cfg.bc_steps), "budget_minutes": float(cfg.budget_bc_min),
                    "precision": default_prec.as_dict()}
    for name, prec in modes.items():
        step = bc_step_fn(policy, b, prec.bf16, device_type)
        ms = time_ms(step, int(cfg.train_steps), 3)
        med = float(np.median(ms))
        report["bc"][name] = {"bf16": prec.bf16, "step_ms_median": med, "samples_per_s": b * 1000.0 / med}
        print(f"BC step ({name}: {prec.dtype}, batch {b}): median {med:.0f} ms, {b * 1000.0 / med:.0f} samples/s")
    med = report["bc"]["default"]["step_ms_median"]
    ratio = med / report["bc"]["fp32"]["step_ms_median"]
    est_min = med * int(cfg.bc_steps) / 60000.0
    report["bc"].update(step_ms_median=med, default_over_fp32=ratio, estimated_bc_minutes=est_min)
    report["within_budget"] = {"inference": report["inference_ms"]["ode"]["median"] <= cfg.budget_inference_ms,
                               "bc": est_min <= cfg.budget_bc_min}
    print(f"defaults ({default_prec.reason}): {ratio:.2f}x the fp32 step time; "
          f"{cfg.bc_steps} steps ~ {est_min:.1f} min (budget {cfg.budget_bc_min} min)")
    nb = cfg.get("neighbour") or {}
    if nb.get("enabled", True):
        report["neighbour"] = _neighbour_bench(cfg, b)
    return report


# ------------------------------------------------------------------ a CPU-bound neighbour
_NEIGHBOUR = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"
_CHILD = "import json, sys\nfrom wmrl.run.bench_policy import bc_rate_child\nbc_rate_child(json.loads(sys.argv[1]))\n"


def bc_rate_child(spec: dict) -> None:
    """In a fresh process (own OpenMP environment, own thread choice): BC steps/s of the default policy
    at ``spec`` (``policy`` config, ``batch_size``, ``steps``, ``bf16``, ``num_threads``); prints one
    JSON line ``{"steps_per_s", "num_threads", "threads_reason"}``."""
    from wmrl.run.common import set_threads

    k, why = set_threads(spec["num_threads"])
    cfg = OmegaConf.create(spec["cfg"])
    policy, _ = policy_for_bench(cfg)
    prec = resolve_bf16(spec["bf16"], "cpu", "BC")
    step = bc_step_fn(policy, int(spec["batch_size"]), prec.bf16, "cpu")
    for _ in range(3):
        step()
    t0 = time.perf_counter()
    for _ in range(int(spec["steps"])):
        step()
    print(json.dumps({"steps_per_s": int(spec["steps"]) / (time.perf_counter() - t0), "num_threads": k,
                      "threads_reason": why, "precision": prec.dtype}), flush=True)


def _child_rate(spec: dict, env: dict, neighbour_cpu: int | None) -> dict:
    nb = None
    try:
        if neighbour_cpu is not None:
            nb = subprocess.Popen([sys.executable, "-c", _NEIGHBOUR, str(neighbour_cpu)], env=env)
            time.sleep(0.5)     # running before the job starts, as a user's other job would be
        out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(spec)], env=env, capture_output=True,
                             text=True, timeout=600)
        if out.returncode != 0:
            raise RuntimeError(f"BC timing process failed:\n{out.stderr[-2000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        if nb is not None:
            nb.kill()
            nb.wait()


def _neighbour_bench(cfg: DictConfig, b: int) -> dict:
    """BC steps/s alone and beside a CPU-bound process pinned to one core, each in a fresh process:
    with the defaults (``num_threads=auto``, the OpenMP wait policy as the user has it) and, for
    comparison, with every core's thread forced (``num_threads=0``) under OpenMP's default (spinning)
    and passive wait policies."""
    nb = cfg.get("neighbour") or {}
    cpus = sorted(os.sched_getaffinity(0))
    cpu = cpus[-1]
    steps = int(nb.get("steps", 40))
    spec0 = {"cfg": OmegaConf.to_container(cfg, resolve=True), "batch_size": b, "steps": steps,
             "bf16": cfg.get("bf16", "auto")}
    base_env = {k: v for k, v in os.environ.items()}
    spin_env = {k: v for k, v in base_env.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    cases = {"defaults": ({"num_threads": cfg.get("neighbour_num_threads", "auto")}, base_env),
             "all_cores_spin": ({"num_threads": 0}, spin_env),
             "all_cores_passive": ({"num_threads": 0}, {**spin_env, "OMP_WAIT_POLICY": "PASSIVE"})}
    wanted = list(nb.get("cases") or cases)
    unknown = set(wanted) - set(cases)
    if unknown:
        raise ValueError(f"neighbour.cases: unknown {sorted(unknown)}; choose from {list(cases)}")
    cases = {k: v for k, v in cases.items() if k in wanted}
    if len(cpus) < 2:
        print("neighbour: one core only, skipped")
        return {"skipped": "one core available"}
    out: dict = {"neighbour_cpu": cpu, "steps": steps}
    print(f"BC steps/s alone and beside a CPU-bound process on core {cpu} (fresh processes, {steps} steps each):")
    for name, (over, env) in cases.items():
        alone = _child_rate({**spec0, **over}, env, None)
        busy = _child_rate({**spec0, **over}, env, cpu)
        ratio = busy["steps_per_s"] / alone["steps_per_s"]
        out[name] = {"alone": alone, "with_neighbour": busy, "ratio": ratio}
        print(f"  {name:<18} alone {alone['steps_per_s']:5.1f}/s ({alone['num_threads']} threads)   with neighbour "
              f"{busy['steps_per_s']:5.1f}/s ({busy['num_threads']} threads)   ratio {ratio:.2f}")
    return out


@hydra.main(version_base="1.3", config_path="pkg://configs", config_name="bench_policy")
def main(cfg: DictConfig) -> None:
    run_main(cfg, run, "bench policy")


if __name__ == "__main__":
    main()
