"""``wmrl collect``: scripted-expert episodes of the sim suite -> EpisodeStore.

    wmrl collect suite=default episodes_per_task=100 noise=0.6 out=stores/demos
    wmrl collect ... noise=0.8 rotation_noise=0.25   # less wrist-rotation jitter: a steadier arm to imagine

Episode ``i`` of a task starts from training init state ``i`` (mod the number of them) with seed
``sim.suite.collect_seed(seed, task, i)``; each Episode carries its MuJoCo states and
``info = {task, init_index, split: "train", seed, noise, rotation_noise, failure, ...}``. Failed episodes are kept.
Running again with the same ``out`` continues each task after the episodes already stored
(collection is resumable); ``overwrite=true`` starts a new store.
"""

from __future__ import annotations

import logging

import hydra
import numpy as np
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from wmrl.run.common import RunContext, run_main

log = logging.getLogger("wmrl.collect")


def _collect_tasks(suite, tasks: list[str], n: int, noise: float, seed: int, out: str,
                   have: dict[str, int], total: int, position: int = 0, like: str | None = None,
                   rotation_noise: float = 1.0) -> dict:
    """Collect the missing episodes of ``tasks`` (in order) into the store at ``out`` (a new store
    shaped like the store at ``like`` when given); returns per-task ``{episodes, successes, steps}``.
    Runs in the main process (``suite`` a Suite) or in a worker (``suite`` its resolved config dict)."""
    from sim.collect import collect_episodes
    from wmrl.kernel.storage import EpisodeStore
    from wmrl.refresh import store_like

    if isinstance(suite, dict):
        suite = instantiate(suite)
    store = store_like(EpisodeStore.open(like, mode="r"), out, "scripted") if like else EpisodeStore.open(out, mode="a")
    stats = {t: {"episodes": 0, "successes": 0, "steps": 0} for t in tasks}
    bar = tqdm(total=total, desc="collect" if not position else f"collect[{position}]", unit="ep",
               position=position)
    for t in tasks:
        for ep in collect_episodes(suite, n, noise=noise, seed=seed, tasks=[t], start_index=have[t],
                                   rotation_noise=rotation_noise):
            store.append(ep)
            s = stats[t]
            s["episodes"] += 1
            s["successes"] += int(ep.success)
            s["steps"] += ep.length
            bar.update(1)
            bar.set_postfix(task=t, success=f"{s['successes']}/{s['episodes']}")
    bar.close()
    return stats


def _collect_parallel(cfg: DictConfig, suite, tasks: list[str], n: int, noise: float, out, have: dict,
                      total: int, workers: int, rotation_noise: float = 1.0) -> dict:
    """Whole tasks per worker process, each into a store of its own next to ``out``; the main process
    then appends their episodes to ``out`` task by task in ``tasks`` order, so the store is the one
    ``workers=1`` writes, whatever the processes' timing (held-out splits and BC data order depend on
    it). Tasks are dealt to the worker with the least expected work (episodes x the task's step
    limit). A run killed before the merge keeps nothing new: a re-run removes the per-worker stores it left and
    collects those episodes again. Workers die with the main process (``wmrl.kernel.workers``)."""
    import shutil
    from pathlib import Path

    from wmrl.kernel.storage import EpisodeStore
    from wmrl.kernel.workers import worker_pool

    work = {t: max(0, n - have[t]) * suite.task(t).max_steps for t in tasks}
    load = [0.0] * workers
    groups: list[list[str]] = [[] for _ in range(workers)]
    for t in sorted(tasks, key=lambda t: -work[t]):
        k = int(np.argmin(load))
        groups[k].append(t)
        load[k] += work[t]
    suite_cfg = OmegaConf.to_container(cfg.suite, resolve=True)
    stats: dict = {}
    tmp = Path(str(out) + ".workers")
    if tmp.exists():                        # a killed run's per-worker stores: never merged, collected again
        log.warning("removing %s, left by a collect that did not finish; its episodes are collected again", tmp)
        shutil.rmtree(tmp)
    parts = [tmp / f"worker{i}.zarr" for i in range(workers)]
    with worker_pool(workers) as pool:
        futs = [pool.submit(_collect_tasks, suite_cfg, g, n, noise, int(cfg.seed), str(parts[i]), have,
                            sum(max(0, n - have[t]) for t in g), i + 1, str(out), rotation_noise)
                for i, g in enumerate(groups) if g]
        for f in futs:
            stats.update(f.result())
    store = EpisodeStore.open(out, mode="a")
    opened = [EpisodeStore.open(p, mode="r") for i, p in enumerate(parts) if groups[i]]
    for t in tasks:
        for part in opened:
            for i, name in enumerate(part.task_names):
                if name == t:
                    store.append(part.episode(i))
    shutil.rmtree(tmp, ignore_errors=True)
    return {t: stats[t] for t in tasks}


def run(cfg: DictConfig, ctx: RunContext) -> dict:
    from wmrl.kernel.storage import EpisodeStore

    if cfg.get("out") in (None, "", "???"):
        raise ValueError("out=PATH is required: the EpisodeStore folder to write")
    suite = instantiate(cfg.suite)
    tasks = list(cfg.tasks) if cfg.get("tasks") else suite.task_names
    n = int(cfg.episodes_per_task)
    noise = float(cfg.noise)
    rot = float(cfg.get("rotation_noise", 1.0))
    for name, v in (("noise", noise), ("rotation_noise", rot)):
        if v < 0:                            # fail before anything is written (the expert checks too, later)
            raise ValueError(f"{name} must be >= 0, got {v}")
    out = ctx.path(cfg.out)
    kw = dict(cameras={c: suite.image_size for c in suite.cameras}, state_dim=suite.state_dim,
              action_dim=suite.action_space.dim, fps=suite.fps, action_space=suite.action_space,
              embodiment="panda", source="scripted",
              info={"suite": suite.describe(), "collect": OmegaConf.to_container(cfg, resolve=True)})
    store = EpisodeStore.create(out, overwrite=True, **kw) if cfg.get("overwrite") else \
        EpisodeStore.open_or_create(out, **kw)
    have = {t: store.task_names.count(t) for t in tasks}
    total = sum(max(0, n - have[t]) for t in tasks)
    if total < sum(n for _ in tasks):
        log.info("continuing %s: already stored %s", out, have)
    workers = max(1, min(int(cfg.get("workers") or 1), len(tasks)))
    if workers > 1:
        stats = _collect_parallel(cfg, suite, tasks, n, noise, out, have, total, workers, rot)
    else:
        stats = _collect_tasks(suite, tasks, n, noise, int(cfg.seed), str(out), have, total, rotation_noise=rot)
    store = EpisodeStore.open(out, mode="r")
    for t, s in stats.items():
        s["success_rate"] = s["successes"] / s["episodes"] if s["episodes"] else None
        log.info("%-22s %d new episodes, success %s", t, s["episodes"], s["success_rate"])
    succ = store.successes
    return {"store": str(out), "episodes_in_store": len(store), "steps_in_store": int(store.lengths.sum()),
            "store_success_rate": float(np.mean(succ)) if len(succ) else None,
            "noise": noise, "rotation_noise": rot, "episodes_per_task": n, "new": stats}


@hydra.main(version_base="1.3", config_path="pkg://configs", config_name="collect")
def main(cfg: DictConfig) -> None:
    run_main(cfg, run, "collect")


if __name__ == "__main__":
    main()
