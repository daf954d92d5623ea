"""End-to-end runs of the robot bridge for ``wmrl bench bridge e2e.enabled=true`` (not an entry
point): ``wmrl serve`` and ``wmrl robot`` as separate processes (``transport=inproc``: the server
in a thread of ``wmrl robot``, the in-process comparison) for every transport and delay of
``cfg.e2e``, the robot on a sim-suite task by default; one row per run from the robot's report.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf

from wmrl.kernel.workers import child_env
from wmrl.rl.evaluate import wilson_interval
from wmrl.run.bridge import link_by_name
from wmrl.run.common import RunContext

log = logging.getLogger("wmrl.bench_bridge")
REPO = Path(__file__).resolve().parents[2]


def _overrides(prefix: str, node) -> list[str]:
    return [f"{prefix}{k}={'null' if v is None else v}" for k, v in OmegaConf.to_container(node).items()]


def _commands(cfg: DictConfig, ctx: RunContext, kind: str, delay: float, run_dir: Path, domain_id: int):
    """``(robot argv, serve argv or None)`` of one run."""
    e = cfg.e2e
    link = link_by_name(kind).on_loopback(domain_id)  # a fresh loopback address
    proc_over = _overrides("process.", cfg.process)
    robot_args = [sys.executable, "-m", "wmrl.cli", "robot", *link.overrides(), f"episodes={e.episodes}",
                  f"control.max_steps={e.max_steps}", f"control.control_hz={e.control_hz}",
                  *_overrides("control.", cfg.client), f"hydra.run.dir={run_dir / 'robot'}", *proc_over,
                  *list(e.robot_overrides)]
    if link.same_process:
        robot_args += [f"inproc_server.inference_delay_s={delay}", f"inproc_server.delay_mode={cfg.delay_mode}"]
        robot_args += [("+" if o.startswith("+") else "") + f"inproc_server.{o.lstrip('+')}" for o in e.serve_overrides]
        if e.checkpoint:
            robot_args += [f"inproc_server.checkpoint={ctx.path(e.checkpoint)}"]
        return robot_args, None
    serve_args = [sys.executable, "-m", "wmrl.cli", "serve", *link.overrides(), f"inference_delay_s={delay}",
                  f"delay_mode={cfg.delay_mode}", "max_connections=1", "accept_timeout_s=300",
                  f"hydra.run.dir={run_dir / 'serve'}", *proc_over, *list(e.serve_overrides)]
    if e.checkpoint:
        serve_args.append(f"checkpoint={ctx.path(e.checkpoint)}")
    return robot_args, serve_args


def _row(kind: str, delay: float, rep: dict, control_hz: float) -> dict:
    eps = rep["episodes"]
    wins = sum(bool(r["success"]) for r in eps)
    lo, hi = wilson_interval(wins, len(eps))
    return {"transport": kind, "delay_s": delay, "episodes": len(eps), "success_rate": rep["success_rate"],
            "success_ci95": [lo, hi], "starvation_pct": 100 * rep["starvation_rate"],
            "latency_ms_p99_max": max((r["latency_p99_ms"] or 0) for r in eps),
            "ttfa_s_mean": float(np.mean([r["time_to_first_action_s"] for r in eps])),
            "steps_mean": float(np.mean([r["steps"] for r in eps])),
            "duration_s_mean": float(np.mean([r["steps"] for r in eps])) / control_hz,
            "overruns": int(sum(r["overruns"] for r in eps)),
            "fallbacks": [r.get("fallback", "") for r in eps], "labels": [r["failure_label"] for r in eps]}


def run_e2e(cfg: DictConfig, ctx: RunContext) -> list[dict]:
    """Every transport and delay of ``cfg.e2e``; prints one line per run (success with its Wilson
    95 % interval, starvation %, worst per-episode p99 overhead, time to first action, steps,
    overruns, episodes that fell back) and returns the rows."""
    e = cfg.e2e
    rows = []
    env = child_env(dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))  # die with this process
    i = 0
    for kind in e.transports:
        for delay in e.delays_s:
            i += 1
            run_dir = ctx.out_dir / "e2e" / f"{i:02d}_{kind}_{int(1000 * float(delay))}ms"
            robot_args, serve_args = _commands(cfg, ctx, kind, float(delay), run_dir, int(cfg.domain_id) + 40 + i)
            server = None
            if serve_args is not None:
                (run_dir / "serve").mkdir(parents=True, exist_ok=True)
                with open(run_dir / "serve" / "stdout.txt", "w") as out:  # the child keeps its own descriptor
                    server = subprocess.Popen(serve_args, cwd=REPO, env=env, stderr=subprocess.STDOUT, stdout=out)
            try:
                (run_dir / "robot").mkdir(parents=True, exist_ok=True)
                with open(run_dir / "robot" / "stdout.txt", "w") as out:
                    subprocess.run(robot_args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   timeout=float(e.timeout_s), check=False)
            finally:
                if server is not None:
                    server.kill()
                    server.wait(timeout=10)
            rep_path = run_dir / "robot" / "report.json"
            if not rep_path.is_file():
                rows.append({"transport": kind, "delay_s": float(delay),
                             "error": f"robot wrote no report (see {run_dir / 'robot' / 'stdout.txt'})"})
                continue
            rows.append(_row(kind, float(delay), json.loads(rep_path.read_text()), float(e.control_hz)))
            log.info("e2e %s", rows[-1])
    _print(rows)
    return rows


def _print(rows: list[dict]) -> None:
    print(f"{'transport':9} {'delay':>6} {'success':>8} {'ci95':>13} {'starve%':>8} {'p99ms':>7} {'ttfa_s':>7} "
          f"{'steps':>6} {'overrun':>7} fallback")
    for r in rows:
        if "error" in r:
            print(f"{r['transport']:9} {r['delay_s']:6.2f} {r['error']}")
            continue
        lo, hi = r["success_ci95"]
        fb = sum(bool(f) for f in r["fallbacks"])
        print(f"{r['transport']:9} {r['delay_s']:6.2f} {r['success_rate']:8.2f} {f'[{lo:.2f}, {hi:.2f}]':>13} "
              f"{r['starvation_pct']:8.2f} {r['latency_ms_p99_max']:7.2f} {r['ttfa_s_mean']:7.3f} "
              f"{r['steps_mean']:6.1f} {r['overruns']:7d} {fb}/{r['episodes']}")
