"""``wmrl bench bridge``: the robot bridge on loopback, with a slow policy.

    wmrl bench bridge [transports=[inproc,grpc,ros2]] [delays_s=[0.05,0.15,0.3]] [duration_s=10]

For every transport and injected inference delay, a policy server (``wmrl serve`` in a separate
process for gRPC / ROS 2, a thread for in-process) runs the closed-loop
``robot_bridge.testing.TrackingPolicy`` (chunks of ``chunk_size``) and this process plays the
robot (``robot_bridge.testing.KinematicArm``, a mock arm) at ``control_hz`` for ``duration_s``.
Reported per run (``report.json`` and a printed table):

* ``starvation_pct``: ticks the robot held for lack of actions, after the first chunk, in % of ticks;
* ``latency_ms`` p50 / p99: observation-to-command latency (chunk in the queue minus observation
  capture minus the server's inference time, i.e. transport + serialisation + scheduling);
* ``ttfa_s``: time to first action from the start of the episode (the server was warmed up
  before ``Ready``); ``ready_s``: connect + warm-up;
* ``jerk``: mean ``|a[k+1] - 2 a[k] + a[k-1]|`` of the translation commands at chunk boundaries
  (where the executing chunk changes, the first excluded), for the latency-aware merge and for
  naive switching (``naive_jerk``) at ``jerk_delay_s``; ``jerk_ratio = jerk / naive_jerk``;
* faults (``faults=true``): the server is killed ``fault_after_s`` into an episode; reported are
  when the robot last moved and when the watchdog stopped it, in s after the kill;
* ``track_rms_mm`` and ``success`` (tracking RMS after ``settle_s`` below ``success_rms_mm``):
  the task outcome (follow the reference circle), to compare each transport with in-process
  execution.

With ``e2e.enabled=true`` it instead runs ``wmrl serve`` and ``wmrl robot`` as separate processes
(the MuJoCo arm on a sim-suite task by default) for each transport and delay of ``e2e`` and
reports success rate, starvation, latency and overruns per run, to compare with in-process.

Wall-clock figures on this machine; other processes slow them down. Never asserted in tests.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import hydra
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from robot_bridge.client import ClientConfig, RobotClient
from robot_bridge.messages import Limits
from robot_bridge.server import PolicyServer
from robot_bridge.testing import KinematicArm, TrackingPolicy
from robot_bridge.transports.base import TransportLink
from wmrl.kernel.workers import child_env
from wmrl.run.bridge import link_by_name, serve_in_process
from wmrl.run.common import RunContext, run_main

log = logging.getLogger("wmrl.bench_bridge")
REPO = Path(__file__).resolve().parents[2]


def boundary_jerk(actions: np.ndarray, chunk_ids: np.ndarray, dims=(0, 1, 2)) -> float:
    """Mean ``|a[k+1] - 2 a[k] + a[k-1]|`` (summed over ``dims``) at steps ``k`` where the chunk
    being executed changes (hold steps count as chunk ``-1``); the first boundary is excluded."""
    a = actions[:, list(dims)].astype(np.float64)
    if len(a) < 3:
        return float("nan")
    d2 = np.abs(a[2:] - 2 * a[1:-1] + a[:-2]).sum(1)  # index j <-> step j+1
    b = (np.nonzero(np.diff(chunk_ids) != 0)[0] + 1)[1:]
    b = b[(b >= 1) & (b <= len(a) - 2)]
    return float(d2[b - 1].mean()) if len(b) else float("nan")


def _start_server_process(link: TransportLink, delay: float, chunk: int, out_dir: Path, process: dict):
    args = [sys.executable, "-m", "wmrl.cli", "serve", *link.overrides(), f"inference_delay_s={delay}",
            f"policy.chunk_size={chunk}", "max_connections=1", "accept_timeout_s=120", f"hydra.run.dir={out_dir}"]
    args += [f"process.{k}={'null' if v is None else v}" for k, v in process.items()]
    env = child_env(dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))  # die with this process
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    t_end = time.monotonic() + 120
    lines = []
    while time.monotonic() < t_end:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        lines.append(line)
        if "wmrl-serve ready" in line:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # drain
            return proc
    proc.kill()
    raise RuntimeError("policy server did not start:\n" + "".join(lines[-20:]))


def _start_server(kind: str, delay: float, cfg: DictConfig, out_dir: Path, domain_id: int, arm, limits: Limits):
    """``(robot transport, server process or None, in-process server or None)`` for one run over
    the transport ``configs/transport/<kind>.yaml`` on a fresh loopback address: an in-process
    link gets a server thread, the others a ``wmrl serve`` process."""
    link = link_by_name(kind).on_loopback(domain_id)
    if link.same_process:
        server = PolicyServer(TrackingPolicy(chunk_size=int(cfg.chunk_size), dt=1.0 / float(cfg.control_hz)),
                              inference_delay_s=delay, limits=Limits(state_dim=9))
        serve_in_process(server, link)
        return link.robot(limits, cameras=arm.cameras, control_hz=float(cfg.control_hz)), None, server
    proc = _start_server_process(link, delay, int(cfg.chunk_size), out_dir, OmegaConf.to_container(cfg.process))
    return link.robot(limits, cameras=arm.cameras, control_hz=float(cfg.control_hz)), proc, None


def run_one(kind: str, delay: float, merge: str, cfg: DictConfig, out_dir: Path, domain_id: int) -> dict:
    """One episode of ``duration_s`` over transport ``kind`` with ``delay`` s of inference."""
    dt = 1.0 / float(cfg.control_hz)
    steps = int(round(float(cfg.duration_s) * float(cfg.control_hz)))
    policy_kw = dict(chunk_size=int(cfg.chunk_size), dt=dt)
    arm = KinematicArm(image_size=tuple(cfg.image_size), dt=dt, start=(0.0, 0.0, 0.0))
    transport, proc, _ = _start_server(kind, delay, cfg, out_dir, domain_id, arm, Limits(action_dim=7))
    try:
        client = RobotClient(arm, transport, ClientConfig(control_hz=float(cfg.control_hz), merge=merge,
                                                          max_steps=steps, stop_on_success=False,
                                                          request_threshold=int(cfg.request_threshold)))
        t0 = time.monotonic()
        client.connect()
        ready_s = time.monotonic() - t0
        res = client.run_episode(0)
        client.close()
    finally:
        if proc is not None:
            proc.kill()
            proc.wait(timeout=10)
    ep = res.episode
    starved = ep.extras["starved"]
    first = int(np.argmax(starved == 0)) if np.any(starved == 0) else len(starved)
    after = max(1, len(starved) - first)
    lat = np.asarray(res.latencies_s) * 1e3
    ref = TrackingPolicy(**policy_kw).reference(torch.from_numpy(ep.proprio[:, -1])).numpy()
    settle = first + int(round(float(cfg.settle_s) * float(cfg.control_hz)))  # after the start-up transient
    err = np.linalg.norm(ep.proprio[settle:, :3] - ref[settle:], axis=1) * 1e3
    rms = float(np.sqrt(np.mean(err ** 2))) if err.size else float("nan")
    return {"transport": kind, "delay_s": delay, "merge": merge, "steps": res.steps,
            "starvation_pct": 100.0 * res.starved_after_first / after,
            "latency_ms_p50": float(np.percentile(lat, 50)) if lat.size else None,
            "latency_ms_p99": float(np.percentile(lat, 99)) if lat.size else None,
            "round_trip_ms_p50": float(np.median(res.round_trips_s) * 1e3) if res.round_trips_s else None,
            "chunks": len(lat), "ttfa_s": res.time_to_first_action_s, "ready_s": ready_s,
            "jerk": boundary_jerk(ep.actions, ep.extras["chunk_id"]), "overruns": res.stats["overruns"],
            "track_rms_mm": rms, "success": bool(rms < float(cfg.success_rms_mm))}


def run_fault(kind: str, cfg: DictConfig, out_dir: Path, domain_id: int) -> dict:
    """Kill the policy server ``fault_after_s`` into an episode; report how long the robot kept
    moving, when it held, and when the watchdog stopped it (s after the kill)."""
    dt = 1.0 / float(cfg.control_hz)
    arm = KinematicArm(image_size=tuple(cfg.image_size), dt=dt)
    transport, proc, server = _start_server(kind, float(cfg.jerk_delay_s), cfg, out_dir, domain_id, arm,
                                            Limits(action_dim=7))
    wd = float(cfg.fault_watchdog_s)
    client = RobotClient(arm, transport, ClientConfig(control_hz=float(cfg.control_hz), max_steps=100_000,
                                                      stop_on_success=False, watchdog_s=wd))
    client.connect()
    box: dict = {}
    th = threading.Thread(target=lambda: box.setdefault("r", client.run_episode(0)), daemon=True)
    th.start()
    time.sleep(float(cfg.fault_after_s))
    t_kill = time.monotonic()
    if proc is not None:
        proc.kill()
    else:
        server.stop()
    th.join(timeout=30)
    client.close()
    if proc is not None:
        proc.wait(timeout=10)
    res = box["r"]
    ep = res.episode
    t_abs = ep.info["t0_monotonic_s"] + ep.extras["t_cmd"]  # monotonic time of each command
    moving = ep.extras["starved"] == 0
    last_move = float(t_abs[moving].max()) if moving.any() else float("nan")
    return {"transport": kind, "watchdog_s": wd, "failure_label": res.failure_label, "steps_recorded": res.steps,
            "stop_after_kill_s": (arm.stop_time - t_kill) if arm.stop_time else None,
            "last_motion_after_kill_s": last_move - t_kill,
            "held_at_stop": bool(ep.extras["starved"][-1] == 1.0)}


def run_e2e(cfg: DictConfig, ctx: RunContext) -> list[dict]:
    """``wmrl serve`` and ``wmrl robot`` as separate processes (the robot on a sim-suite task, or any
    ``arm.kind``) for every transport and delay of ``cfg.e2e``; returns one row per run from the
    robot's report (success rate, starvation, latencies, overruns)."""
    import json

    e = cfg.e2e
    rows = []
    env = child_env(dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))  # die with this process
    proc_over = [f"process.{k}={'null' if v is None else v}" for k, v in OmegaConf.to_container(cfg.process).items()]
    i = 0
    for kind in e.transports:
        for delay in e.delays_s:
            i += 1
            run_dir = ctx.out_dir / "e2e" / f"{i:02d}_{kind}_{int(1000 * float(delay))}ms"
            link = link_by_name(kind).on_loopback(int(cfg.domain_id) + 40 + i)  # a fresh loopback address
            robot_args = [sys.executable, "-m", "wmrl.cli", "robot", *link.overrides(), f"episodes={e.episodes}",
                          f"control.max_steps={e.max_steps}", f"control.control_hz={e.control_hz}",
                          f"hydra.run.dir={run_dir / 'robot'}", *proc_over, *list(e.robot_overrides)]
            server = None
            if link.same_process:
                robot_args += [f"inproc_server.inference_delay_s={delay}"]
                robot_args += [("+" if o.startswith("+") else "") + f"inproc_server.{o.lstrip('+')}"
                               for o in e.serve_overrides]
                if e.checkpoint:
                    robot_args += [f"inproc_server.checkpoint={ctx.path(e.checkpoint)}"]
            else:
                serve_args = [sys.executable, "-m", "wmrl.cli", "serve", *link.overrides(),
                              f"inference_delay_s={delay}", "max_connections=1", "accept_timeout_s=300",
                              f"hydra.run.dir={run_dir / 'serve'}", *proc_over, *list(e.serve_overrides)]
                if e.checkpoint:
                    serve_args.append(f"checkpoint={ctx.path(e.checkpoint)}")
                (run_dir / "serve").mkdir(parents=True, exist_ok=True)
                server = subprocess.Popen(serve_args, cwd=REPO, env=env, stderr=subprocess.STDOUT,
                                          stdout=open(run_dir / "serve" / "stdout.txt", "w"))
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
            rep = json.loads(rep_path.read_text())
            eps = rep["episodes"]
            rows.append({"transport": kind, "delay_s": float(delay), "episodes": len(eps),
                         "success_rate": rep["success_rate"], "starvation_pct": 100 * rep["starvation_rate"],
                         "latency_ms_p99_max": max((r["latency_p99_ms"] or 0) for r in eps),
                         "ttfa_s_mean": float(np.mean([r["time_to_first_action_s"] for r in eps])),
                         "steps_mean": float(np.mean([r["steps"] for r in eps])),
                         "duration_s_mean": float(np.mean([r["steps"] for r in eps])) / float(e.control_hz),
                         "overruns": int(sum(r["overruns"] for r in eps)),
                         "labels": [r["failure_label"] for r in eps]})
            log.info("e2e %s", rows[-1])
    print(f"{'transport':9} {'delay':>6} {'success':>8} {'starve%':>8} {'p99ms':>7} {'ttfa_s':>7} {'steps':>6} {'overrun':>7}")
    for r in rows:
        if "error" in r:
            print(f"{r['transport']:9} {r['delay_s']:6.2f} {r['error']}")
            continue
        print(f"{r['transport']:9} {r['delay_s']:6.2f} {r['success_rate']:8.2f} {r['starvation_pct']:8.2f} "
              f"{r['latency_ms_p99_max']:7.2f} {r['ttfa_s_mean']:7.3f} {r['steps_mean']:6.1f} {r['overruns']:7d}")
    return rows


def run(cfg: DictConfig, ctx: RunContext) -> dict:
    from tqdm import tqdm

    from robot_bridge.process import tune_process

    tuned = tune_process(cfg.process.get("nice"), cfg.process.get("switch_interval_s"))
    if cfg.e2e.enabled:
        return {"e2e": run_e2e(cfg, ctx), "process": tuned, "config": OmegaConf.to_container(cfg, resolve=True)}
    jobs = [(k, float(d), "latency_aware") for k in cfg.transports for d in cfg.delays_s]
    jobs += [(k, float(cfg.jerk_delay_s), "naive") for k in cfg.transports]
    rows = []
    for i, (kind, delay, merge) in enumerate(tqdm(jobs, desc="bridge runs")):
        r = run_one(kind, delay, merge, cfg, ctx.out_dir / f"server_{i:02d}_{kind}", int(cfg.domain_id) + i)
        rows.append(r)
        log.info("%s", r)
    faults = [run_fault(k, cfg, ctx.out_dir / f"fault_{k}", int(cfg.domain_id) + 30 + j)
              for j, k in enumerate(cfg.transports)] if cfg.faults else []
    summary = {}
    for kind in cfg.transports:
        la = [r for r in rows if r["transport"] == kind and r["merge"] == "latency_aware"]
        main = [r for r in la if abs(r["delay_s"] - float(cfg.jerk_delay_s)) < 1e-9]
        naive = [r for r in rows if r["transport"] == kind and r["merge"] == "naive"]
        s = {"starvation_pct_max": max(r["starvation_pct"] for r in la),
             "latency_ms_p99_max": max(r["latency_ms_p99"] or 0.0 for r in la),
             "success_all": all(r["success"] for r in la)}
        if main and naive:
            s["jerk"] = main[0]["jerk"]
            s["naive_jerk"] = naive[0]["jerk"]
            s["jerk_ratio"] = main[0]["jerk"] / naive[0]["jerk"] if naive[0]["jerk"] else None
            s["ttfa_s"] = main[0]["ttfa_s"]
        summary[kind] = s
    header = f"{'transport':9} {'delay':>6} {'merge':>13} {'starve%':>8} {'p50ms':>7} {'p99ms':>7} {'ttfa_s':>7} " \
             f"{'jerk':>7} {'rms_mm':>7} {'ok':>3} {'overrun':>7}"
    print(header)
    for r in rows:
        print(f"{r['transport']:9} {r['delay_s']:6.2f} {r['merge']:>13} {r['starvation_pct']:8.2f} "
              f"{(r['latency_ms_p50'] or 0):7.2f} {(r['latency_ms_p99'] or 0):7.2f} {r['ttfa_s']:7.3f} "
              f"{r['jerk']:7.4f} {r['track_rms_mm']:7.2f} {int(r['success']):3d} {r['overruns']:7d}")
    for k, s in summary.items():
        print(f"{k}: " + ", ".join(f"{a}={b:.4g}" if isinstance(b, float) else f"{a}={b}" for a, b in s.items()))
    for f in faults:
        print(f"server killed ({f['transport']}): label={f['failure_label']} held_at_stop={f['held_at_stop']} "
              f"last motion {f['last_motion_after_kill_s']:.3f} s and stop {f['stop_after_kill_s']:.3f} s after the "
              f"kill (watchdog {f['watchdog_s']} s), {f['steps_recorded']} steps recorded")
    return {"runs": rows, "summary": summary, "faults": faults, "process": tuned, "config": OmegaConf.to_container(cfg, resolve=True)}


@hydra.main(version_base="1.3", config_path="pkg://configs", config_name="bench_bridge")
def main(cfg: DictConfig) -> None:
    run_main(cfg, run, "bench bridge")


if __name__ == "__main__":
    main()
