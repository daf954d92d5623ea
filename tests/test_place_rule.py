"""The imagination's release rule with its place box (``wmrl.imagination.ProprioLiftRule``,
``place_box_m``) against the sim's own success, on recorded stacking episodes.

The recording (``tests/data/stack_rollouts.npz``) holds scripted-expert stacking episodes of the
default suite (chunk-relative end-effector targets) at its default noise (0.6), run past success to
the step limit as an imagined rollout is, with the sim's success after every step and where the
episode's start put both cubes (``sim.suite.Suite.object_position`` / ``goal_position``). The rule
is fed the real arm at chunk ends, as imagination feeds it the imagined arm, from the episode's
first step (an init start) and from a keyframe in the carry (the cube in the hand: the rule's
``start_holding_max_gap_m``). Re-record with ``python tests/test_place_rule.py --record``. The box
(``configs/pipeline.yaml``) was chosen on three imagination checks' stacking rollouts (2026-12-07,
docs/measurements.md); this recording (seed 2028) was made after it was fixed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from wmrl.imagination import ProprioLiftRule

DATA = Path(__file__).parent / "data" / "stack_rollouts.npz"
SEED, EPISODES, NOISE, H = 2028, 40, 0.6, 8
RULE = dict(tasks=["lift_red"], release_tasks=["stack_red_on_green"], grasp_box_m=(0.035, 0.03, 0.02),
            release_open_steps=8, place_box_m=(0.02, 0.02, 0.08), releases_need_critic=False,
            start_holding_max_gap_m=0.06)


def record(path: Path = DATA) -> None:
    from sim.collect import collect_episodes
    from sim.suite import Suite
    from wmrl.kernel.types import Start

    suite = Suite(tasks=["stack_red_on_green"], cameras=())
    out = {}
    for j, ep in enumerate(collect_episodes(suite, EPISODES, noise=NOISE, seed=SEED, stop_on_success=False)):
        start = Start(task_name=ep.task_name, instruction="", sim_state=ep.sim_states[0])
        key = f"{j:03d}"
        out[key + "/proprio"] = ep.proprio.astype(np.float32)
        out[key + "/actions"] = ep.actions.astype(np.float32)
        out[key + "/success"] = ep.rewards > 0
        out[key + "/object"] = suite.object_position(start)
        out[key + "/goal"] = suite.goal_position(start)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, **out)


def _episodes():
    z = np.load(DATA)
    for key in sorted({k.split("/")[0] for k in z.files}):
        yield tuple(z[f"{key}/{f}"] for f in ("proprio", "actions", "success", "object", "goal"))


def judge(rule: ProprioLiftRule, proprio, actions, obj, goal, t0: int = 0, held_at_start: bool = False) -> int | None:
    """The first step index after which the rule fires on the real arm, chunk by chunk from step
    ``t0``; ``None``: never. ``held_at_start``: the object is in the hand at ``t0`` (its position is
    then where the hand is)."""
    closed, z_low, held, missed = np.zeros(1, int), np.zeros(1), np.zeros(1, bool), np.zeros(1, bool)
    p = torch.as_tensor(proprio, dtype=torch.float32)
    if rule.starts_holding(p[t0:t0 + 1])[0]:
        closed[0], z_low[0] = rule.closed_steps, float(p[t0, 2])
    for t in range(t0, len(p) - H, H):
        a = torch.as_tensor(actions[None, t:t + H])
        fired = rule.update(closed, z_low, p[t:t + 1], p[t + H:t + H + 1], a, held, ["stack_red_on_green"],
                            missed=missed, objects=obj[None], goals=goal[None])
        if fired[0]:
            return t + H - 1
    return None


def _carry_keyframe(proprio, actions) -> int | None:
    """A step 16 steps into the first closed streak that lasts 24 steps (the cube lifted and in the hand)."""
    closed = actions[:, -1] > 0
    for t in range(len(closed) - 24):
        if closed[t:t + 24].all() and (t == 0 or not closed[t - 1]):
            return t + 16
    return None


def _confusion(from_keyframe: bool, **override):
    rule = ProprioLiftRule(**{**RULE, **override})
    tp = fp = fn = tn = 0
    for proprio, actions, success, obj, goal in _episodes():
        t0 = 0
        if from_keyframe:
            t0 = _carry_keyframe(proprio, actions)
            if t0 is None or success[:t0].any():
                continue
            obj = proprio[t0, :3].astype(np.float64)       # in the hand: where the hand is
        fired = judge(rule, proprio, actions, obj, goal, t0) is not None
        real = bool(success[t0:].any())
        tp, fp, fn, tn = tp + (fired and real), fp + (fired and not real), fn + (real and not fired), tn + (not real and not fired)
    return tp, fp, fn, tn


# Measured on the recording (seed 2028), tp / fp / fn / tn: from the first step 12 / 1 / 10 / 17, from a
# carry keyframe 12 / 1 / 10 / 17 (precision 0.92, recall 0.55); without the place box (every release
# after a hold) 21 / 14 / 1 / 4 and 22 / 15 / 0 / 3 (precision 0.60, 0.59). The hand's place at the
# chunk boundary misses a third of the real stacks (a cube let go 2-3 cm off the goal's centre slides
# on), but what it calls a stack is one.
@pytest.mark.parametrize("from_keyframe", [False, True])
def test_the_place_rule_agrees_with_the_sim_on_recorded_stacks(from_keyframe):
    tp, fp, fn, tn = _confusion(from_keyframe)
    assert tp >= 10 and tn >= 10, (tp, fp, fn, tn)                   # both outcomes are there
    precision, recall = tp / (tp + fp), tp / (tp + fn)
    assert precision >= 0.85 and recall >= 0.5, (tp, fp, fn, tn)
    tp0, fp0, _, _ = _confusion(from_keyframe, place_box_m=None, releases_need_critic=True)
    assert tp0 / (tp0 + fp0) < precision - 0.2           # the box, not the release alone, makes it precise


if __name__ == "__main__" and "--record" in sys.argv:
    record()
    print(f"wrote {DATA}")
