"""Check wmrl's LIBERO env (``sim.libero.env.LiberoEnv``) against lerobot 0.6.1's own ``LiberoEnv``.

Run in the LIBERO environment (``bash scripts/setup_libero.sh`` first)::

    MUJOCO_GL=egl OMP_NUM_THREADS=1 .venv-libero/bin/python scripts/check_libero.py \\
        --suites libero_spatial libero_object libero_goal libero_10 --exact-inits 0-49 --inits 0-49 --trace-inits 0 \\
        --out runs/libero_check.json

For every task of the chosen suites it checks that the MuJoCo state just after ``set_init_state``
equals the official init state bit for bit for every ``--exact-inits`` index (cheap: no settle
steps), and for every ``--inits`` index it resets both envs (hard reset, same seed: the init
index; 4-5 s each on a small CPU) and checks that

* the MuJoCo state just after ``set_init_state`` equals the official init state (``reset_exact``);
* the first frame (after the 10 settle steps) of both cameras is pixel-identical to lerobot's,
  taken through lerobot's own ``preprocess_observation`` + ``LiberoProcessorStep`` (the
  180-degree rotation LIBERO-trained policies see), and the 8-D proprio equals lerobot's
  ``observation.state`` (``frame_equal``, ``proprio_max_abs``);

and for the ``--trace-inits`` it runs one fixed 100-step action sequence (seeded, smooth in xyz,
the gripper closing and opening) in both and compares the per-step success flags (``trace_equal``),
frames and MuJoCo states. It writes a JSON report with one row per (suite, task, init) and prints
the totals and its time. Exit status 1 when any check fails. ``--on-demand`` checks the same with
our env rendering only where frames are read (``LiberoEnv(cameras="on_demand")``, what
``wmrl evaluate suite=libero_*`` uses with ``suite.frames=requests``): the trace then reads its
frames every ``--frame-every`` steps, and the states must still match at every step.
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

configure()  # before anything imports libero.libero

from sim.libero import parse_range
from sim.libero.env import LiberoEnv, suite_tasks


def fixed_actions(steps: int, seed: int = 0) -> np.ndarray:
    """``float32 (steps, 7)`` (what a policy sends through the bridge): smoothed random xyz / rotation
    deltas, the gripper closed in the middle third."""
    rng = np.random.default_rng(seed)
    a = np.zeros((steps, 7))
    noise = rng.uniform(-1, 1, size=(steps, 6))
    for t in range(steps):
        a[t, :6] = 0.8 * (a[t - 1, :6] if t else 0) + 0.2 * noise[t]
    a[:, :3] *= 3.0
    a[:, 3:6] *= 0.5
    a[:, :6] = np.clip(a[:, :6], -1, 1)
    a[:, 6] = np.where((np.arange(steps) >= steps // 3) & (np.arange(steps) < 2 * steps // 3), 1.0, -1.0)
    return a.astype(np.float32)


class LerobotRef:
    """lerobot 0.6.1's ``LiberoEnv`` on one task, its observations through lerobot's processor."""

    def __init__(self, suite: str, task_index: int, size: tuple[int, int]):
        from lerobot.envs.libero import LiberoEnv as LeLiberoEnv
        from lerobot.processor.env_processor import LiberoProcessorStep
        from libero.libero import benchmark

        bench = benchmark.get_benchmark_dict()[suite]()
        self.env = LeLiberoEnv(bench, task_index, suite, obs_type="pixels_agent_pos", observation_height=size[0],
                               observation_width=size[1], init_states=True, episode_index=0, n_envs=1)
        self.proc = LiberoProcessorStep()

    def frames(self, obs):
        from lerobot.envs.utils import preprocess_observation

        def batched(x):  # what lerobot's vector env hands its processor: a leading env axis
            return {k: batched(v) for k, v in x.items()} if isinstance(x, dict) else np.asarray(x)[None]

        p = self.proc._process_observation(preprocess_observation(batched(obs)))
        imgs = {"agentview": p["observation.images.image"][0], "robot0_eye_in_hand": p["observation.images.image2"][0]}
        out = {c: (v * 255).round().clamp(0, 255).to(dtype=__import__("torch").uint8).numpy() for c, v in imgs.items()}
        return out, p["observation.state"][0].numpy()

    def reset(self, init_index: int, seed: int):
        self.env.init_state_id = init_index
        obs, _ = self.env.reset(seed=seed)
        return self.frames(obs)

    def step(self, a):
        obs, _, _, _, info = self.env.step(np.asarray(a, np.float32))
        f, s = self.frames(obs)
        return f, s, bool(info["is_success"])

    def sim_state(self):
        return np.asarray(self.env._env.get_sim_state(), np.float64)

    def close(self):
        self.env.close()


def frames_equal(a: dict, b: dict) -> tuple[bool, int]:
    diff = sum(int((a[c].astype(np.int16) != b[c].astype(np.int16)).sum()) for c in a)
    return diff == 0, diff


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suites", nargs="+", default=["libero_spatial", "libero_object", "libero_goal", "libero_10"])
    ap.add_argument("--tasks", default=None, help="task indices, e.g. 0-9 or 0,3 (default: all)")
    ap.add_argument("--exact-inits", default="0-49", help="init states checked for an exact set_init_state (cheap)")
    ap.add_argument("--inits", default="0-49", help="init states reset in both envs and compared (4-5 s each per env)")
    ap.add_argument("--trace-inits", default="0", help="init states that also run the 100-step action sequence")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--size", type=int, nargs=2, default=[128, 128], metavar=("H", "W"))
    ap.add_argument("--out", default="runs/libero_check.json")
    ap.add_argument("--on-demand", action="store_true",
                    help="our env renders only when frames are read (LiberoEnv(cameras='on_demand')); the trace "
                         "then reads frames only every --frame-every steps, and its states must still match at every step")
    ap.add_argument("--frame-every", type=int, default=8, help="with --on-demand: the trace's frame interval")
    ap.add_argument("--build-only", action="store_true",
                    help="only build each task, reset it (init 0, or the env's own placement for libero_90) and step once")
    args = ap.parse_args(argv)
    size = (args.size[0], args.size[1])
    if args.build_only:
        return build_only(args.suites, args.tasks, size, Path(args.out))
    inits, trace_inits = parse_range(args.inits), set(parse_range(args.trace_inits))
    actions = fixed_actions(args.steps)
    exact_inits = parse_range(args.exact_inits)
    rows, exact_rows, t_start = [], [], time.monotonic()
    for suite in args.suites:
        tasks = suite_tasks(suite)
        chosen = parse_range(args.tasks) if args.tasks else range(len(tasks))
        ours = LiberoEnv(suite, image_size=size, cameras="on_demand" if args.on_demand else True)
        for ti in chosen:
            t0 = time.monotonic()
            task = ours.load(ti)
            ref = LerobotRef(suite, ti, size)
            # every official init state: the MuJoCo state right after set_init_state equals it bit for bit
            exact = []
            for k in exact_inits:
                ours._env.set_init_state(ours.init_state(k))
                exact.append(bool(np.array_equal(ours.sim_state(), ours.init_state(k))))
            exact_rows.append({"suite": suite, "task": task.name, "inits": len(exact), "exact": sum(exact),
                               "num_init_states": ours.num_init_states})
            for k in inits:
                row = {"suite": suite, "task": task.name, "task_index": ti, "init": k}
                ours._env.set_init_state(ours.init_state(k))
                row["reset_exact"] = bool(np.array_equal(ours.sim_state(), ours.init_state(k)))
                tr = time.monotonic()
                o = ours.reset(k, seed=k)
                row["reset_s"] = time.monotonic() - tr
                f_ref, s_ref = ref.reset(k, seed=k)
                row["frame_equal"], row["frame_diff_pixels"] = frames_equal(o["images"], f_ref)
                row["proprio_max_abs"] = float(np.abs(o["proprio"] - s_ref).max())
                row["state_equal_after_settle"] = bool(np.array_equal(ours.sim_state(), ref.sim_state()))
                if k in trace_inits:
                    ta = time.monotonic()
                    tr_ours, tr_ref, fr_ok, st_ok = [], [], True, True
                    for t, a in enumerate(actions):
                        read = not args.on_demand or t % args.frame_every == args.frame_every - 1
                        o, _, s1, _ = ours.step(a, images=read)
                        f2, _, s2 = ref.step(a)
                        tr_ours.append(s1)
                        tr_ref.append(s2)
                        if read:
                            fr_ok &= frames_equal(o["images"], f2)[0]
                        st_ok &= bool(np.array_equal(ours.sim_state(), ref.sim_state()))
                    row.update(trace_equal=tr_ours == tr_ref, trace_successes=int(sum(tr_ours)),
                               trace_frames_equal=fr_ok, trace_states_equal=st_ok,
                               trace_s=time.monotonic() - ta)
                rows.append(row)
            ref.close()
            last = [r for r in rows if r["suite"] == suite and r["task_index"] == ti]
            print(f"{suite} task {ti} {task.name[:60]}: build {ours.build_s:.1f} s, {len(last)} inits "
                  f"reset_exact {sum(r['reset_exact'] for r in last)} frame_equal {sum(r['frame_equal'] for r in last)}"
                  f" trace_equal {sum(r.get('trace_equal', False) for r in last)}/{sum('trace_equal' in r for r in last)}"
                  f" ({time.monotonic() - t0:.0f} s)", flush=True)
        ours.close()
    total_s = time.monotonic() - t_start
    traced = [r for r in rows if "trace_equal" in r]
    summary = {
        "suites": args.suites, "inits": args.inits, "trace_inits": args.trace_inits, "image_size": list(size),
        "tasks": len({(r["suite"], r["task"]) for r in rows}), "exact_inits": args.exact_inits,
        "set_init_state_checked": sum(r["inits"] for r in exact_rows),
        "set_init_state_exact": sum(r["exact"] for r in exact_rows), "resets": len(rows),
        "reset_exact": sum(r["reset_exact"] for r in rows), "frame_equal": sum(r["frame_equal"] for r in rows),
        "state_equal_after_settle": sum(r["state_equal_after_settle"] for r in rows),
        "proprio_max_abs": max((r["proprio_max_abs"] for r in rows), default=0.0),
        "traces": len(traced), "trace_equal": sum(r["trace_equal"] for r in traced),
        "trace_frames_equal": sum(r["trace_frames_equal"] for r in traced),
        "trace_states_equal": sum(r["trace_states_equal"] for r in traced),
        "trace_successes": sum(r["trace_successes"] for r in traced),
        "time_s": total_s, "versions": versions(), "on_demand": bool(args.on_demand),
        "trace_frames_compared_every": args.frame_every if args.on_demand else 1,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"summary": summary, "rows": rows, "set_init_state": exact_rows}, indent=1))
    print(json.dumps(summary, indent=1))
    ok = (summary["reset_exact"] == summary["frame_equal"] == summary["resets"]
          and summary["set_init_state_exact"] == summary["set_init_state_checked"]
          and summary["trace_equal"] == summary["traces"])
    print(f"check_libero: {'OK' if ok else 'FAILED'} in {total_s:.0f} s; report {out}")
    return 0 if ok else 1


def build_only(suites: list[str], tasks_spec: str | None, size: tuple[int, int], out: Path) -> int:
    """Every task of ``suites`` builds from its BDDL file, resets and steps once (``--build-only``)."""
    rows, t0 = [], time.monotonic()
    for suite in suites:
        env = LiberoEnv(suite, image_size=size)
        for ti in (parse_range(tasks_spec) if tasks_spec else range(len(env.tasks))):
            row = {"suite": suite, "task_index": ti}
            try:
                task = env.load(ti)
                tr = time.monotonic()
                o = env.reset(0, seed=0)
                o, _, _, _ = env.step(np.zeros(7, np.float32))
                row.update(task=task.name, ok=bool(all(v.shape == (3, *size) for v in o["images"].values())),
                           build_s=env.build_s, reset_s=time.monotonic() - tr, init_states=env.num_init_states)
            except Exception as e:  # noqa: BLE001 - reported per task
                row.update(ok=False, error=f"{type(e).__name__}: {e}")
            rows.append(row)
            print(f"{suite} task {ti}: {'ok' if row['ok'] else 'FAILED ' + row.get('error', '')} "
                  f"(build {row.get('build_s', 0):.1f} s)", flush=True)
        env.close()
    n_ok = sum(r["ok"] for r in rows)
    summary = {"suites": suites, "tasks": len(rows), "built_reset_stepped": n_ok, "time_s": time.monotonic() - t0,
               "versions": versions()}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    print(f"check_libero --build-only: {n_ok}/{len(rows)} tasks built, reset and stepped in {summary['time_s']:.0f} s; "
          f"report {out}")
    return 0 if n_ok == len(rows) else 1


def versions() -> dict:
    from importlib.metadata import version

    return {p: version(p) for p in ("mujoco", "robosuite", "hf-libero", "lerobot", "numpy")} | {
        "MUJOCO_GL": os.environ.get("MUJOCO_GL", "")}


if __name__ == "__main__":
    raise SystemExit(main())
