"""Pipeline plumbing on fakes: whole-episode recording into an EpisodeStore, store merging, resumable
stages, presets, plots. The end-to-end debug preset is in tests/test_pipeline_e2e.py."""

import json

import numpy as np
import pytest
import torch
from grpo_fakes import GaussianChunkPolicy, ToyReachEnv, toy_starts
from omegaconf import OmegaConf

from wmrl.kernel.types import ActionSpace
from wmrl.run import figures, pipeline, stages
from wmrl.run.common import RunContext


def test_record_episodes_every_step_and_store_roundtrip(tmp_path):
    from wmrl.kernel.storage import EpisodeStore

    env = ToyReachEnv(num_envs=3, max_steps=10)
    pol = GaussianChunkPolicy()
    starts = toy_starts(2)  # 4 starts over 2 batches of 3
    eps = pipeline.record_episodes(env, pol, starts, max_steps=50, generator=torch.Generator().manual_seed(0))
    assert [e.task_name for e in eps] == [s.task_name for s in starts]
    for e, s in zip(eps, starts):
        assert 1 <= e.length <= 10
        assert e.images["agentview"].shape == (e.length, 3, 4, 4) and e.proprio.shape == (e.length, 6)
        assert e.rewards.shape == (e.length,)
        # the first recorded observation is the start's init position
        assert np.allclose(e.proprio[0, :3], ToyReachEnv.init_pos(s.init_index).numpy())
        # success ends the episode early, failure runs to the step limit
        assert e.success or e.length == 10
    space = ActionSpace(dim=3)
    for name, part in (("a", eps[:2]), ("b", eps[2:])):
        st = EpisodeStore.create(tmp_path / f"{name}.zarr", cameras={"agentview": (4, 4)}, state_dim=6, action_dim=3,
                                 fps=20, action_space=space)
        for e in part:
            st.append(e)
    rep = pipeline.merge_stores([tmp_path / "a.zarr", tmp_path / "b.zarr"], tmp_path / "m.zarr")
    m = EpisodeStore.open(tmp_path / "m.zarr")
    assert rep["episodes"] == 4 and list(m.lengths) == [e.length for e in eps]
    assert np.array_equal(m.episode(3).actions, eps[3].actions)


def test_stages_time_and_skip_finished_on_resume(tmp_path):
    cfg = OmegaConf.create({"seed": 0, "num_threads": 1})
    ctx = RunContext(cfg, out_dir=tmp_path)
    calls = []

    def fn(c, sub):
        calls.append(sub.out_dir.name)
        return {"value": 7}

    s = stages.Stages(ctx, resume=True)
    assert s.run("a", cfg, fn)["value"] == 7
    assert (tmp_path / "a" / "report.json").is_file() and "a" in s.wall
    s2 = stages.Stages(ctx, resume=True)
    assert s2.run("a", cfg, fn)["value"] == 7 and calls == ["a"]
    stages.Stages(ctx, resume=False).run("a", cfg, fn)
    assert calls == ["a", "a"]


def test_resumed_stage_must_have_the_same_settings(tmp_path, caplog):
    run = tmp_path / "run"
    ctx = RunContext(OmegaConf.create({}), out_dir=run)
    calls = []

    def fn(c, sub):
        calls.append(sub.out_dir.name)
        return {"value": int(c.x)}

    def cfg(x=1, threads=1, store="a/data.zarr"):
        return OmegaConf.create({"x": x, "num_threads": threads, "store": str(run / store)})

    stages.Stages(ctx, resume=True).run("a", cfg(), fn)
    assert (run / "a" / "stage_inputs.json").is_file()
    s = stages.Stages(ctx, resume=True)
    assert s.run("a", cfg(threads=2), fn)["value"] == 1 and calls == ["a"]   # a result-neutral setting may change
    with pytest.raises(ValueError, match=r"stage a .* other settings \(x: 1 -> 2\).*rm -r .*a") as e:
        stages.Stages(ctx, resume=True).run("a", cfg(x=2), fn)
    assert calls == ["a"] and json.loads((run / "a" / "report.json").read_text())["value"] == 1   # nothing lost
    assert "resume=false" in str(e.value)
    # a run directory moved elsewhere resumes: paths inside it are compared relative to it
    import shutil

    moved = tmp_path / "moved"
    shutil.copytree(run, moved)
    run = moved
    ctx2 = RunContext(OmegaConf.create({}), out_dir=moved)
    assert stages.Stages(ctx2, resume=True).run("a", cfg(), fn)["value"] == 1 and calls == ["a"]
    # a stage finished by an older version (no stage_inputs.json) is reused with a warning
    (moved / "a" / "stage_inputs.json").unlink()
    with caplog.at_level("WARNING", logger="wmrl.pipeline"):
        stages.Stages(ctx2, resume=True).run("a", cfg(x=5), fn)
    assert calls == ["a"] and "without comparing" in caplog.text


def test_stage_to_rerun_with_finished_later_stages_is_refused_up_front(tmp_path):
    ctx = RunContext(OmegaConf.create({}), out_dir=tmp_path)
    c = OmegaConf.create({"x": 1})
    s = stages.Stages(ctx, resume=True, order=["a", "b", "c"])
    for n in "abc":
        s.run(n, c, lambda c_, sub: {})
    stages.Stages(ctx, resume=True, order=["a", "b", "c"])   # all finished: fine
    import shutil

    shutil.rmtree(tmp_path / "a")
    with pytest.raises(ValueError, match=r"stage a has no results .* later stage\(s\) b, c"):
        stages.Stages(ctx, resume=True, order=["a", "b", "c"])
    stages.Stages(ctx, resume=False, order=["a", "b", "c"])  # resume=false reruns everything: no check


def test_a_refused_resume_keeps_the_run_directory_config(tmp_path, monkeypatch):
    old = stages.compose_stage_config("pipeline", {})
    RunContext(old, out_dir=tmp_path)
    saved = (tmp_path / "config.yaml").read_text()
    new = stages.compose_stage_config("pipeline", {"stages": {"grpo": {"lr": 1.0e-4}}})

    def refuse(cfg, ctx):
        raise stages.ResumeRefused("stage grpo was run with other settings")

    monkeypatch.setattr(pipeline, "_run", refuse)
    ctx = RunContext(new, out_dir=tmp_path)
    assert "0.0001" in (tmp_path / "config.yaml").read_text()     # written at the start, as for every command
    with pytest.raises(ValueError, match="other settings"):
        pipeline.run(new, ctx)
    assert (tmp_path / "config.yaml").read_text() == saved       # put back: it describes the results there
    bad = stages.compose_stage_config("pipeline", {"preset": "stering"})
    with pytest.raises(ValueError, match="unknown pipeline preset 'stering'"):
        pipeline.run(bad, RunContext(bad, out_dir=tmp_path))
    assert (tmp_path / "config.yaml").read_text() == saved


@pytest.mark.parametrize("preset", [None, "steering", "debug"])
def test_default_and_preset_stage_settings_pass_the_check(preset):
    c = stages.apply_preset(stages.compose_stage_config("pipeline", {"preset": preset}))
    assert stages.check_stage_overrides(c) > 30


def test_bad_stage_settings_are_refused_before_anything_runs():
    c = stages.compose_stage_config("pipeline", {"preset": "steering"})
    c = stages.apply_preset(c, ["+stages.grpo.iteratons=3", "stages.grpo.iterations=abc", "+stages.grpo.seed=1",
                                  "+stages.bc_rollouts.samplr=1", "+stages.grpo.rl_sampler.foo=2", "stages.grpo.lr=1",
                                  "+stages.grpo.steer.enabled=1", "+stages.bogus.x=1", "stages.bc.steps=null",
                                  "+stages.grpo.refresh.worldmodel.seconds=2.5", "+stages.bc.train.time_budget_s=90.5",
                                  "+stages.grpo.env.context_env={_target_: x.Y}"])
    with pytest.raises(ValueError) as e:
        stages.check_stage_overrides(c)
    msg = str(e.value)
    assert "stages.grpo.iteratons: no such key" in msg and "did you mean iterations" in msg
    assert "stages.grpo.iterations='abc': expected an integer" in msg
    assert "stages.bc_rollouts.samplr" in msg and "stages.grpo.steer.enabled=1: expected true or false" in msg
    assert "stages.bogus: no such configurable stage" in msg
    # allowed: a key the stage config has (seed), kwargs of an instantiable object (rl_sampler has _target_),
    # an integer for a float, null for anything, fractional seconds, an optional env (declared null)
    for ok in ("seed", "rl_sampler", "stages.grpo.lr", "stages.bc.steps", "seconds", "time_budget_s", "context_env"):
        assert ok not in msg
    assert len(msg.strip().splitlines()) == 1 + 5


def test_presets_merge_and_unknown_preset_errors():
    c = stages.compose_stage_config("pipeline", {"preset": "debug"})
    d = stages.apply_preset(c)
    assert d.stages.grpo.iterations < c.stages.grpo.iterations and d.evaluation.episodes_per_task < 50
    assert c.evaluation.episodes_per_task == 50  # the default evaluates 50 held-out init states per task
    with pytest.raises(ValueError, match="unknown pipeline preset"):
        stages.apply_preset(OmegaConf.merge(c, {"preset": "nope"}))


def test_a_misspelt_preset_key_is_caught():
    """Stage configs are merged without struct mode: a preset's misspelt key would be silently ignored."""
    c = stages.compose_stage_config("pipeline", {"preset": "steering"})
    c.presets.steering.stages.grpo.steer = {"enabeld": True}
    with pytest.raises(ValueError, match=r"stages.grpo.steer.enabeld: no such key .* did you mean enabled"):
        stages.check_stage_overrides(stages.apply_preset(c))


def test_steering_preset_sets_the_recipe():
    c = stages.apply_preset(stages.compose_stage_config("pipeline", {"preset": "steering"}))
    assert c.stages.collect.rotation_noise == 0.0 and c.stages.collect.noise == 0.9
    assert c.stages.grpo.steer.enabled and c.stages.grpo.grpo.ratio == "chain"
    assert c.stages.collect.workers == 2 and c.evaluation.episodes_per_task == 50   # the rest stays the default


def test_command_line_overrides_win_over_the_preset():
    c = stages.compose_stage_config("pipeline", {"preset": "steering"})
    assert stages.apply_preset(c).stages.grpo.iterations == 40            # the preset's own value
    d = stages.apply_preset(c, ["preset=steering", "stages.grpo.iterations=60", "+stages.grpo.seed=1",
                                  "stages.grpo.grpo={epochs: 2}", "suite=default", "~stages.bc"], groups={"suite"})
    assert d.stages.grpo.iterations == 60 and d.stages.grpo.seed == 1 and d.preset == "steering"
    assert d.stages.grpo.grpo.epochs == 2 and d.stages.grpo.grpo.ratio == "chain"   # dict values merge, as in Hydra
    assert d.stages.grpo.lr == 1.0e-4 and d.stages.grpo.steer.enabled                # the rest of the preset stays
    assert OmegaConf.is_dict(d.suite) and "bc" in d.stages   # group selections and deletions are not values


def test_pipeline_main_passes_the_command_line_to_the_preset(tmp_path, monkeypatch):
    """Through the real Hydra entry point (the stages themselves replaced by a stub)."""
    import sys

    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    seen = {}

    def fake_stages(cfg, ctx):   # what run() hands to the stages, after its preset and settings checks
        seen["cfg"] = cfg
        return {}

    monkeypatch.setattr(pipeline, "_run", fake_stages)
    monkeypatch.setattr(sys, "argv", ["wmrl pipeline", "preset=steering", "stages.grpo.iterations=60",
                                      "suite=tiny", f"hydra.run.dir={tmp_path}"])
    try:
        pipeline.main()
    finally:
        HydraConfig.instance().cfg = None   # later tests run outside a Hydra app
        GlobalHydra.instance().clear()
    cfg = seen["cfg"]
    assert cfg.stages.grpo.iterations == 60 and cfg.stages.grpo.lr == 1.0e-4
    assert OmegaConf.is_dict(cfg.suite) and cfg.stages.collect.rotation_noise == 0.0
    assert not HydraConfig.initialized()


def test_plots_are_written(tmp_path):
    r = {"success": 0.4, "ci95": [0.3, 0.5], "per_task": {"a": {"success": 0.2, "ci95": [0.1, 0.4]},
                                                          "b": {"success": 0.6, "ci95": [0.4, 0.7]}}}
    p = figures.plot_before_after(r, r, tmp_path / "ba.png")
    hist = [{"iteration": 1, "success_rate": 0.3}, {"iteration": 2, "success_rate": 0.5}]
    evals = [{"iteration": 0, "success": 0.2, "ci95": [0.1, 0.3]}, {"iteration": 2, "success": 0.4, "ci95": [0.2, 0.6]}]
    q = figures.plot_imagined_vs_real(hist, evals, tmp_path / "iv.png")
    for f in (p, q):
        assert f.is_file() and f.read_bytes()[:4] == b"\x89PNG"


def test_a_stage_override_may_replace_a_list_by_a_dict():
    """The LIBERO pipeline gives GRPO its tasks as ``name -> instruction`` (no sim suite knows them),
    where post_train.yaml has a list of names: the override replaces the key instead of failing."""
    cfg = stages.compose_stage_config("post_train", {"tasks": {"pick_x": "pick up the x"}, "starts": {"per_task": 0}})
    assert OmegaConf.to_container(cfg.tasks) == {"pick_x": "pick up the x"}
    assert int(cfg.starts.per_task) == 0 and "keyframes_per_task" in cfg.starts   # nested dicts still merge


def test_the_libero_pipeline_needs_the_libero_object_expert(tmp_path):
    """``wmrl pipeline`` dispatches a LIBERO suite to wmrl.run.libero_pipeline, which collects with
    the libero_object expert only: another LIBERO suite is a clear error before anything runs."""
    from hydra import compose, initialize_config_module

    with initialize_config_module("configs", version_base="1.3"):
        cfg = compose("pipeline", overrides=["suite=libero_goal"])
    with pytest.raises(ValueError, match="suite=libero_goal has no expert"):
        pipeline.run(cfg, RunContext(cfg, out_dir=tmp_path))


def test_the_default_libero_grpo_settings_merge_over_the_stage_defaults():
    """``libero.grpo`` adds keys ``stages.grpo`` lacks (``starts.first_steps``) to the struct-mode
    composed config: the merge gives a plain dict with both (the default LIBERO run once died here)."""
    from hydra import compose, initialize_config_module

    from wmrl.run.libero_pipeline import grpo_overrides

    with initialize_config_module("configs", version_base="1.3"):
        cfg = compose("pipeline", overrides=["suite=libero_object"])
    g = grpo_overrides(cfg.stages, cfg.libero)
    assert g["starts"]["first_steps"] == 1 and g["starts"]["per_task"] == 0
    assert g["grpo"]["max_chunks"] == 24 and "iterations" in g
    # the arm rule (grasp and place boxes of the sim suite's lifts and stack) is off: the LIBERO imagination
    # env has no suite to locate objects with, and builders.with_suite refuses a box without one
    assert g["env"]["imagination"]["proprio_success"] is None
    from wmrl.run.builders import with_suite

    assert "start_objects" not in with_suite(g["env"]["imagination"], None)


def test_the_check_draws_its_keyframes_as_grpo_does():
    from wmrl.run.pipeline import check_keyframes

    starts = OmegaConf.create({"store": "bc_rollouts/s.zarr", "first_steps": 64, "success_fraction": None})
    c = check_keyframes({"starts_per_task": 4, "keyframes_per_task": 8}, starts)
    assert c == {"starts_per_task": 4, "keyframes_per_task": 8, "store": "bc_rollouts/s.zarr", "first_steps": 64}
    starts.success_fraction = 0.5
    assert check_keyframes({"keyframes_per_task": 8}, starts)["success_fraction"] == 0.5
    assert check_keyframes({"starts_per_task": 4, "keyframes_per_task": 0}, starts) == {"starts_per_task": 4,
                                                                                         "keyframes_per_task": 0}
