"""``scripts/replay_closes.py`` and ``TaskEnv.gripper_contact_forces``: a scripted grasp squeezes the
cube at its close; the same actions 12 cm to the side close on nothing."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from sim.control import EeTargetControl
from sim.expert import ScriptedExpert
from sim.suite import Suite

H = 8


def _script():
    spec = importlib.util.spec_from_file_location("replay_closes", Path(__file__).parents[1] / "scripts" / "replay_closes.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def grasp():
    """A lift_red suite, the start state of train init 0 and the expert's actions from it up to two
    chunks past its close, cut into chunks ``(C, H, 5)``; the forces on the cube along the way."""
    suite = Suite(tasks=["lift_red"], cameras=(), control=EeTargetControl())
    env = suite.make_env(1, auto_reset=False)
    env.reset([suite.train_start("lift_red", 0)])
    te = env.task_env(0)
    state = te.sim_state()
    ex = ScriptedExpert("lift_red", 0.0, 0, control=te.control)
    acts, forces, closed_at = [], [], None
    while closed_at is None or len(acts) < closed_at + 2 * H:
        a = ex.act(te.privileged())
        te.step(a)
        acts.append(a)
        forces.append(te.gripper_contact_forces())
        if closed_at is None and a[-1] > 0:
            closed_at = len(acts) - 1
        assert len(acts) < 200, "the expert never closed the gripper"
    # the close at a chunk's first step (the arm held open before it), so the fingers shut within that chunk
    pre = acts[:closed_at]
    acts = pre + [pre[-1]] * (-len(pre) % H) + acts[closed_at:]
    acts = np.stack(acts + [acts[-1]] * (-len(acts) % H)).reshape(-1, H, 5).astype(np.float32)
    return suite, state, acts, forces


def test_contact_forces_are_zero_apart_and_positive_in_the_grip(grasp):
    _, _, _, forces = grasp
    assert set(forces[0]) >= {"red", "green", "table"}
    assert forces[0]["red"] == 0.0 and all(v >= 0.0 for f in forces for v in f.values())
    assert forces[-1]["red"] > 1.0   # the expert holds the cube two chunks after the close


def _rollouts(state, chunks_list, imagined, replayed):
    m, c = len(chunks_list), max(len(q) for q in chunks_list)
    acts = np.full((m, c, H, 5), np.nan, np.float32)
    grip = np.full((m, c), np.nan, np.float32)
    for i, q in enumerate(chunks_list):
        acts[i, :len(q)] = q
        grip[i, :len(q)] = q[:, -1, -1]
    return {"task": np.array(["lift_red"] * m), "actions": acts, "gripper": grip,
            "start_state": np.stack([state] * m), "init_index": np.full(m, -1), "split": np.array(["train"] * m),
            "imagined": np.array(imagined), "replayed": np.array(replayed),
            "imagined_ends": np.zeros((m, c, 9), np.float32)}


def test_replay_closes_reads_a_squeeze_and_a_miss(grasp):
    mod = _script()
    suite, state, acts, _ = grasp
    aside = acts.copy()
    aside[..., 1] += 0.12
    never = acts.copy()
    never[..., -1] = -1.0                       # never closes: not read
    rep = mod.replay_closes(suite, _rollouts(state, [acts, aside, never], [True, False, True], [False, False, False]))
    rows = {r["index"]: r for r in rep["rollouts"]}
    assert sorted(rows) == [0, 1]
    squeeze, miss = rows[0], rows[1]
    assert squeeze["group"] == "imag_only" and miss["group"] == "neither"
    assert squeeze["close_chunk"] == miss["close_chunk"] == mod.first_close(acts[:, -1, -1])
    assert squeeze["force_close_n"] > 1.0 and miss["force_close_n"] == 0.0 and miss["push_cm"] < 0.01
    assert squeeze["real_short_z_cm"] is not None and np.isfinite(squeeze["imagined_minus_real_z_cm"])
    assert rep["groups"]["imag_only"]["n"] == 1 and rep["groups"]["neither"]["force_above_1n"] == 0.0
    assert mod.replay_closes(suite, _rollouts(state, [acts], [True], [True]), tasks=["lift_green"])["rollouts"] == []


def test_first_close_and_clear_errors(tmp_path):
    mod = _script()
    assert mod.first_close(np.array([-1, -1, 1, 1, np.nan])) == 2
    assert mod.first_close(np.array([1, 1, -1])) is None           # closed from the start: no close inside
    with pytest.raises(SystemExit, match="config.yaml and rollouts.npz"):
        mod.main(["--check", str(tmp_path)])
    with pytest.raises(ValueError, match="no 'actions'"):
        mod.replay_closes(None, {"task": np.array(["lift_red"])})
