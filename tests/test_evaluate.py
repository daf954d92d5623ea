"""Benchmark runner (wmrl.evaluation), `wmrl evaluate` and `wmrl collect` on a tiny scale."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch

from wmrl.kernel.types import PolicySample


def test_wilson_interval_known_values():
    from wmrl.rl.evaluate import wilson_interval

    lo, hi = wilson_interval(5, 10)
    assert lo == pytest.approx(0.2366, abs=1e-4) and hi == pytest.approx(0.7634, abs=1e-4)
    lo, hi = wilson_interval(0, 10)
    assert lo == 0.0 and hi == pytest.approx(0.2775, abs=1e-4)
    lo, hi = wilson_interval(50, 50)
    assert hi == 1.0 and lo == pytest.approx(0.9287, abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError):
        wilson_interval(3, 2)


def test_episode_seed_depends_only_on_seed_task_episode():
    from wmrl.evaluation import episode_seed

    assert episode_seed(0, "lift_red", 3) == episode_seed(0, "lift_red", 3)
    assert len({episode_seed(0, "lift_red", 3), episode_seed(1, "lift_red", 3), episode_seed(0, "lift_green", 3),
                episode_seed(0, "lift_red", 4)}) == 4


@pytest.fixture(scope="module")
def tiny_suite():
    from sim.suite import Suite

    return Suite(tasks=["lift_red", "push_red_to_target"], image_size=(32, 32))


def test_expert_results_do_not_depend_on_batch_size(tiny_suite, tmp_path):
    from wmrl.evaluation import evaluate_policy

    reports = [evaluate_policy(tiny_suite.make_expert(noise=0.6), tiny_suite, episodes_per_task=2, batch_size=b,
                               seed=3, out_dir=tmp_path / f"b{b}", videos_per_task=int(b == 3), progress=False)
               for b in (1, 3, 4)]
    tables = [r["episodes"] for r in reports]
    assert tables[0] == tables[1] == tables[2]
    assert len({r["episodes_sha256"] for r in reports}) == 1
    t = tables[0]
    assert [(x["task"], x["init_index"]) for x in t] == [(k, j) for k in ("lift_red", "push_red_to_target")
                                                          for j in range(2)]
    lengths = {x["length"] for x in t}
    assert len(lengths) > 1  # noisy expert: episodes differ
    # per-task summaries agree with the table
    for task, v in reports[0]["tasks"].items():
        rows = [x for x in t if x["task"] == task]
        assert v["successes"] == sum(x["success"] for x in rows) and v["episodes"] == 2
        assert v["ci95"][0] <= v["success_rate"] <= v["ci95"][1]
    # files
    out = tmp_path / "b3"
    with open(out / "episodes.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 and set(rows[0]) == {"task", "episode", "init_index", "seed", "success", "length", "reward"}
    assert json.loads((out / "episodes.json").read_text()) == t
    vids = sorted((out / "videos").glob("*.mp4"))
    assert len(vids) == 2  # first episode of each task
    import imageio.v2 as imageio

    frames = imageio.mimread(vids[0])
    ep = next(x for x in t if vids[0].name.startswith(f"{x['task']}_ep000"))
    assert len(frames) == ep["length"] + 1 and frames[0].shape == (128, 128, 3)


class RandomChunkPolicy(torch.nn.Module):
    """Tiny stand-in Policy: Gaussian chunks whose mean depends on the observation."""

    chunk_size = 4
    action_dim = 7
    supports_rtc = False

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(9, 7)

    def sample(self, obs, generator=None):
        mean = torch.tanh(self.w(obs.proprio))[:, None].expand(-1, self.chunk_size, -1)
        noise = torch.randn(mean.shape, generator=generator)
        return PolicySample(actions=(mean + 0.5 * noise).clamp(-1, 1), log_prob=torch.zeros(mean.shape[0]))

    def log_prob(self, obs, sample):
        return torch.zeros(sample.actions.shape[0])


def test_policy_evaluation_is_batch_independent_with_per_episode_sampling(tiny_suite):
    from wmrl.evaluation import evaluate_policy

    torch.manual_seed(0)
    policy = RandomChunkPolicy()
    kw = dict(episodes_per_task=2, seed=0, out_dir=None, tasks=["lift_red"], progress=False)
    r1 = evaluate_policy(policy, tiny_suite, batch_size=1, **kw)
    r2 = evaluate_policy(policy, tiny_suite, batch_size=2, **kw)
    assert r1["episodes"] == r2["episodes"]
    assert all(x["length"] == 100 and not x["success"] for x in r1["episodes"])  # random policy times out


def test_evaluate_rejects_bad_arguments(tiny_suite):
    from wmrl.evaluation import evaluate_policy

    with pytest.raises(ValueError, match="episodes_per_task"):
        evaluate_policy(tiny_suite.make_expert(), tiny_suite, episodes_per_task=0)
    with pytest.raises(ValueError, match="not in the suite"):
        evaluate_policy(tiny_suite.make_expert(), tiny_suite, episodes_per_task=1, tasks=["stack_red_on_green"])
    with pytest.raises(TypeError, match="not a Policy"):
        evaluate_policy(object(), tiny_suite, episodes_per_task=1)


def _compose(name, overrides):
    from hydra import compose, initialize_config_module

    with initialize_config_module("configs", version_base="1.3"):
        return compose(name, overrides=overrides)


def test_wmrl_evaluate_run_with_expert(tmp_path):
    from wmrl.run import evaluate
    from wmrl.run.common import RunContext

    cfg = _compose("evaluate", ["suite=tiny", "episodes_per_task=1", "batch_size=2", "videos_per_task=0",
                                "tasks=[lift_red]"])
    ctx = RunContext(cfg, out_dir=tmp_path)
    report = evaluate.run(cfg, ctx)
    ctx.finish(report)
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rep["tasks"]["lift_red"]["success_rate"] == 1.0 and rep["policy"] == "expert"
    assert (tmp_path / "episodes.csv").is_file() and (tmp_path / "config.yaml").is_file()
    cfg = _compose("evaluate", ["suite=tiny", f"checkpoint={tmp_path / 'missing'}"])
    with pytest.raises(ValueError, match="no checkpoint folder"):
        evaluate.run(cfg, ctx)


def test_wmrl_evaluate_with_worker_processes_equals_one_process(tmp_path):
    from wmrl.run import evaluate
    from wmrl.run.common import RunContext

    reps = []
    for w in (1, 2):
        cfg = _compose("evaluate", ["suite=tiny", "noise=0.6", "episodes_per_task=3", "batch_size=2",
                                    "videos_per_task=1", f"workers={w}"])
        reps.append(evaluate.run(cfg, RunContext(cfg, out_dir=tmp_path / f"w{w}")))
    assert reps[0]["episodes"] == reps[1]["episodes"] and reps[0]["episodes_sha256"] == reps[1]["episodes_sha256"]
    assert reps[0]["videos"] == reps[1]["videos"] and len(reps[1]["videos"]) == 2


def test_instruction_override_replaces_the_task_text(tmp_path):
    from wmrl.kernel.types import Obs, PolicySample
    from wmrl.run import evaluate
    from wmrl.run.builders import InstructionOverride
    from wmrl.run.common import RunContext

    seen = []

    class Recorder:
        chunk_size, action_dim = 2, 7

        def sample(self, obs, generator=None):
            seen.extend(obs.task)
            return PolicySample(torch.zeros(obs.batch_size, 2, 7), torch.zeros(obs.batch_size))

    pol = InstructionOverride(Recorder(), "lift the green cube")
    obs = Obs({"agentview": torch.zeros(2, 3, 8, 8, dtype=torch.uint8)}, torch.zeros(2, 9), ["lift the red cube"] * 2)
    assert pol.sample(obs).actions.shape == (2, 2, 7) and seen == ["lift the green cube"] * 2
    assert pol.chunk_size == 2
    cfg = _compose("evaluate", ["suite=tiny", "episodes_per_task=1", "instruction=lift the green cube"])
    with pytest.raises(ValueError, match="expert reads no instruction"):
        evaluate.run(cfg, RunContext(cfg, out_dir=tmp_path))


def test_wmrl_collect_writes_episodes_and_continues(tmp_path):
    from wmrl.kernel.storage import EpisodeStore
    from wmrl.run import collect
    from wmrl.run.common import RunContext

    store_path = tmp_path / "store"
    cfg = _compose("collect", ["suite=tiny", "episodes_per_task=1", "noise=0.3", f"out={store_path}"])
    rep = collect.run(cfg, RunContext(cfg, out_dir=tmp_path / "run1"))
    assert rep["episodes_in_store"] == 2
    store = EpisodeStore.open(store_path)
    ep = store.episode(0)
    T = ep.length
    assert ep.images["agentview"].shape == (T, 3, 32, 32) and ep.proprio.shape == (T, 9)
    assert ep.actions.shape == (T, 5) and ep.sim_states.shape[0] == T and ep.sim_states.dtype == np.float64
    assert ep.task_name == "lift_red" and ep.instruction == "lift the red cube"
    assert ep.info["split"] == "train" and ep.info["init_index"] == 0 and ep.info["noise"] == 0.3
    assert ep.info["rotation_noise"] == 1.0 and rep["rotation_noise"] == 1.0
    assert "seed" in ep.info and ep.rewards.shape == (T,)
    assert store.meta["source"] == "scripted" and store.meta["fps"] == 20
    # the stored first state is the training init state
    from sim.suite import Suite

    assert np.array_equal(ep.sim_states[0], Suite().init_state("lift_red", "train", 0))
    # same command again: nothing new; more episodes: continue at episode 1 of each task
    collect.run(cfg, RunContext(cfg, out_dir=tmp_path / "run2"))
    assert len(EpisodeStore.open(store_path)) == 2
    cfg2 = _compose("collect", ["suite=tiny", "episodes_per_task=2", "noise=0.3", f"out={store_path}"])
    collect.run(cfg2, RunContext(cfg2, out_dir=tmp_path / "run3"))
    store = EpisodeStore.open(store_path)
    assert len(store) == 4
    assert sorted(store.episode(i, images=False).info["init_index"] for i in range(4)) == [0, 0, 1, 1]


def test_wmrl_collect_with_worker_processes_stores_the_same_episodes(tmp_path):
    """workers=2 (whole tasks per spawned process) writes the store workers=1 writes: the same
    episodes in the same order (task by task), whatever the processes' timing; the per-worker stores
    are removed."""
    from wmrl.kernel.storage import EpisodeStore
    from wmrl.run import collect
    from wmrl.run.common import RunContext

    reps = {}
    for w in (1, 2):
        cfg = _compose("collect", ["suite=tiny", "episodes_per_task=1", "noise=0.3", f"workers={w}",
                                   "rotation_noise=0.5", f"out={tmp_path / f's{w}'}"])
        reps[w] = collect.run(cfg, RunContext(cfg, out_dir=tmp_path / f"run{w}"))
        assert reps[w]["episodes_in_store"] == 2
    a, b = EpisodeStore.open(tmp_path / "s1"), EpisodeStore.open(tmp_path / "s2")
    assert a.task_names == b.task_names == ["lift_red", "push_red_to_target"]
    for i in range(len(a)):
        ea, eb = a.episode(i), b.episode(i)
        assert np.array_equal(ea.actions, eb.actions) and np.array_equal(ea.images["agentview"], eb.images["agentview"])
        assert np.array_equal(ea.sim_states, eb.sim_states) and ea.info["init_index"] == eb.info["init_index"]
        assert ea.info["rotation_noise"] == eb.info["rotation_noise"] == 0.5   # reaches the worker processes
    assert reps[1]["new"] == reps[2]["new"]
    assert not (tmp_path / "s2.workers").exists()
    for key in ("rotation_noise", "noise"):
        bad = _compose("collect", ["suite=tiny", "episodes_per_task=1", f"{key}=-1", f"out={tmp_path / 'bad'}"])
        with pytest.raises(ValueError, match=f"^{key} must be >= 0"):
            collect.run(bad, RunContext(bad, out_dir=tmp_path / "runbad"))
        assert not (tmp_path / "bad").exists()


def test_suite_config_matches_library_defaults():
    """Code that builds a SimEnv without the suite config (e.g. post-train) must see the same images."""
    from hydra.utils import instantiate

    from sim.render import RenderSettings
    from sim.suite import Suite

    cfg = _compose("evaluate", [])
    s = instantiate(cfg.suite)
    assert s.render == RenderSettings() == Suite().render
    assert s.image_size == Suite().image_size and s.cameras == Suite().cameras and s.task_names == Suite().task_names
    v = instantiate(_compose("evaluate", ["suite=visual"]).suite)
    assert v.render.flat_robot is False


def test_a_video_that_cannot_be_written_loses_no_episode(tiny_suite, tmp_path, monkeypatch, caplog):
    import wmrl.evaluation as ev

    def no_fork(path, frames, fps):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"partial")
        raise OSError(12, "Cannot allocate memory")

    good = ev.evaluate_policy(tiny_suite.make_expert(noise=0.6), tiny_suite, episodes_per_task=2, batch_size=2,
                              seed=3, out_dir=tmp_path / "a", videos_per_task=0, progress=False)
    monkeypatch.setattr(ev, "_write_video", no_fork)
    with caplog.at_level("ERROR", logger="wmrl.evaluation"):
        bad = ev.evaluate_policy(tiny_suite.make_expert(noise=0.6), tiny_suite, episodes_per_task=2, batch_size=2,
                                 seed=3, out_dir=tmp_path / "b", videos_per_task=1, progress=False)
    assert bad["episodes"] == good["episodes"]
    assert "could not write the video" in caplog.text
    assert not list((tmp_path / "b" / "videos").glob("*.mp4"))     # no partial file left behind
