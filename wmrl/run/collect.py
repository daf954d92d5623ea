"""``wmrl collect``: scripted-expert episodes of the sim suite -> EpisodeStore.

    wmrl collect suite=default episodes_per_task=100 noise=0.6 out=stores/demos

Episode ``i`` of a task starts from training init state ``i`` (mod the number of them) with seed
``sim.suite.collect_seed(seed, task, i)``; each Episode carries its MuJoCo states and
``info = {task, init_index, split: "train", seed, noise, failure, ...}``. Failed episodes are kept.
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


def run(cfg: DictConfig, ctx: RunContext) -> dict:
    from sim.collect import collect_episodes
    from wmrl.storage import EpisodeStore

    if cfg.get("out") in (None, "", "???"):
        raise ValueError("out=PATH is required: the EpisodeStore folder to write")
    suite = instantiate(cfg.suite)
    tasks = list(cfg.tasks) if cfg.get("tasks") else suite.task_names
    n = int(cfg.episodes_per_task)
    noise = float(cfg.noise)
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
    stats = {t: {"episodes": 0, "successes": 0, "steps": 0} for t in tasks}
    bar = tqdm(total=total, desc="collect", unit="ep")
    for t in tasks:
        for ep in collect_episodes(suite, n, noise=noise, seed=int(cfg.seed), tasks=[t], start_index=have[t]):
            store.append(ep)
            s = stats[t]
            s["episodes"] += 1
            s["successes"] += int(ep.success)
            s["steps"] += ep.length
            bar.update(1)
            bar.set_postfix(task=t, success=f"{s['successes']}/{s['episodes']}")
    bar.close()
    for t, s in stats.items():
        s["success_rate"] = s["successes"] / s["episodes"] if s["episodes"] else None
        log.info("%-22s %d new episodes, success %s", t, s["episodes"], s["success_rate"])
    succ = store.successes
    return {"store": str(out), "episodes_in_store": len(store), "steps_in_store": int(store.lengths.sum()),
            "store_success_rate": float(np.mean(succ)) if len(succ) else None,
            "noise": noise, "episodes_per_task": n, "new": stats}


@hydra.main(version_base="1.3", config_path="pkg://configs", config_name="collect")
def main(cfg: DictConfig) -> None:
    run_main(cfg, run, "collect")


if __name__ == "__main__":
    main()
