"""The libero_object scripted expert (``sim.libero.expert.ObjectPlaceExpert``) on the official init
states: success per task with 95 % Wilson intervals, and optionally its episodes recorded into an
EpisodeStore (LIBERO's action space, cameras ``agentview`` / ``robot0_eye_in_hand``) as demonstrations.

Run in the LIBERO environment (``bash scripts/setup_libero.sh`` first)::

    MUJOCO_GL=egl OMP_NUM_THREADS=1 .venv-libero/bin/python scripts/libero_expert.py --tasks 0-9 --inits 0-49 \\
        --out runs/libero_expert.json                                    # state only (no rendering), ~6 s an episode here
    MUJOCO_GL=egl .venv-libero/bin/python scripts/libero_expert.py --tasks 0 --inits 0-4 --store runs/libero_demos
        # with both cameras rendered and recorded (~40 s an episode here)
    ... --placement sampled --inits 0-19 --size 64 64 --store runs/libero_demos
        # demonstrations on 20 placements of the env's own sampler, none of them an official init state

The protocol is the evaluation's (``sim.libero.env.LiberoEnv``: seed, reset, init state, 10 settle
steps, the 280-step limit, success = LIBERO's ``check_success``). The expert uses privileged state
(object and basket positions), never the frames, so its success does not depend on ``--store``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from sim.libero.setup_env import configure

configure()

from sim.libero import parse_range
from sim.libero.env import LiberoEnv, libero_action_space
from sim.libero.expert import ObjectPlaceExpert
from wmrl.rl.evaluate import wilson_interval


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", default="0-9")
    ap.add_argument("--inits", default="0-49")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--placement", choices=["official", "sampled"], default="official",
                    help="official: the official init states --inits; sampled: the env's own object placement, "
                         "seeded by seed * 100000 + k for k in --inits (demonstrations away from the official "
                         "init states that evaluation uses)")
    ap.add_argument("--store", default=None, help="record every episode (with frames) into this EpisodeStore")
    ap.add_argument("--size", type=int, nargs=2, default=[128, 128], metavar=("H", "W"))
    ap.add_argument("--out", default="runs/libero_expert.json")
    args = ap.parse_args(argv)
    record = args.store is not None
    env = LiberoEnv("libero_object", image_size=tuple(args.size), cameras=record)
    store = None
    if record:
        from wmrl.kernel.storage import EpisodeStore

        store = EpisodeStore.open_or_create(
            args.store, cameras={"agentview": tuple(args.size), "robot0_eye_in_hand": tuple(args.size)}, state_dim=8,
            action_dim=7, fps=20.0, action_space=libero_action_space(), embodiment="panda",
            source="scripted:libero_object")
    rows, t0 = [], time.monotonic()
    for ti in parse_range(args.tasks):
        task = env.load(ti)
        obj = env.objects_of_interest()[0]
        tt = time.monotonic()
        for k in parse_range(args.inits):
            sampled = args.placement == "sampled"
            ep_seed = args.seed * 100000 + k if sampled else args.seed
            o = env.reset(None if sampled else k, seed=ep_seed)
            expert = ObjectPlaceExpert(obj)
            frames = {c: [] for c in o["images"]}
            proprio, actions, success, steps = [], [], False, 0
            done = False
            while not done:
                a = expert.act(env.raw).astype(np.float32)
                for c, v in o["images"].items():
                    frames[c].append(v)
                proprio.append(o["proprio"])
                actions.append(a)
                o, _, success, done = env.step(a)
                steps += 1
            rows.append({"task": task.name, "task_index": ti, "init_index": None if sampled else k, "seed": ep_seed,
                         "success": bool(success), "steps": steps, "phase": expert.phase})
            if store is not None:
                from wmrl.kernel.types import Episode

                T = len(actions)
                store.append(Episode(
                    images={c: np.stack(v) for c, v in frames.items()}, proprio=np.stack(proprio),
                    actions=np.stack(actions), rewards=np.eye(1, T, T - 1, dtype=np.float32)[0] if success
                    else np.zeros(T, np.float32), success=bool(success), instruction=task.instruction,
                    task_name=task.name, info={"suite": "libero_object", "init_index": -1 if sampled else k,
                                               "placement": args.placement, "seed": ep_seed,
                                               "source": "scripted:libero_object"}))
        mine = [r for r in rows if r["task_index"] == ti]
        n_ok = sum(r["success"] for r in mine)
        lo, hi = wilson_interval(n_ok, len(mine))
        print(f"task {ti} {task.name}: {n_ok}/{len(mine)} (95 % CI {lo:.2f}-{hi:.2f}) in {time.monotonic() - tt:.0f} s",
              flush=True)
    env.close()
    per_task = {}
    for r in rows:
        per_task.setdefault(r["task"], []).append(r["success"])
    summary = {t: {"successes": sum(v), "episodes": len(v), "rate": sum(v) / len(v),
                   "ci95": list(wilson_interval(sum(v), len(v)))} for t, v in per_task.items()}
    at80 = sum(v["rate"] >= 0.8 for v in summary.values())
    report = {"per_task": summary, "tasks_at_or_above_80pct": at80, "episodes": rows, "inits": args.inits,
              "placement": args.placement,
              "time_s": time.monotonic() - t0, "recorded_to": args.store}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"libero_expert: {at80} of {len(summary)} tasks at >= 80 % on inits {args.inits}; "
          f"{time.monotonic() - t0:.0f} s; report {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
