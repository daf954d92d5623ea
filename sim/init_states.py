"""Init states of the suite, stored as data in the repo (``sim/data/init_states.npz``).

Keys ``"<scene>/train"`` (``N_TRAIN`` states) and ``"<scene>/eval"`` (``N_EVAL = 50`` states):
``float64 (N, 1 + nq + nv)`` flattened MuJoCo states (time, qpos, qvel) with the robot at its
default joint configuration and the objects at rest. Every task of a scene uses its scene's states.
State ``i`` of a split was sampled by ``sim.tasks.sample_layout`` with the generator
``numpy.random.default_rng([crc32(scene), split_id, i])`` (train 0, eval 1), so the file can be
regenerated and checked (``python -m sim.init_states --check``); train and eval never share a state.

Regenerate (only when a scene changes): ``python -m sim.init_states --write``.
"""

from __future__ import annotations

import argparse
import zlib
from functools import lru_cache
from pathlib import Path

import numpy as np

from sim.scenes import RED_HALF, GREEN_HALF, SCENES, TABLE_TOP, TARGET_HALF_HEIGHT
from sim.tasks import sample_layout

PATH = Path(__file__).resolve().parent / "data" / "init_states.npz"
N_TRAIN = 200
N_EVAL = 50
SPLITS = {"train": 0, "eval": 1}
HALF = {"red": RED_HALF, "green": GREEN_HALF, "target": TARGET_HALF_HEIGHT}


def layout_rng(scene: str, split: str, index: int) -> np.random.Generator:
    return np.random.default_rng([zlib.crc32(scene.encode()), SPLITS[split], int(index)])


def build_state(env, layout: dict) -> np.ndarray:
    """Flattened state of ``env`` (a ``TaskEnv``) with the objects placed per ``layout``."""
    mj_model = env.model
    env.rs.reset()
    sim = env.sim
    for name, (x, y, yaw) in layout.items():
        obj = env.rs.objects[name]
        if name == "target":
            sim.data.set_joint_qpos(obj.joints[0], x)
            sim.data.set_joint_qpos(obj.joints[1], y)
            continue
        quat = np.array([np.cos(yaw / 2), 0.0, 0.0, np.sin(yaw / 2)])  # wxyz, about z
        sim.data.set_joint_qpos(obj.joints[0], np.concatenate([[x, y, TABLE_TOP + HALF[name]], quat]))
    sim.data.qvel[:] = 0.0
    sim.forward()
    del mj_model
    return env.sim_state()


def generate(scene: str, split: str, n: int) -> np.ndarray:
    from sim.env import TaskEnv

    env = TaskEnv(scene, cameras=())
    return np.stack([build_state(env, sample_layout(scene, layout_rng(scene, split, i))) for i in range(n)])


@lru_cache(maxsize=4)
def load(path: str | None = None) -> dict[str, np.ndarray]:
    """All stored init states ``{"<scene>/<split>": float64 (N, S)}`` (read-only arrays)."""
    p = Path(path) if path else PATH
    if not p.is_file():
        raise FileNotFoundError(f"init-state file {p} not found; regenerate it with `python -m sim.init_states --write`")
    with np.load(p, allow_pickle=False) as z:
        out = {k: z[k] for k in z.files}
    for v in out.values():
        v.setflags(write=False)
    return out


def _scene_of(name: str) -> str:
    from sim.tasks import TASKS

    if name in TASKS:
        return TASKS[name].scene
    if name in SCENES:
        return name
    raise ValueError(f"{name!r} is neither a task ({sorted(TASKS)}) nor a scene ({list(SCENES)})")


def get(scene: str, split: str, index: int, path: str | None = None) -> np.ndarray:
    """Init state ``index`` of ``split`` of a scene (or of a task's scene: ``scene`` may be a task
    name, so ``get`` fits ``SimEnv(init_states=...)``); a copy, ``float64 (1 + nq + nv,)``.

    Raises:
        ValueError: unknown task/scene or split, or index out of range (the message gives the range).
    """
    scene = _scene_of(scene)
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
    arr = load(path)[f"{scene}/{split}"]
    if not 0 <= int(index) < len(arr):
        raise ValueError(f"init index {index} out of range: scene {scene!r} has {len(arr)} {split} init states")
    return arr[int(index)].copy()


def count(scene: str, split: str, path: str | None = None) -> int:
    """Number of init states of ``split`` of a scene (or a task's scene)."""
    scene = _scene_of(scene)
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
    return int(len(load(path)[f"{scene}/{split}"]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", action="store_true", help="regenerate sim/data/init_states.npz")
    ap.add_argument("--check", action="store_true", help="regenerate in memory and compare with the file")
    args = ap.parse_args(argv)
    data = {f"{s}/{sp}": generate(s, sp, N_TRAIN if sp == "train" else N_EVAL) for s in SCENES for sp in SPLITS}
    if args.write:
        PATH.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(PATH, **data)
        print(f"wrote {PATH}: " + ", ".join(f"{k} {v.shape}" for k, v in data.items()))
    if args.check:
        stored = load()
        same = all(np.array_equal(stored[k], v) for k, v in data.items())
        print("identical" if same else "DIFFERENT")
        return 0 if same else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
