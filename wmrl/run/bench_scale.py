"""``wmrl bench scale``: what Ray workers and torchrun ranks buy on this machine (issue #23).

    wmrl bench scale [eval.episodes_per_task=4] [train.steps=60] [train.store=runs/demos]

Each setting runs as its own ``wmrl`` command (a fresh process, its own Ray cluster or torchrun
group), one after the other, with its run directory under this run's:

* ``eval``: ``wmrl evaluate checkpoint=expert`` on the embedded suite with ``workers=1`` (in process)
  and ``workers=2`` (a local Ray cluster); episodes/s from the command's wall time (process start-up
  included: what a user waits for) and from its run time (``report.json`` ``wall_time_s``, the Ray
  start inside it), the ratio 2 / 1 of the first, and whether both gave the same episodes
  (``episodes_sha256``);
* ``train``: ``wmrl train-policy`` for ``train.steps`` BC steps of the same effective batch as one
  process with 2 threads and as ``wmrl torchrun --nproc-per-node 2`` with 1 thread per rank
  (``OMP_WAIT_POLICY=PASSIVE``); steps/s from each report's training time and the ratio.

Figures are wall clock on this machine; other processes change them (check ``load_average``).
Timings are never asserted in tests.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import hydra
from omegaconf import DictConfig

from wmrl.kernel.workers import child_env
from wmrl.run.common import RunContext, run_main

log = logging.getLogger("wmrl.bench_scale")


def _wmrl(args: list[str], env: dict | None = None) -> float:
    """Run ``wmrl <args>``; returns its wall seconds. Raises RuntimeError with its output's tail."""
    t = time.time()
    p = subprocess.run([sys.executable, "-m", "wmrl.cli", *args], env=child_env(env), capture_output=True, text=True,
                       check=False)
    if p.returncode:
        raise RuntimeError(f"`wmrl {' '.join(args)}` failed ({p.returncode}):\n{(p.stdout + p.stderr)[-3000:]}")
    return time.time() - t


def run(cfg: DictConfig, ctx: RunContext) -> dict:
    out = ctx.out_dir
    e = cfg.eval
    ev = {}
    for w in e.workers:
        d = out / f"eval_workers{w}"
        wall = _wmrl(["evaluate", "checkpoint=expert", f"noise={e.noise}", f"episodes_per_task={e.episodes_per_task}",
                      "videos_per_task=0", f"workers={w}", f"hydra.run.dir={d}"])
        rep = json.loads((d / "report.json").read_text())
        n = len(rep["episodes"])
        ev[int(w)] = {"episodes": n, "wall_s": round(wall, 2), "episodes_per_s": round(n / wall, 3),
                      "run_s": rep["wall_time_s"], "episodes_per_s_in_run": round(n / rep["wall_time_s"], 3),
                      "success_rate": rep["overall"].get("success_rate"), "episodes_sha256": rep.get("episodes_sha256")}
        print(f"evaluate workers={w}: {n} episodes in {wall:.1f} s ({n / wall:.2f} episodes/s, process start-up "
              f"included; {n / rep['wall_time_s']:.2f} episodes/s within the run, Ray start included)")
    ws = sorted(ev)
    eval_ratio = ev[ws[-1]]["episodes_per_s"] / ev[ws[0]]["episodes_per_s"] if len(ws) > 1 else None
    same = len({v["episodes_sha256"] for v in ev.values()}) == 1
    if eval_ratio is not None:
        print(f"evaluation throughput {ws[-1]} / {ws[0]} workers: {eval_ratio:.2f}x; same episodes: {same}")

    t = cfg.train
    store = ctx.path(t.store) if t.store else out / "demos"
    if not t.store:
        _wmrl(["collect", f"out={store}", f"episodes_per_task={t.collect_episodes_per_task}", "noise=0.3",
               f"hydra.run.dir={out / 'collect'}"])
    common = ["train-policy", f"store={store}", f"policy={t.policy}", f"steps={t.steps}", f"train.batch_size={t.batch_size}",
              "train.ckpt_every=0", "train.warmup_steps=5", "val_every_nth_episode=0", "train.resume=false"]
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    tr = {}
    for name, prefix, threads in (("1_process_x_2_threads", [], 2), ("2_ranks_x_1_thread", ["torchrun", "--nproc-per-node", "2"], 1)):
        d = out / f"train_{name}"
        env_t = {**env, "OMP_NUM_THREADS": str(threads)}
        wall = _wmrl(prefix + common + [f"num_threads={threads}", f"hydra.run.dir={d}"], env=env_t)
        rep = json.loads((d / "report.json").read_text())
        sps = rep["steps"] / max(1e-9, rep["train_time_s"])
        tr[name] = {"steps": rep["steps"], "train_time_s": rep["train_time_s"], "steps_per_s": round(sps, 3),
                    "wall_s": round(wall, 2), "final_loss": rep.get("final_loss"), "world_size": rep["data_parallel"]["world_size"]}
        print(f"train-policy {name}: {sps:.2f} steps/s ({rep['steps']} steps of batch {t.batch_size}; {wall:.1f} s wall)")
    train_ratio = tr["2_ranks_x_1_thread"]["steps_per_s"] / tr["1_process_x_2_threads"]["steps_per_s"]
    print(f"training steps/s, 2 ranks x 1 thread / 1 process x 2 threads: {train_ratio:.2f}x")
    return {"eval": {str(k): v for k, v in ev.items()}, "eval_ratio_2_over_1": eval_ratio, "eval_same_episodes": same,
            "train": tr, "train_ratio_ranks_over_threads": round(train_ratio, 3), "cpu_count": os.cpu_count(),
            "load_average": list(os.getloadavg())}


@hydra.main(version_base="1.3", config_path="pkg://configs", config_name="bench_scale")
def main(cfg: DictConfig) -> None:
    run_main(cfg, run, "bench scale", errors=(ValueError, RuntimeError))


if __name__ == "__main__":
    main()
