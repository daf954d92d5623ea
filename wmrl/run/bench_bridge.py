"""``wmrl bench bridge``: the robot bridge on loopback, with a slow policy.

    wmrl bench bridge [transports=[inproc,grpc,ros2]] [scenes=[moving,static]]
                      [delays_s=[0.05,0.15,0.3,0.4,0.5,0.6]] [duration_s=10] [client.fallback=hold|slow]

For every transport, scene and injected inference delay, a policy server (``wmrl serve`` in a
separate process for gRPC / ROS 2, a thread for in-process) runs the closed-loop
``robot_bridge.testing.TrackingPolicy`` (chunks of ``chunk_size``, real-time chunking: it keeps
the frozen prefix and plans on from where it leads) and this process plays the robot
(``robot_bridge.testing.KinematicArm``, a mock arm) at ``control_hz`` for ``duration_s`` with the
client settings of ``client`` (``robot_bridge.client.ClientConfig``: request timing from the
measured round trip, up to ``max_inflight`` requests in flight, the ``fallback``). The delay is
injected as latency (``delay_mode=latency``: requests in flight overlap their delays, a remote or
batching inference server) or as compute that holds the policy (``delay_mode=compute``).

Scenes: ``moving``, the arm follows a circle (radius 5 cm, 0.5 Hz) whose reference moves on
every tick; ``static``, the target does not move, the arm starts on it and hides its clock, so
that every observation (images and proprio) is identical: a server that dropped "similar"
observations would starve the robot there.

Printed per run (one line per transport, scene and delay; all in ``report.json``):

* ``starve%``: ticks after the first action at which no action was queued (the robot held), in
  % of those ticks (``starvation_pct``);
* ``ttfa_s``: time to the first action from the start of the episode (the server was warmed up
  before ``Ready``; ``ready_s``: connect + warm-up);
* ``ovh50`` / ``ovh99`` (ms): p50 / p99 of the bridge's overhead per chunk, its round trip minus
  the server-side time (request received to chunk sent): transport, serialisation and
  scheduling (``latency_ms_p50`` / ``latency_ms_p99``);
* ``bstep`` / ``wstep``: mean size of the change of command ``|a[k] - a[k-1]|`` (translation, L2)
  after ``settle_s``, at chunk boundaries (where the chunk executed changes, a hold counting as a
  chunk of its own) and within chunks; ``ratio = bstep / wstep`` (``-`` when nothing moves): 1
  when chunks join without a seam (``boundary_step``, ``within_step``, ``step_ratio``;
  ``step_ratio_all`` over the whole run after the first action, start-up transient included:
  the first chunk is planned as if it ran from step 0 while the robot holds until it arrives);
* ``rms_mm``: tracking error, RMS distance of the end effector from the reference after
  ``settle_s`` (``track_rms_mm``); ``ok``: below ``success_rms_mm``;
* ``infl``: most requests in flight at once; ``fallback`` / ``hz``: the safe behaviour the client
  decided when no request timing could keep up (``hold`` or ``slow``, ``-`` none) and the
  control rate it ended with. The mock arm's clock advances one control period per tick, so
  ``slow`` shows in the rate, not in the tracking error;
* ``jerk``: mean ``|a[k+1] - 2 a[k] + a[k-1]|`` of the translation commands at chunk boundaries,
  for the latency-aware merge and for naive switching (``naive_jerk``, moving scene, at
  ``jerk_delay_s``); ``jerk_ratio = jerk / naive_jerk`` (summary line per transport);
* faults (``faults=true``): the server is killed ``fault_after_s`` into an episode; reported are
  when the robot last moved and when the watchdog stopped it, in s after the kill.

With ``e2e.enabled=true`` it instead runs ``wmrl serve`` and ``wmrl robot`` as separate processes
(``wmrl.run.bridge_e2e``; the MuJoCo arm on a sim-suite task by default, ``transport=inproc``
the in-process comparison) for each transport and delay of ``e2e`` and reports success rate with
its Wilson 95 % interval, starvation, overhead and overruns per run.

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
from wmrl.run.bridge_e2e import run_e2e
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


def step_sizes(actions: np.ndarray, chunk_ids: np.ndarray, dims=(0, 1, 2)) -> tuple[float, float]:
    """``(boundary, within)``: mean ``||a[k] - a[k-1]||`` (L2 over ``dims``) over the steps ``k``
    where the chunk executed changes from step ``k-1`` (hold steps count as chunk ``-1``; the first
    change, out of the start-up hold, is left out) and over those where both come from one chunk.
    NaN where there is no such step."""
    a = np.asarray(actions, np.float64)[:, list(dims)]
    ids = np.asarray(chunk_ids)
    if len(a) < 2:
        return float("nan"), float("nan")
    d = np.linalg.norm(np.diff(a, axis=0), axis=1)  # index j <-> step j+1
    change = ids[1:] != ids[:-1]
    b = np.nonzero(change)[0][1:]
    w = ~change & (ids[1:] >= 0)
    return (float(d[b].mean()) if len(b) else float("nan"), float(d[w].mean()) if w.any() else float("nan"))


def scene_kwargs(scene: str, cfg: DictConfig) -> tuple[dict, dict]:
    """``(KinematicArm kwargs, TrackingPolicy kwargs)`` of a scene (see the module docstring).

    Raises:
        ValueError: an unknown scene.
    """
    dt = 1.0 / float(cfg.control_hz)
    arm = {"image_size": tuple(cfg.image_size), "dt": dt, "start": (0.0, 0.0, 0.0)}
    policy = {"chunk_size": int(cfg.chunk_size), "dt": dt}
    if scene == "static":
        return {**arm, "clock_in_proprio": False, "grip": 1.0}, {**policy, "freq_hz": 0.0}
    if scene != "moving":
        raise ValueError(f"scene must be 'moving' or 'static', got {scene!r}")
    return arm, policy


def client_config(cfg: DictConfig, steps: int, **over) -> ClientConfig:
    """The robot's :class:`ClientConfig`: ``cfg.client`` at ``cfg.control_hz``, plus ``over``."""
    kw = OmegaConf.to_container(cfg.client, resolve=True)
    return ClientConfig(**{**kw, "control_hz": float(cfg.control_hz), "max_steps": steps, "stop_on_success": False,
                           **over})


def _start_server_process(link: TransportLink, delay: float, policy_kw: dict, out_dir: Path, process: dict,
                          delay_mode: str = "latency"):
    args = [sys.executable, "-m", "wmrl.cli", "serve", *link.overrides(), f"inference_delay_s={delay}",
            f"delay_mode={delay_mode}", "max_connections=1", "accept_timeout_s=120", f"hydra.run.dir={out_dir}"]
    args += [f"policy.chunk_size={v}" if k == "chunk_size" else f"+policy.{k}={v}" for k, v in policy_kw.items()]
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


def _start_server(kind: str, delay: float, cfg: DictConfig, out_dir: Path, domain_id: int, arm, limits: Limits,
                  policy_kw: dict):
    """``(robot transport, server process or None, in-process server or None)`` for one run over
    the transport ``configs/transport/<kind>.yaml`` on a fresh loopback address: an in-process
    link gets a server thread, the others a ``wmrl serve`` process, serving
    ``TrackingPolicy(**policy_kw)``."""
    link = link_by_name(kind).on_loopback(domain_id)
    if link.same_process:
        server = PolicyServer(TrackingPolicy(**policy_kw), inference_delay_s=delay, limits=Limits(state_dim=9),
                              delay_mode=str(cfg.delay_mode))
        serve_in_process(server, link)
        return link.robot(limits, cameras=arm.cameras, control_hz=float(cfg.control_hz)), None, server
    proc = _start_server_process(link, delay, policy_kw, out_dir, OmegaConf.to_container(cfg.process),
                                 str(cfg.delay_mode))
    return link.robot(limits, cameras=arm.cameras, control_hz=float(cfg.control_hz)), proc, None


def run_one(kind: str, scene: str, delay: float, merge: str, cfg: DictConfig, out_dir: Path, domain_id: int) -> dict:
    """One episode of ``duration_s`` over transport ``kind`` in ``scene`` with ``delay`` s of inference."""
    steps = int(round(float(cfg.duration_s) * float(cfg.control_hz)))
    arm_kw, policy_kw = scene_kwargs(scene, cfg)
    arm = KinematicArm(**arm_kw)
    transport, proc, _ = _start_server(kind, delay, cfg, out_dir, domain_id, arm, Limits(action_dim=7), policy_kw)
    try:
        client = RobotClient(arm, transport, client_config(cfg, steps, merge=merge))
        t0 = time.monotonic()
        client.connect()
        ready_s = time.monotonic() - t0
        res = client.run_episode(0)
        client.close()
    finally:
        if proc is not None:
            proc.kill()
            proc.wait(timeout=10)
    return {"transport": kind, "scene": scene, "delay_s": delay, "merge": merge, "ready_s": ready_s,
            **episode_figures(res, cfg, policy_kw)}


def episode_figures(res, cfg: DictConfig, policy_kw: dict) -> dict:
    """The figures of one bench episode (see the module docstring)."""
    ep = res.episode
    starved = ep.extras["starved"]
    first = int(np.argmax(starved == 0)) if np.any(starved == 0) else len(starved)
    after = max(1, len(starved) - first)
    lat = np.asarray(res.latencies_s) * 1e3
    ref = TrackingPolicy(**policy_kw).reference(torch.from_numpy(ep.proprio[:, -1])).numpy()
    settle = first + int(round(float(cfg.settle_s) * float(cfg.control_hz)))  # after the start-up transient
    err = np.linalg.norm(ep.proprio[settle:, :3] - ref[settle:], axis=1) * 1e3
    rms = float(np.sqrt(np.mean(err ** 2))) if err.size else float("nan")
    b, w = step_sizes(ep.actions[settle:], ep.extras["chunk_id"][settle:])
    b_all, w_all = step_sizes(ep.actions, ep.extras["chunk_id"])
    return {"steps": res.steps, "starvation_pct": 100.0 * res.starved_after_first / after,
            "latency_ms_p50": float(np.percentile(lat, 50)) if lat.size else None,
            "latency_ms_p99": float(np.percentile(lat, 99)) if lat.size else None,
            "round_trip_ms_p50": float(np.median(res.round_trips_s) * 1e3) if res.round_trips_s else None,
            "chunks": len(lat), "requests": res.stats["requests"], "inflight_max": res.stats["inflight_max"],
            "ttfa_s": res.time_to_first_action_s, "boundary_step": b, "within_step": w,
            "step_ratio": b / w if w > 1e-9 else float("nan"),
            "step_ratio_all": b_all / w_all if w_all > 1e-9 else float("nan"),
            "jerk": boundary_jerk(ep.actions, ep.extras["chunk_id"]), "overruns": res.stats["overruns"],
            "fallback": ep.info["fallback"], "control_hz_effective": ep.info["control_hz_effective"],
            "track_rms_mm": rms, "success": bool(rms < float(cfg.success_rms_mm))}


def run_fault(kind: str, cfg: DictConfig, out_dir: Path, domain_id: int) -> dict:
    """Kill the policy server ``fault_after_s`` into an episode; report how long the robot kept
    moving, when it held, and when the watchdog stopped it (s after the kill)."""
    arm_kw, policy_kw = scene_kwargs("moving", cfg)
    arm = KinematicArm(**arm_kw)
    transport, proc, server = _start_server(kind, float(cfg.jerk_delay_s), cfg, out_dir, domain_id, arm,
                                            Limits(action_dim=7), policy_kw)
    wd = float(cfg.fault_watchdog_s)
    client = RobotClient(arm, transport, client_config(cfg, 100_000, watchdog_s=wd))
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


def run(cfg: DictConfig, ctx: RunContext) -> dict:
    from tqdm import tqdm

    from robot_bridge.process import tune_process

    tuned = tune_process(cfg.process.get("nice"), cfg.process.get("switch_interval_s"))
    if cfg.e2e.enabled:
        return {"e2e": run_e2e(cfg, ctx), "process": tuned, "config": OmegaConf.to_container(cfg, resolve=True)}
    jobs = [(k, sc, float(d), "latency_aware") for k in cfg.transports for sc in cfg.scenes for d in cfg.delays_s]
    jobs += [(k, "moving", float(cfg.jerk_delay_s), "naive") for k in cfg.transports]
    rows = []
    for i, (kind, scene, delay, merge) in enumerate(tqdm(jobs, desc="bridge runs")):
        r = run_one(kind, scene, delay, merge, cfg, ctx.out_dir / f"server_{i:02d}_{kind}", int(cfg.domain_id) + i)
        rows.append(r)
        log.info("%s", r)
    faults = [run_fault(k, cfg, ctx.out_dir / f"fault_{k}", int(cfg.domain_id) + 30 + j)
              for j, k in enumerate(cfg.transports)] if cfg.faults else []
    summary = {kind: summarise([r for r in rows if r["transport"] == kind], float(cfg.jerk_delay_s))
               for kind in cfg.transports}
    print_table(rows, summary, faults)
    return {"runs": rows, "summary": summary, "faults": faults, "process": tuned,
            "config": OmegaConf.to_container(cfg, resolve=True)}


def summarise(rows: list[dict], jerk_delay: float) -> dict:
    """Per transport: worst starvation, p99 overhead and step ratio over the runs that kept up
    (no fallback), the delays that fell back, whether every run kept up and tracked, and the
    latency-aware vs naive jerk at ``jerk_delay``."""
    la = [r for r in rows if r["merge"] == "latency_aware"]
    kept = [r for r in la if not r["fallback"]]
    ratios = [r["step_ratio"] for r in kept if np.isfinite(r["step_ratio"])]
    s = {"starvation_pct_max": max((r["starvation_pct"] for r in kept), default=None),
         "latency_ms_p99_max": max((r["latency_ms_p99"] or 0.0 for r in la), default=None),
         "step_ratio_max": max(ratios, default=None),
         "fallback_at": sorted({(r["scene"], r["delay_s"]) for r in la if r["fallback"]}),
         "success_all": all(r["success"] for r in kept)}
    main = [r for r in la if r["scene"] == "moving" and abs(r["delay_s"] - jerk_delay) < 1e-9]
    naive = [r for r in rows if r["merge"] == "naive"]
    if main and naive:
        s["jerk"] = main[0]["jerk"]
        s["naive_jerk"] = naive[0]["jerk"]
        s["jerk_ratio"] = main[0]["jerk"] / naive[0]["jerk"] if naive[0]["jerk"] else None
        s["ttfa_s"] = main[0]["ttfa_s"]
    return s


def _f(x, fmt: str) -> str:
    return "-" if x is None or (isinstance(x, float) and not np.isfinite(x)) else format(x, fmt)


def print_table(rows: list[dict], summary: dict, faults: list[dict]) -> None:
    print(f"{'transport':9} {'scene':6} {'delay':>5} {'merge':>13} {'starve%':>7} {'ttfa_s':>6} {'ovh50':>6} "
          f"{'ovh99':>6} {'bstep':>6} {'wstep':>6} {'ratio':>5} {'rms_mm':>6} {'ok':>2} {'infl':>4} {'fallback':>8} "
          f"{'hz':>5} {'jerk':>7} {'overrun':>7}")
    for r in rows:
        print(f"{r['transport']:9} {r['scene']:6} {r['delay_s']:5.2f} {r['merge']:>13} {r['starvation_pct']:7.2f} "
              f"{_f(r['ttfa_s'], '6.3f'):>6} {_f(r['latency_ms_p50'], '6.2f'):>6} {_f(r['latency_ms_p99'], '6.2f'):>6} "
              f"{_f(r['boundary_step'], '6.4f'):>6} {_f(r['within_step'], '6.4f'):>6} {_f(r['step_ratio'], '5.2f'):>5} "
              f"{_f(r['track_rms_mm'], '6.2f'):>6} {int(r['success']):2d} {r['inflight_max']:4d} "
              f"{r['fallback'] or '-':>8} {r['control_hz_effective']:5.1f} {_f(r['jerk'], '7.4f'):>7} "
              f"{r['overruns']:7d}")
    for k, s in summary.items():
        print(f"{k}: " + ", ".join(f"{a}={b:.4g}" if isinstance(b, float) else f"{a}={b}" for a, b in s.items()))
    for f in faults:
        print(f"server killed ({f['transport']}): label={f['failure_label']} held_at_stop={f['held_at_stop']} "
              f"last motion {f['last_motion_after_kill_s']:.3f} s and stop {f['stop_after_kill_s']:.3f} s after the "
              f"kill (watchdog {f['watchdog_s']} s), {f['steps_recorded']} steps recorded")


@hydra.main(version_base="1.3", config_path="pkg://configs", config_name="bench_bridge")
def main(cfg: DictConfig) -> None:
    run_main(cfg, run, "bench bridge")


if __name__ == "__main__":
    main()
