"""Imagination fidelity (wmrl.fidelity): pair statistics by hand, and open-loop replay in the real sim
reproducing what the sim did closed loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from wmrl.fidelity import outcome_paths, ranking_stats, replay_actions, replay_check
from wmrl.kernel.types import PolicySample, Start


def test_ranking_stats_counts_pairs_by_hand():
    # group 0: real [1, 0, 0], imagined [1, 1, 0] -> pairs (0,1) tied, (0,2) right
    # group 1: real [0, 1], imagined [1, 0]       -> pair wrong
    # group 2: real [1, 1], imagined [0, 1]       -> no real-discordant pair
    im = np.array([1, 1, 0, 1, 0, 0, 1], bool)
    re = np.array([1, 0, 0, 0, 1, 1, 1], bool)
    g = np.array([0, 0, 0, 1, 1, 2, 2])
    s = ranking_stats(im, re, g)
    assert (s["pairs"], s["pairs_right"], s["pairs_tied"], s["pairs_wrong"]) == (3, 1, 1, 1)
    assert s["pair_accuracy"] == pytest.approx(0.5)
    assert s["agreement"] == pytest.approx(3 / 7)
    assert s["precision"] == pytest.approx(2 / 4) and s["recall"] == pytest.approx(2 / 4)
    assert (s["mixed_groups_imagined"], s["mixed_groups_real"], s["groups"]) == (3, 2, 3)
    assert ranking_stats(np.zeros(4), np.zeros(4), np.zeros(4))["pair_accuracy"] is None
    with pytest.raises(ValueError, match="one length"):
        ranking_stats(np.zeros(3), np.zeros(4), np.zeros(4))


@pytest.fixture(scope="module")
def expert_episode():
    from sim.collect import collect_episodes
    from sim.suite import Suite

    suite = Suite(tasks=["lift_red"], image_size=(32, 32))
    ep = next(collect_episodes(suite, 1, noise=0.0, seed=0))
    assert ep.success
    return suite, ep


def _chunks(actions: np.ndarray, h: int = 8) -> torch.Tensor:
    n = -(-len(actions) // h) * h
    a = np.concatenate([actions, np.repeat(actions[-1:], n - len(actions), 0)])
    return torch.from_numpy(a).float().reshape(-1, h, a.shape[-1])


def _never_grasp(chunks: torch.Tensor) -> torch.Tensor:
    out = chunks.clone()
    out[..., -1] = -1.0          # gripper command: open
    return out


def test_replay_reproduces_the_expert_and_a_broken_copy_fails(expert_episode):
    suite, ep = expert_episode
    start = Start(task_name="lift_red", instruction=ep.instruction, sim_state=ep.sim_states[0], split="train")
    good = _chunks(ep.actions)
    env = suite.make_env(2)
    ok = replay_actions(env, [start, start, start], [good, _never_grasp(good), good[:2]])
    assert ok.tolist() == [True, False, False]     # 2 chunks are too few to lift
    with pytest.raises(ValueError, match="starts"):
        replay_actions(env, [start], [good, good])


def test_replay_in_two_workers_without_cameras_equals_one_process(expert_episode):
    """The imagination check's replay (wmrl.run.imagination_check.replay_env: the suite's env without
    cameras, shared by worker processes) gives what one process with the rendering env gives."""
    from functools import partial

    from wmrl.run.imagination_check import replay_env

    suite, ep = expert_episode
    start = Start(task_name="lift_red", instruction=ep.instruction, sim_state=ep.sim_states[0], split="train")
    good = _chunks(ep.actions)
    starts, chunks = [start] * 3, [good, _never_grasp(good), good[:2]]
    one = replay_actions(suite.make_env(2), starts, chunks, with_proprio=True)
    make = partial(replay_env, {"_target_": "sim.suite.Suite", "tasks": ["lift_red"], "image_size": [32, 32]}, 2)
    assert make().cameras == ()
    two = replay_actions(None, starts, chunks, with_proprio=True, workers=2, make_env=make)
    assert one[0].tolist() == two[0].tolist() == [True, False, False]
    for a, b in zip(one[1] + one[2], two[1] + two[2]):
        assert torch.equal(a, b)
    assert [s is None for s in one[3]] == [s is None for s in two[3]] == [True, False, False]
    for a, b in zip(one[3][1:], two[3][1:]):
        assert np.array_equal(a, b)
    with pytest.raises(ValueError, match="make_env"):
        replay_actions(None, starts, chunks, workers=2)


class _ScriptedPolicy:
    """Slot 0 of every batch plays the expert's chunks, slot 1 the same chunks with the gripper open."""

    def __init__(self, chunks: torch.Tensor):
        self.chunks, self.n = chunks, 0

    def sample(self, obs, generator=None):
        c = self.chunks[min(self.n, len(self.chunks) - 1)]
        self.n += 1
        acts = torch.stack([c, _never_grasp(c[None])[0]])
        return PolicySample(acts, torch.zeros(2))


def test_replay_check_with_the_sim_as_imagination_agrees_exactly(expert_episode):
    suite, ep = expert_episode
    start = Start(task_name="lift_red", instruction=ep.instruction, sim_state=ep.sim_states[0], split="train")
    good = _chunks(ep.actions)
    r = replay_check(suite.make_env(2), suite.make_env(1), _ScriptedPolicy(good), [start], group_size=2,
                     max_chunks=len(good) + 2)
    assert r["n"] == 2 and r["imagined_success"] == 0.5 and r["replayed_success"] == 0.5
    assert r["agreement"] == 1.0 and r["pairs"] == 1 and r["pair_accuracy"] == 1.0
    assert r["per_task"] == {"lift_red": {"imagined": 0.5, "replayed": 0.5, "n": 2}}
    assert (r["imagined_successes"], r["replayed_successes"], r["both_successes"]) == (1, 1, 1)
    assert list(r["per_start_kind"]) == ["init"] and r["per_start_kind"]["init"]["n"] == 2
    # the sim as its own imagination: both paths are one path
    o = r["outcome_paths"]
    assert (o["both"]["n"], o["imagined_only"]["n"], o["replayed_only"]["n"]) == (1, 0, 0)
    assert o["both"]["ee_err_cm_max"] == 0.0 and o["both"]["far"] == 0
    assert o["both"]["gap_imagined_cm_median"] == o["both"]["gap_replayed_cm_median"]
    assert r["outcome_paths_per_task"]["lift_red"] == o
    assert "rollouts" not in r


def test_the_check_keeps_its_rollouts_with_the_object_where_the_replay_left_it(expert_episode, tmp_path):
    from wmrl.run.imagination_check import save_rollouts

    suite, ep = expert_episode
    start = Start(task_name="lift_red", instruction=ep.instruction, sim_state=ep.sim_states[0], split="train")
    good = _chunks(ep.actions)
    r = replay_check(suite.make_env(2), suite.make_env(1), _ScriptedPolicy(good), [start], group_size=2,
                     max_chunks=len(good) + 2, keep_rollouts=True)
    ro = r["rollouts"]
    assert ro["imagined"].tolist() == [True, False] and ro["replayed"].tolist() == [True, False]
    for a, b in zip(ro["imagined_ends"], ro["replayed_ends"]):     # the sim as its own imagination
        assert torch.equal(a, b)
    assert ro["replayed_end_state"][0] is None                    # ended in success: the env reset it
    assert ro["replayed_end_state"][1] is not None
    assert float(ro["gripper"][1].max()) == -1.0                  # the copy never closes
    moves = save_rollouts(tmp_path / "rollouts.npz", ro, suite)
    z = np.load(tmp_path / "rollouts.npz")
    assert z["imagined_ends"].shape == z["replayed_ends"].shape == (2, len(good) + 2, 9)
    assert z["task"].tolist() == ["lift_red"] * 2 and z["kind"].tolist() == ["init"] * 2
    assert z["imagined_uncertainty"].shape == (2, len(good) + 2)
    assert np.isnan(z["imagined_uncertainty"]).all()              # the sim reports no disagreement
    assert z["actions"].shape == (2, len(good) + 2, *good.shape[1:])    # enough to replay each rollout again
    assert np.array_equal(z["actions"][0, :len(ro["actions"][0])], ro["actions"][0].numpy())
    assert np.array_equal(z["start_state"][0], ep.sim_states[0]) and z["init_index"].tolist() == [-1, -1]
    assert np.isnan(z["object_end"][0]).all() and np.isfinite(z["object_end"][1]).all()
    # the open gripper pushed the cube at most a little: it did not rise
    assert moves["lift_red"]["neither"]["n"] == 1 and abs(moves["lift_red"]["neither"]["rise_cm_median"]) < 1.0
    assert moves["lift_red"]["imagined_only"] == {"n": 0, "rise_cm_median": None, "rise_cm_q90": None}


def test_outcome_paths_separates_an_arm_gone_elsewhere_from_a_grasp_that_did_not_hold():
    def path(ee_last, gap_cm):     # two chunk starts; the second decides
        p = torch.zeros(2, 9)
        p[1, :3] = torch.tensor(ee_last)
        p[1, 7], p[1, 8] = gap_cm / 200, -gap_cm / 200
        return p

    im = np.array([1, 1, 1, 0], bool)
    re = np.array([1, 0, 0, 1], bool)
    imagined = [path([0, 0, 0], 4.0), path([0, 0, 0.03], 4.0), path([0, 0, 0], 4.0), path([0, 0, 0], 0.0)]
    replayed = [path([0, 0, 0.001], 4.0), path([0, 0, 0], 4.0), path([0.005, 0, 0], 0.5), path([0, 0, 0], 4.0)]
    o = outcome_paths(im, re, imagined, replayed)
    assert o["both"]["n"] == 1 and o["both"]["ee_err_cm_median"] == pytest.approx(0.1)
    w = o["imagined_only"]
    assert w["n"] == 2 and w["far"] == 1 and w["ee_err_cm_max"] == pytest.approx(3.0)
    assert w["ee_err_cm_median"] == pytest.approx(1.75)         # median of 3.0 and 0.5 cm
    assert w["gap_imagined_cm_median"] == pytest.approx(4.0) and w["gap_replayed_cm_median"] == pytest.approx(2.25)
    assert o["replayed_only"]["n"] == 1 and o["replayed_only"]["gap_imagined_cm_median"] == pytest.approx(0.0)
    # a replay that ended a chunk early is compared at the last chunk start both executed
    assert outcome_paths(im[:1], re[:1], [path([0, 0, 0.05], 4.0)], [path([0, 0, 0], 4.0)[:1]])["both"]["ee_err_cm_max"] == 0.0


def test_replay_check_reports_keyframe_starts_apart(expert_episode):
    # a start cut from a stored episode (episode/step set, as wmrl.rl.starts.starts_from_store makes
    # them) is counted under "keyframe"; here from the episode's step 0, so the expert still succeeds
    suite, ep = expert_episode
    kf = Start(task_name="lift_red", instruction=ep.instruction, sim_state=ep.sim_states[0], split="train",
               episode=0, step=0)
    good = _chunks(ep.actions)
    r = replay_check(suite.make_env(2), suite.make_env(1), _ScriptedPolicy(good), [kf], group_size=2,
                     max_chunks=len(good) + 2)
    assert list(r["per_start_kind"]) == ["keyframe"]
    k = r["per_start_kind"]["keyframe"]
    assert (k["n"], k["imagined_successes"], k["precision"], k["pair_accuracy"]) == (2, 1, 1.0, 1.0)


def test_saved_rollouts_keep_starts_of_scenes_with_other_state_sizes(tmp_path):
    """Starts in two scenes (MuJoCo states of 5 and 3 values) and one from an init index: each start
    state is kept NaN-padded, the init index where there is no state; a suite that cannot locate
    objects gives NaN object positions."""
    from wmrl.run.imagination_check import save_rollouts

    starts = [Start(task_name="a", instruction="", sim_state=np.arange(5.0)),
              Start(task_name="b", instruction="", sim_state=np.arange(3.0)),
              Start(task_name="b", instruction="", init_index=4, split="train")]
    chunks = [torch.ones(2, 4, 5), torch.zeros(1, 4, 5), torch.ones(3, 4, 5)]
    ends = [torch.zeros(len(c), 9) for c in chunks]
    ro = {"starts": starts, "kind": np.array(["init"] * 3), "group": np.arange(3),
          "imagined": np.array([True, False, False]), "replayed": np.array([False, False, True]),
          "actions": chunks, "gripper": [c[:, -1, -1] for c in chunks], "imagined_ends": ends, "replayed_ends": ends,
          "replayed_end_state": [None] * 3, "imagined_uncertainty": [None, torch.full((1,), 0.002), None]}
    save_rollouts(tmp_path / "r.npz", ro, suite=None)
    z = np.load(tmp_path / "r.npz")
    assert z["start_state"].shape == (3, 5) and np.array_equal(z["start_state"][0], np.arange(5.0))
    assert np.array_equal(z["start_state"][1, :3], np.arange(3.0)) and np.isnan(z["start_state"][1, 3:]).all()
    assert np.isnan(z["start_state"][2]).all() and z["init_index"].tolist() == [-1, -1, 4]
    assert z["split"].tolist() == ["eval", "eval", "train"] and z["actions"].shape == (3, 3, 4, 5)
    assert np.isnan(z["actions"][1, 1:]).all() and np.isnan(z["object_start"]).all()
    assert np.isnan(z["imagined_uncertainty"][0]).all() and z["imagined_uncertainty"][1, 0] == np.float32(0.002)
