"""The proprio success rule of the lift tasks (``sim.tasks.TaskSpec.proprio_success``) against the
sim's own success, on recorded lifts in both action spaces.

The recording (``tests/data/lift_rollouts.npz``) holds scripted-expert lifts at the suites' default
noise (0.6), run on past success to the step limit as an imagined rollout is, with the sim's
success at every step. Re-record it with ``python tests/test_proprio_success.py --record``. The
rule's thresholds (``sim.tasks.TaskSpec.proprio_success``) were chosen on a recording with seed
2026; this one (seed 2027) was not looked at before they were fixed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from sim.tasks import get_task

DATA = Path(__file__).parent / "data" / "lift_rollouts.npz"
SEED, EPISODES_PER_TASK, NOISE = 2027, 40, 0.6


def record(path: Path = DATA) -> None:
    from sim.collect import collect_episodes
    from sim.control import EeTargetControl
    from sim.suite import Suite

    out = {}
    for space, control in (("ee", EeTargetControl()), ("delta", None)):
        suite = Suite(tasks=["lift_red", "lift_green"], cameras=(), control=control)
        for j, ep in enumerate(collect_episodes(suite, EPISODES_PER_TASK, noise=NOISE, seed=SEED, stop_on_success=False)):
            key = f"{space}/{j:03d}/{ep.task_name}"
            out[key + "/proprio"] = ep.proprio.astype(np.float32)
            out[key + "/gripper"] = ep.actions[:, -1].astype(np.float32)
            out[key + "/success"] = ep.rewards > 0  # the sim's success after each step
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, **out)


def _episodes(space: str):
    z = np.load(DATA)
    keys = sorted({k.rsplit("/", 1)[0] for k in z.files if k.startswith(space + "/")})
    for k in keys:
        yield k.split("/")[2], z[k + "/proprio"], z[k + "/gripper"], z[k + "/success"]


def _confusion(space: str) -> tuple[int, int, int, int]:
    tp = fp = fn = tn = 0
    for task, proprio, gripper, success in _episodes(space):
        fired = get_task(task).proprio_success(proprio, gripper)
        # proprio[t] is the state before step t's action, success[t] the state after it
        real = bool(success.any())
        tp, fp = tp + (fired.any() and real), fp + (fired.any() and not real)
        fn, tn = fn + (real and not fired.any()), tn + (not real and not fired.any())
    assert tp + fp + fn + tn == 2 * EPISODES_PER_TASK and tp >= 20 and tn >= 20  # both outcomes are there
    return tp, fp, fn, tn


# Measured on the recording (seed 2027), tp / fp / fn / tn: ee 35 / 0 / 0 / 45, delta 22 / 0 / 0 / 58
# (precision and recall 1.0 in both). With the earlier thresholds (gap 2.5 cm, rise 4 cm) the ee space
# had 0.921 / 0.946 on seed 2026: lifted cubes that slipped out before they reached 5 cm.
@pytest.mark.parametrize("space, target", [("delta", 0.95), ("ee", 0.95)])
def test_the_rule_agrees_with_the_sim_on_recorded_lifts(space, target):
    tp, fp, fn, tn = _confusion(space)
    precision, recall = tp / (tp + fp), tp / (tp + fn)
    assert precision > target and recall > target, (space, tp, fp, fn, tn)


def test_a_gripper_closed_on_nothing_is_no_success():
    t = np.arange(40)
    proprio = np.zeros((40, 9))
    proprio[:, 2] = 0.1 + 0.005 * t          # the arm rises 20 cm
    proprio[:, 3] = 1.0
    closing = np.clip(0.04 - 0.004 * t, 0.0005, None)  # fingers close on nothing
    proprio[:, 7], proprio[:, 8] = closing, -closing
    gripper = np.ones(40)
    spec = get_task("lift_red")
    assert not spec.proprio_success(proprio, gripper).any()
    proprio[:, 7], proprio[:, 8] = 0.02, -0.02  # ... or on a 4 cm cube: held and raised
    fired = spec.proprio_success(proprio, gripper)
    assert fired.any() and not fired[:11].any()  # not before the gripper has been closed 12 steps
    gripper[20] = -1.0  # re-opened: the count starts again
    assert not spec.proprio_success(proprio, gripper)[20:32].any()


def test_tasks_without_a_rule_say_so():
    spec = get_task("stack_red_on_green")
    assert not spec.has_proprio_success and get_task("lift_green").has_proprio_success
    with pytest.raises(ValueError, match="only lifts"):
        spec.proprio_success(np.zeros((3, 9)), np.zeros(3))
    with pytest.raises(ValueError, match=r"\(T, 9\)"):
        get_task("lift_red").proprio_success(np.zeros((3, 9)), np.zeros(4))


if __name__ == "__main__" and "--record" in sys.argv:
    record()
    print(f"wrote {DATA}")
