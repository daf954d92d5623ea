"""Retrain only the finger-gap head of a trained world model (``worldmodels.train.retrain_grasp_head``),
everything else frozen, and compare the old and new head on held-out grasps.

Used to compare heads on one world model without retraining it (docs/measurements.md, "A grasp head
that does not read the imagined wrist frame")::

    .venv/bin/python scripts/retrain_grasp_head.py --run runs/pipeline --out runs/grasp_nowrist --no-wrist
    wmrl imagination-check --config-path runs/pipeline/imagination_check --config-name config \\
        grpo.env.world_model=runs/grasp_nowrist/checkpoints/last hydra.run.dir=runs/check_nowrist

``--run`` is a ``wmrl pipeline`` run directory (its ``worldmodel/checkpoints/last`` and the store it
was trained on, ``worldmodel/config.yaml``'s ``store`` and ``heldout_every``); ``--world-model`` and
``--store`` name them directly instead. Writes ``OUT/checkpoints/last`` (a world-model checkpoint) and
``OUT/report.json``: ``worldmodels.evaluate.grasp_outcome`` of the old and new model on the held-out
episodes, from the close (``lead_chunks`` 0) and from 4 chunks before it (as in an imagined rollout),
with the seconds spent.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import yaml


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=Path, help="a wmrl pipeline run directory")
    ap.add_argument("--world-model", type=Path, help="a world-model checkpoint folder (instead of --run)")
    ap.add_argument("--store", type=Path, help="the episode store it was trained on (instead of --run)")
    ap.add_argument("--heldout-every", type=int, default=None, help="the world model's held-out split (default: the run's, else 5)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--no-wrist", action="store_true", help="a head that does not read the wrist frame (GraspHead wrist=False)")
    ap.add_argument("--steps", type=int, default=700)
    ap.add_argument("--imagined-chunks", type=int, default=3, help="deepest imagined start of the head's windows")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)

    from wmrl.kernel.checkpoint import (
        load_checkpoint,
        read_checkpoint_config,
        save_checkpoint,
    )
    from wmrl.run.data import load_splits
    from worldmodels.evaluate import GRASP_LEAD_CHUNKS, grasp_outcome
    from worldmodels.train import retrain_grasp_head

    torch.set_num_threads(a.threads)
    heldout_every = a.heldout_every
    if a.run is not None:
        run_cfg = yaml.safe_load((a.run / "worldmodel" / "config.yaml").read_text())
        wm_path, store = a.run / "worldmodel" / "checkpoints" / "last", Path(run_cfg["store"])
        heldout_every = heldout_every or int(run_cfg.get("heldout_every", 5))
    elif a.world_model is not None and a.store is not None:
        wm_path, store = a.world_model, a.store
    else:
        ap.error("give --run, or both --world-model and --store")
    heldout_every = heldout_every or 5
    t0 = time.time()
    old = load_checkpoint(wm_path).eval()
    cfg = read_checkpoint_config(wm_path)
    train, held, _ = load_splits(store, heldout_every, old.cameras)
    new, new_cfg = retrain_grasp_head(old, cfg, train, steps=a.steps, head={"wrist": not a.no_wrist},
                                      grasp={"imagined_chunks": a.imagined_chunks}, seed=a.seed)
    save_checkpoint(new, a.out / "checkpoints" / "last", new_cfg)
    report = {"world_model": str(wm_path), "store": str(store), "steps": a.steps, "wrist": not a.no_wrist,
              "imagined_chunks": a.imagined_chunks, "seed": a.seed,
              "old": {"grasp_outcome": grasp_outcome(old, held),
                      "grasp_outcome_lead": grasp_outcome(old, held, lead_chunks=GRASP_LEAD_CHUNKS)},
              "new": {"grasp_outcome": grasp_outcome(new, held),
                      "grasp_outcome_lead": grasp_outcome(new, held, lead_chunks=GRASP_LEAD_CHUNKS)},
              "seconds": round(time.time() - t0, 1)}
    (a.out / "report.json").write_text(json.dumps(report, indent=1))
    for k in ("old", "new"):
        g = report[k]["grasp_outcome_lead"]
        print(f"{k}: {GRASP_LEAD_CHUNKS} chunks before the close: misses called {g['miss_called']}, holds called "
              f"{g['hold_called']}, hold precision {g['hold_precision']} (n={g['n']}, misses {g['misses']})")
    print(f"checkpoint: {a.out / 'checkpoints' / 'last'}; report: {a.out / 'report.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
