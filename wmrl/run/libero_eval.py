"""``wmrl evaluate suite=libero_<name>``: a policy on the original LIBERO tasks, as deployment to
simulated robots (not an entry point; ``wmrl.run.evaluate`` calls :func:`run_libero`).

The policy is served in this process by the robot bridge's ``PolicyServer`` on a free loopback gRPC
port; ``workers`` LIBERO env workers run in the LIBERO environment (``.venv-libero``, made by
``scripts/setup_libero.sh``) as ``wmrl robot --config-name robot_libero`` processes (the bridge's
arm node over ``sim.libero.env.LiberoChunkEnv``), each given its own list of ``(task, init index)``
episodes and its own EpisodeStore. The episodes (the chosen tasks x the chosen official init
states) are dealt round-robin to the workers. ``workers=1`` starts its worker as a subprocess;
``workers > 1`` starts each from a one-CPU Ray actor (``wmrl.kernel.workers.RayProcess``, the
worker dies with its actor), pinned to this node because the policy server listens on loopback.

A worker that dies (killed, crashed) mid-episode: the episodes it recorded are kept (its store's
appends are crash-safe), the episode under way is counted as failed with label ``worker_died`` and
one ERROR log line naming the worker, its exit status, the task and init state, and the
remaining episodes of that worker run on a new worker (at most ``suite.max_restarts`` per slot).

Writes into the run directory: ``report.json`` (success per task with 95 % Wilson intervals, the
overall rate, the per-episode list ``episodes`` of ``(task, init_index, seed, success, steps,
failure_label, worker)``, the renderer and package versions of the LIBERO environment, worker
restarts), ``episodes.json``, ``videos/<task>__init<k>.mp4`` (agentview, the first
``videos_per_task`` episodes of each task), ``episodes/`` (one EpisodeStore with every recorded
episode, LIBERO's action space and camera names, ``info`` with suite, task, init index, seed) and
``workers/<slot>_<attempt>/`` (each worker's own run directory, log and store).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf

from robot_bridge.client import episode_ran
from robot_bridge.server import SessionLimits
from robot_bridge.transports.grpc_transport import GrpcLink
from sim.libero.env import libero_action_space  # imports neither LIBERO nor MuJoCo
from wmrl.rl.evaluate import wilson_interval
from wmrl.run.bridge import make_server
from wmrl.run.common import RunContext

log = logging.getLogger("wmrl.evaluate.libero")
REPO = Path(__file__).resolve().parents[2]


def libero_python(cfg_suite: DictConfig) -> Path:
    """The LIBERO environment's interpreter (``suite.python``, relative to the repository).

    Raises:
        ValueError: it does not exist (says to run ``scripts/setup_libero.sh``).
    """
    p = Path(str(cfg_suite.python))
    p = p if p.is_absolute() else REPO / p
    if not p.exists():
        raise ValueError(f"no LIBERO environment at {p}: run `bash scripts/setup_libero.sh` (or set suite.python)")
    return p


def plan_episodes(py: Path, suite: str, tasks, inits) -> list[dict]:
    """``[{"task", "task_index", "init_index", "instruction"}]``: tasks (names or indices; ``None``
    = all) x init states (``None`` = 0..49), task-major, from LIBERO's task list (asked of the
    LIBERO environment, which alone can import LIBERO)."""
    code = ("import json,sys; from sim.libero.env import suite_tasks; "
            "print(json.dumps([[t.index, t.name, t.instruction] for t in suite_tasks(sys.argv[1])]))")
    out = subprocess.run([str(py), "-c", code, suite], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env=_worker_env(), check=False)
    if out.returncode != 0:
        raise ValueError(f"could not list the tasks of {suite} in the LIBERO environment: {out.stderr[-2000:]}")
    listed = json.loads(out.stdout.strip().splitlines()[-1])
    by_name = {n: (i, n, s) for i, n, s in listed}
    chosen = []
    for t in (tasks if tasks else [r[0] for r in listed]):
        if isinstance(t, str) and not t.isdigit():
            if t not in by_name:
                raise ValueError(f"no task {t!r} in {suite}; its tasks: {sorted(by_name)}")
            chosen.append(by_name[t])
        else:
            chosen.append(listed[int(t)])
    init_list = list(inits) if inits is not None else list(range(50))
    return [{"task": n, "task_index": i, "init_index": int(k), "instruction": s} for i, n, s in chosen for k in init_list]


def _worker_env() -> dict:
    env = dict(os.environ, MUJOCO_GL=os.environ.get("MUJOCO_GL", "egl"), HF_HUB_OFFLINE="1",
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)  # the LIBERO env has wmrl installed itself (editable)
    return env


class _Worker:
    def __init__(self, slot: int, attempt: int, episodes: list[dict], proc: subprocess.Popen, out: Path, log_file):
        self.slot, self.attempt, self.episodes, self.proc, self.out, self.log_file = slot, attempt, episodes, proc, out, log_file

    @property
    def name(self) -> str:
        return f"worker {self.slot}.{self.attempt} (pid {self.proc.pid})"


def _start_worker(py: Path, cfg: DictConfig, address: str, slot: int, attempt: int, episodes: list[dict],
                  out_dir: Path, on_ray: bool = False) -> _Worker:
    out = out_dir / "workers" / f"{slot}_{attempt}"
    out.mkdir(parents=True, exist_ok=True)
    pairs = "[" + ",".join(f"[{e['task_index']},{e['init_index']}]" for e in episodes) + "]"
    s = cfg.suite
    args = [str(py), "-m", "wmrl.cli", "robot", "--config-name", "robot_libero", "transport=grpc",
            f"transport.address={address}", f"suite_name={s.name}", f"pairs={pairs}", f"episodes={len(episodes)}",
            f"image_size=[{int(s.image_size[0])},{int(s.image_size[1])}]", f"arm.env.seed={int(cfg.seed)}",
            f"store={out / 'episodes'}", f"hydra.run.dir={out}", "reconnect.attempts=2",
            f"control.max_steps={int(s.max_steps_cap)}", f"control.frames={s.get('frames', 'every_step')}"] + [str(o) for o in (s.get("worker_overrides") or [])]
    if on_ray:      # a one-CPU Ray actor runs it, on the node Ray places it (wmrl.kernel.workers.RayProcess)
        from wmrl.kernel.workers import RayProcess

        # the policy server listens on this node's loopback: the workers run on this node
        proc, f = RayProcess(args, str(REPO), _worker_env(), str(out / "worker.log"), this_node=True), None
    else:
        f = open(out / "worker.log", "w")  # noqa: SIM115 - the worker's log, closed when it exits
        proc = subprocess.Popen(args, cwd=REPO, env=_worker_env(), stdout=f, stderr=subprocess.STDOUT)
    log.info("LIBERO env worker %d.%d started (pid %d%s): %d episodes", slot, attempt, proc.pid,
             ", on Ray" if on_ray else "", len(episodes))
    return _Worker(slot, attempt, episodes, proc, out, f)


def _recorded(store_path: Path) -> list:
    """Episodes in a worker's store (``[]`` if it made none)."""
    from wmrl.kernel.storage import EpisodeStore

    if not store_path.exists():
        return []
    try:
        store = EpisodeStore.open(store_path, mode="r")
    except (FileNotFoundError, ValueError, KeyError):
        return []
    return [store.episode(i) for i in range(len(store))]


def _worker_exited(w: "_Worker", rc: int, index_of: dict, results: dict, recorded: list, restarts: list) -> list:
    """Book an exited worker: its recorded episodes into ``recorded`` / ``results``; the episode it was
    in, when it died, counts as failed (``worker_died``, or the label the node recorded) with an ERROR
    line and a ``restarts`` row. Returns the episodes still to run on a new worker.

    Raises:
        ValueError: the worker could not start at all (its log's tail in the message; no retry helps).
    """
    if w.log_file is not None:
        w.log_file.close()
    eps = _recorded(w.out / "episodes")
    done = {int(ep.info.get("episode", -1)): ep for ep in eps}
    for j, e in enumerate(w.episodes):
        if j in done:
            ep = done[j]
            recorded.append((index_of[id(e)], ep))
            results[index_of[id(e)]] = _row(e, ep.success, ep.length, ep.info.get("failure_label", ""), w)
    missing = [j for j in range(len(w.episodes)) if j not in done]
    if not missing:
        if rc != 0:
            log.warning("%s exited with status %d after recording all its episodes", w.name, rc)
        return []
    text = (w.out / "worker.log").read_text(errors="replace")
    if not done and "connected to the policy server" not in text:  # a set-up error: no retry helps
        tail = "\n".join(text.strip().splitlines()[-6:])
        raise ValueError(f"LIBERO env worker {w.slot}.{w.attempt} could not start (exit status {rc}); "
                         f"{w.out / 'worker.log'} ends with:\n{tail}")
    cut = [j for j, ep in done.items() if not episode_ran(ep.info.get("failure_label", ""))]
    if cut:  # the node recorded the episode it was in (SIGTERM, e-stop, server gone): failed, with its label
        j = max(cut)
        rest = [w.episodes[k] for k in missing]
    else:  # killed outright: the first episode it did not record was under way
        j = missing[0]
        rest = [w.episodes[k] for k in missing[1:]]
        results[index_of[id(w.episodes[j])]] = _row(w.episodes[j], False, 0, "worker_died", w)
    e = w.episodes[j]
    log.error("LIBERO env worker %d.%d (pid %d) exited with status %d during episode %d of its %d "
              "(task %s, init %d): that episode counts as failed (%s); %d recorded episodes kept, %d "
              "episodes go to a new worker", w.slot, w.attempt, w.proc.pid, rc, j, len(w.episodes), e["task"],
              e["init_index"], results[index_of[id(e)]]["failure_label"], len(done), len(rest))
    restarts.append({"slot": w.slot, "attempt": w.attempt, "pid": w.proc.pid, "exit_status": rc,
                     "failed_episode": {"task": e["task"], "init_index": e["init_index"]}, "remaining": len(rest)})
    return rest


def _merge_store(recorded: list, episodes: list, suite_name: str, out_dir):
    """One EpisodeStore (``out_dir/episodes``) with every recorded episode, in plan order, tagged with
    suite / init index / seed; ``None`` when nothing was recorded."""
    from wmrl.kernel.storage import EpisodeStore

    store = None
    for i, ep in sorted(recorded, key=lambda x: x[0]):
        e = episodes[i]
        ep.info.update(suite=suite_name, task=e["task"], init_index=e["init_index"], seed=e["seed"])
        if store is None:
            store = EpisodeStore.open_or_create(
                out_dir / "episodes", cameras={c: tuple(v.shape[-2:]) for c, v in ep.images.items()},
                state_dim=int(ep.proprio.shape[1]), action_dim=int(ep.actions.shape[1]), fps=20.0,
                action_space=libero_action_space().to_dict(), embodiment="panda", source="libero")
        store.append(ep)
    return store


def run_libero(cfg: DictConfig, ctx: RunContext) -> dict:
    """Evaluate ``cfg.checkpoint`` (a policy folder, or ``test_policy``: the suite's
    ``test_policy._target_``, a plumbing check) on ``cfg.suite`` (``configs/suite/libero_*.yaml``);
    see the module docstring. Returns the report."""
    s = cfg.suite
    py = libero_python(s)
    ckpt = str(cfg.checkpoint)
    if ckpt == "expert":
        raise ValueError("the scripted LIBERO expert reads privileged state and is not served through the bridge: run "
                         "scripts/libero_expert.py; here give checkpoint=<policy folder>, or checkpoint=test_policy "
                         "for a plumbing check with the bridge's test policy")
    t0 = time.monotonic()
    episodes = plan_episodes(py, str(s.name), list(cfg.tasks) if cfg.get("tasks") else None,
                             list(s.inits) if s.get("inits") is not None else None)
    for e in episodes:
        e["seed"] = int(cfg.seed)
    workers = max(1, min(int(cfg.get("workers") or 1), len(episodes)))
    scfg = OmegaConf.create({"checkpoint": None if ckpt == "test_policy" else str(ctx.path(ckpt)),
                             "policy": OmegaConf.to_container(s.test_policy, resolve=True), "state_dim": 8,
                             "seed": int(cfg.seed), "device": str(cfg.device), "rtc": True})
    server = make_server(scfg, ctx)
    link = GrpcLink().on_loopback(0)
    endpoint = link.server(server.limits, max_sessions=workers)
    limits = SessionLimits(max_sessions=workers, on_busy="queue", hello_timeout_s=60.0, idle_timeout_s=300.0)
    th = threading.Thread(target=server.serve_endpoint, args=(endpoint, limits), daemon=True, name="libero-policy-server")
    th.start()
    log.info("policy server on %s; %d episodes of %s on %d LIBERO env workers", link.address, len(episodes), s.name, workers)
    results: dict[int, dict] = {}  # plan index -> row
    recorded: list[tuple[int, object]] = []  # (plan index, Episode)
    restarts: list[dict] = []
    index_of = {id(e): i for i, e in enumerate(episodes)}
    on_ray = workers > 1      # workers=1: one subprocess; more: each started by a Ray actor
    active = [_start_worker(py, cfg, link.address, w, 0, episodes[w::workers], ctx.out_dir, on_ray)
              for w in range(workers)]
    try:
        while active:
            time.sleep(0.5)
            for w in list(active):
                rc = w.proc.poll()
                if rc is None:
                    continue
                active.remove(w)
                rest = _worker_exited(w, rc, index_of, results, recorded, restarts)
                if rest and w.attempt < int(s.max_restarts):
                    active.append(_start_worker(py, cfg, link.address, w.slot, w.attempt + 1, rest, ctx.out_dir, on_ray))
                elif rest:
                    log.error("slot %d restarted %d times; its last %d episodes are not run", w.slot, w.attempt, len(rest))
    finally:
        for w in active:
            w.proc.kill()
        server.stop()
        endpoint.close()
    _merge_store(recorded, episodes, str(s.name), ctx.out_dir)
    _videos(ctx.out_dir / "videos", sorted(recorded, key=lambda x: x[0]), episodes, int(cfg.videos_per_task),
            str(cfg.video_camera))
    rows = [results.get(i) or _row(e, False, 0, "not_run", None) for i, e in enumerate(episodes)]
    report = _report(rows, str(s.name), time.monotonic() - t0, restarts, py, workers)
    report["policy"] = ckpt
    (ctx.out_dir / "episodes.json").write_text(json.dumps(rows, indent=1))
    return report


def _row(e: dict, success: bool, steps: int, label: str, w: _Worker | None) -> dict:
    return {"task": e["task"], "init_index": e["init_index"], "seed": e["seed"], "success": bool(success),
            "steps": int(steps), "failure_label": label, "worker": None if w is None else f"{w.slot}.{w.attempt}"}


def _videos(out: Path, recorded, episodes, per_task: int, camera: str) -> None:
    import imageio.v2 as imageio

    count: dict[str, int] = {}
    for i, ep in recorded:
        e = episodes[i]
        if count.get(e["task"], 0) >= per_task or camera not in ep.images or not len(ep.actions):
            continue
        count[e["task"]] = count.get(e["task"], 0) + 1
        out.mkdir(parents=True, exist_ok=True)
        frames = np.ascontiguousarray(ep.images[camera].transpose(0, 2, 3, 1))
        imageio.mimwrite(out / f"{e['task']}__init{e['init_index']}.mp4", list(frames), fps=20, macro_block_size=1)


def _libero_versions(py: Path) -> dict:
    code = ("import json,os; from importlib.metadata import version as v; "
            "print(json.dumps({p: v(p) for p in ('mujoco','robosuite','hf-libero','lerobot','numpy')} | "
            "{'MUJOCO_GL': os.environ.get('MUJOCO_GL','')}))")
    r = subprocess.run([str(py), "-c", code], capture_output=True, text=True, env=_worker_env(), timeout=120, check=False)
    return json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else {"error": r.stderr[-500:]}


def _report(rows: list[dict], suite: str, wall_s: float, restarts: list[dict], py: Path, workers: int) -> dict:
    tasks: dict[str, list[bool]] = {}
    for r in rows:
        tasks.setdefault(r["task"], []).append(r["success"])
    per_task = {}
    for t, oc in tasks.items():
        k, n = sum(oc), len(oc)
        lo, hi = wilson_interval(k, n)
        per_task[t] = {"success_rate": k / n, "ci95": [lo, hi], "successes": k, "episodes": n}
    k, n = sum(r["success"] for r in rows), len(rows)
    lo, hi = wilson_interval(k, n)
    return {"suite": suite, "per_task": per_task,
            "overall": {"success_rate": k / max(1, n), "ci95": [lo, hi], "successes": k, "episodes": n},
            "episodes": rows, "worker_restarts": restarts, "workers": workers,
            "episodes_worker_died": sum(r["failure_label"] == "worker_died" for r in rows),
            "wall_s": wall_s, "libero_env": {"python": str(py), **_libero_versions(py)},
            "protocol": "LIBERO official init states, 10 settle steps, suite step limit (sim.libero.env); "
                        "frames rotated 180 deg (lerobot's LiberoProcessorStep convention); chunks executed by the "
                        "robot bridge's client at 20 Hz (slower than real time here: ticks re-anchor)"}


def format_libero_report(report: dict) -> str:
    lines = [(f"LIBERO {report['suite']}: {report['overall']['successes']}/{report['overall']['episodes']} "
             f"= {report['overall']['success_rate']:.3f} (95 % CI {report['overall']['ci95'][0]:.3f}-"
             f"{report['overall']['ci95'][1]:.3f}) in {report['wall_s']:.0f} s, {report['workers']} workers, "
             f"{len(report['worker_restarts'])} worker restarts")]
    for t, v in report["per_task"].items():
        lines.append(f"  {t}: {v['successes']}/{v['episodes']} = {v['success_rate']:.3f} "
                     f"(CI {v['ci95'][0]:.3f}-{v['ci95'][1]:.3f})")
    return "\n".join(lines)
