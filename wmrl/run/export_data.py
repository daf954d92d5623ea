"""``wmrl export``: EpisodeStore -> LeRobotDataset v3 folder, written through ``lerobot`` itself.

    wmrl export store=stores/lift out=exports/lift_lerobot repo_id=local/lift

Feature mapping and what goes into ``meta/wmrl.json``: :mod:`wmrl.kernel.storage.lerobot_io`. The
folder loads offline with ``LeRobotDataset(repo_id, root=out)`` (``HF_HUB_OFFLINE=1``), and
``wmrl import source=out`` gives the same arrays back (images bit-exact: PNG image features).
With ``verify=true`` (default) the run reloads the folder with lerobot and checks the episode and
frame counts before reporting.
"""

from __future__ import annotations

import logging
import os
import time

import hydra
from omegaconf import DictConfig

from wmrl.run.common import RunContext, run_main

log = logging.getLogger("wmrl.export")


def run(cfg: DictConfig, ctx: RunContext) -> dict:
    """Export ``cfg.store`` to ``cfg.out``; return the report dict (episodes, frames, lengths,
    features, timings in seconds, verification result)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from wmrl.kernel.storage import EpisodeStore
    from wmrl.kernel.storage.lerobot_io import LeRobotFormatError, export_lerobot

    t_start = time.time()
    store_path, out = ctx.path(cfg.store), ctx.path(cfg.out)
    store = EpisodeStore.open(store_path, mode="r")
    episodes = list(cfg.episodes) if cfg.get("episodes") is not None else None
    repo_id = str(cfg.get("repo_id") or "local/wmrl")
    rep = export_lerobot(store, out, repo_id=repo_id, overwrite=bool(cfg.get("overwrite", False)),
                         episodes=episodes, progress=bool(cfg.get("progress", True)))
    report = {"store": str(store_path), "out": str(out), "repo_id": repo_id, **rep,
              "export_s": round(time.time() - t_start, 3)}
    if cfg.get("verify", True):
        from lerobot.datasets.lerobot_dataset import LeRobotDataset

        t0 = time.time()
        ds = LeRobotDataset(repo_id, root=out, video_backend="pyav")
        got = {"episodes": int(ds.num_episodes), "frames": int(ds.num_frames)}
        want = {"episodes": rep["episodes"], "frames": rep["frames"]}
        if got != want:
            raise LeRobotFormatError(out, f"reloaded with lerobot it has {got}, expected {want}")
        report["verify"] = {"loaded_with": "lerobot.datasets.lerobot_dataset.LeRobotDataset", **got,
                            "codebase_version": str(getattr(ds.meta.info, "codebase_version", "?")),
                            "seconds": round(time.time() - t0, 3)}
    log.info("exported %d episodes (%d frames) to %s", rep["episodes"], rep["frames"], out)
    return report


@hydra.main(version_base="1.3", config_path="pkg://configs", config_name="export")
def main(cfg: DictConfig) -> None:
    run_main(cfg, run, "export")


if __name__ == "__main__":
    main()
