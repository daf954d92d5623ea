"""What happened in the sim where an imagined rollout closed its gripper: the imagination check's
rollouts (``wmrl imagination-check``, ``rollouts.npz``) replayed step by step from their start
states, read at the first chunk whose gripper command turns closed.

    .venv/bin/python scripts/replay_closes.py --check runs/my_check [--tasks lift_red lift_green] [--out closes.json]

For every rollout (of ``--tasks``; default all) that closes inside its imagined chunks, with the
object its task moves (``TaskSpec.obj``: the lifted cube, the cube to stack), grouped by outcome (``both``: succeeded in imagination and in the sim,
``imag_only``, ``real_only``, ``neither``):

* ``force_before_n`` / ``force_close_n``: the normal contact force between the gripper and that
  object (N, ``sim.env.TaskEnv.gripper_contact_forces``), averaged over the control steps of the
  chunk before the close and of the closing chunk;
* ``push_cm``: how far the object slid in the table plane from the start to the closing chunk's end;
* ``real_short_z_cm`` / ``real_short_xy_cm``: the real end effector at the closing chunk's end minus
  its commanded target there (the last step's absolute target, clipped as the arm control clips
  it; absolute action spaces only, else ``None``): positive z = the arm stopped above its target;
* ``imagined_minus_real_z_cm``: the imagined end effector's height at that chunk's end minus the
  real one's (negative: imagination put the arm lower).

Per group: the count and, per figure, the median, 10th and 90th percentiles; ``force_above_1n``:
the fraction of rollouts whose mean force before the close exceeds 1 N. Written as JSON (default
``<check>/closes.json``) and printed. docs/measurements.md, "Why the real arm stops higher at the
close", reads seed 1's check this way.

Raises ``SystemExit`` with a message when the check folder lacks ``config.yaml`` or a
``rollouts.npz`` with actions and start states (checks before commit 6b0bdf5 did not keep them).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

GROUPS = ("both", "imag_only", "real_only", "neither")
FIGURES = ("force_before_n", "force_close_n", "push_cm", "real_short_z_cm", "real_short_xy_cm",
           "imagined_minus_real_z_cm")


def first_close(gripper: np.ndarray) -> int | None:
    """Index of the first chunk whose gripper command (its last step's, in [-1, 1]; NaN past the
    rollout's end) is closed (> 0) after an open one, or ``None``."""
    n = int(np.isfinite(gripper).sum())
    for j in range(1, n):
        if gripper[j] > 0 and gripper[j - 1] <= 0:
            return j
    return None


def replay_closes(suite, z, tasks=None) -> dict:
    """Per-rollout close figures (see the module docstring) of the check's ``rollouts.npz`` ``z``
    (a mapping of arrays) replayed in ``suite``'s sim; ``tasks``: only rollouts of these task names
    (``None``: all). Returns ``{"rollouts": [...], "groups": {...}}``.

    Raises:
        ValueError: ``z`` lacks an array the replay needs (a check older than commit 6b0bdf5)."""
    from wmrl.kernel.types import Start

    for key in ("actions", "start_state", "init_index", "split", "gripper", "imagined", "replayed", "imagined_ends"):
        if key not in z:
            raise ValueError(f"rollouts.npz has no {key!r}: rerun the imagination check with this version of wmrl")
    env = suite.make_env(1, auto_reset=False, cameras=())
    acts = z["actions"]
    H = acts.shape[2]
    rows = []
    for i in range(len(z["task"])):
        name = str(z["task"][i])
        if tasks is not None and name not in tasks:
            continue
        obj = getattr(suite.task(name), "obj", None)
        k = first_close(z["gripper"][i])
        if obj is None or k is None:
            continue
        st = z["start_state"][i]
        env.reset([Start(task_name=name, instruction="", split=str(z["split"][i]),
                         init_index=None if int(z["init_index"][i]) < 0 else int(z["init_index"][i]),
                         sim_state=st if np.isfinite(st).all() else None)])
        te = env.task_env(0)
        o0 = te.privileged()["objects"][obj]["pos"].copy()
        before, close = [], []
        for j in range(k + 1):
            for h in range(H):
                p_before, _ = te.eef_pose()
                te.step(acts[i, j, h])
                if j >= k - 1:
                    (close if j == k else before).append(te.gripper_contact_forces()[obj])
        pv = te.privileged()
        p1, _ = te.eef_pose()
        c = te.control
        short_z = short_xy = None
        if getattr(c.action_space, "mode", None) == "absolute" and hasattr(c, "max_step_m"):
            tgt = np.clip(np.clip(acts[i, k, -1, :3], p_before - c.max_step_m, p_before + c.max_step_m), c.low, c.high)
            short_z, short_xy = 100 * (p1[2] - tgt[2]), 100 * float(np.linalg.norm(p1[:2] - tgt[:2]))
        im, re = bool(z["imagined"][i]), bool(z["replayed"][i])
        rows.append({"index": i, "task": name, "close_chunk": k,
                     "group": "both" if im and re else "imag_only" if im else "real_only" if re else "neither",
                     "force_before_n": float(np.mean(before)) if before else None, "force_close_n": float(np.mean(close)),
                     "push_cm": 100 * float(np.linalg.norm(pv["objects"][obj]["pos"][:2] - o0[:2])),
                     "real_short_z_cm": short_z, "real_short_xy_cm": short_xy,
                     "imagined_minus_real_z_cm": 100 * float(z["imagined_ends"][i, k, 2] - p1[2])})
    groups = {}
    for g in GROUPS:
        sel = [r for r in rows if r["group"] == g]
        if not sel:
            continue
        d = {"n": len(sel)}
        for f in FIGURES:
            v = np.array([r[f] for r in sel if r[f] is not None], dtype=float)
            d[f] = {"median": float(np.median(v)), "p10": float(np.percentile(v, 10)),
                    "p90": float(np.percentile(v, 90))} if len(v) else None
        fb = np.array([r["force_before_n"] for r in sel if r["force_before_n"] is not None])
        d["force_above_1n"] = float(np.mean(fb > 1.0)) if len(fb) else None
        groups[g] = d
    return {"rollouts": rows, "groups": groups}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", required=True, help="an imagination check's run folder (config.yaml, rollouts.npz)")
    ap.add_argument("--tasks", nargs="*", default=None, help="only these tasks (default: all)")
    ap.add_argument("--out", default=None, help="JSON report (default <check>/closes.json)")
    a = ap.parse_args(argv)
    chk = Path(a.check)
    if not (chk / "config.yaml").is_file() or not (chk / "rollouts.npz").is_file():
        raise SystemExit(f"{chk} is not an imagination check folder: it needs config.yaml and rollouts.npz")
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    suite = instantiate(OmegaConf.load(chk / "config.yaml").suite)
    with np.load(chk / "rollouts.npz") as z:
        try:
            rep = replay_closes(suite, dict(z), a.tasks)
        except ValueError as e:
            raise SystemExit(f"{chk}: {e}") from None
    out = Path(a.out) if a.out else chk / "closes.json"
    out.write_text(json.dumps(rep, indent=1))
    print(f"closes inside the imagined rollouts of {chk}{' (' + ', '.join(a.tasks) + ')' if a.tasks else ''} (medians; force: gripper on the object, N):")
    print(f"  {'group':10s} {'n':>4s} {'force before':>12s} {'>1 N':>5s} {'at close':>9s} {'push cm':>8s} "
          f"{'z short cm':>10s} {'xy short cm':>11s} {'imag-real z':>11s}")
    for g, d in rep["groups"].items():
        med = lambda f, d=d: f"{d[f]['median']:.2f}" if d[f] else "-"
        print(f"  {g:10s} {d['n']:4d} {med('force_before_n'):>12s} {d['force_above_1n'] or 0:5.2f} {med('force_close_n'):>9s} "
              f"{med('push_cm'):>8s} {med('real_short_z_cm'):>10s} {med('real_short_xy_cm'):>11s} "
              f"{med('imagined_minus_real_z_cm'):>11s}")
    print(f"written {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
