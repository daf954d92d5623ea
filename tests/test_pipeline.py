"""Pipeline plumbing on fakes: whole-episode recording into an EpisodeStore, store merging, resumable
stages, presets, plots. The end-to-end debug preset is in tests/test_pipeline_e2e.py."""

import json

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from grpo_fakes import GaussianChunkPolicy, ToyReachEnv, toy_starts
from wmrl.run import pipeline
from wmrl.run.common import RunContext
from wmrl.types import ActionSpace


def test_record_episodes_every_step_and_store_roundtrip(tmp_path):
    from wmrl.storage import EpisodeStore

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

    s = pipeline.Stages(ctx, resume=True)
    assert s.run("a", cfg, fn)["value"] == 7
    assert (tmp_path / "a" / "report.json").is_file() and "a" in s.wall
    s2 = pipeline.Stages(ctx, resume=True)
    assert s2.run("a", cfg, fn)["value"] == 7 and calls == ["a"]
    pipeline.Stages(ctx, resume=False).run("a", cfg, fn)
    assert calls == ["a", "a"]


def test_presets_merge_and_unknown_preset_errors():
    c = pipeline.compose_stage_config("pipeline", {"preset": "debug"})
    d = pipeline.apply_preset(c)
    assert d.stages.grpo.iterations < c.stages.grpo.iterations and d.evaluation.episodes_per_task < 50
    assert c.evaluation.episodes_per_task == 50  # the default evaluates 50 held-out init states per task
    with pytest.raises(ValueError, match="unknown pipeline preset"):
        pipeline.apply_preset(OmegaConf.merge(c, {"preset": "nope"}))


def _leaf_keys(d, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict) and v:
            yield from _leaf_keys(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}"


@pytest.mark.parametrize("preset", ["steering", "debug"])
def test_preset_keys_exist_in_the_stage_configs(preset):
    """A stage config is merged without struct mode, so a misspelt preset key would be silently ignored:
    every key a preset sets for a stage must already exist in that stage's composed config."""
    c = pipeline.compose_stage_config("pipeline", {"preset": preset})
    p = OmegaConf.to_container(c.presets[preset], resolve=False)
    groups = (p.get("stage_groups") or {})
    stage_cfg = {"collect": ("collect", []), "bc": ("train_policy", []), "worldmodel": ("train_worldmodel", []),
                 "critic": ("train_critic", []), "grpo": ("post_train", ["env=imagination"]), "bc_rollouts": None}
    checked = 0
    for stage, over in (p.get("stages") or {}).items():
        if stage_cfg[stage] is None:   # the pipeline's own stage: its keys are the pipeline's stages.<stage>
            base = c.stages[stage]
        else:
            name, g = stage_cfg[stage]
            base = pipeline.compose_stage_config(name, groups=g + list(groups.get(stage) or []))
        for key in _leaf_keys(over):
            assert OmegaConf.select(base, key, default="<missing>") != "<missing>", f"{preset}: stages.{stage}.{key}"
            checked += 1
    assert checked > 0


def test_steering_preset_sets_the_recipe():
    c = pipeline.apply_preset(pipeline.compose_stage_config("pipeline", {"preset": "steering"}))
    assert c.stages.collect.rotation_noise == 0.0 and c.stages.collect.noise == 0.9
    assert c.stages.grpo.steer.enabled and c.stages.grpo.grpo.ratio == "chain"
    assert c.stages.collect.workers == 2 and c.evaluation.episodes_per_task == 50   # the rest stays the default


def test_command_line_overrides_win_over_the_preset():
    c = pipeline.compose_stage_config("pipeline", {"preset": "steering"})
    assert pipeline.apply_preset(c).stages.grpo.iterations == 40            # the preset's own value
    d = pipeline.apply_preset(c, ["preset=steering", "stages.grpo.iterations=60", "+stages.grpo.seed=1",
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

    def fake_run(cfg, ctx):
        seen["cfg"] = pipeline.apply_preset(cfg, *pipeline.command_line_overrides())
        return {}

    monkeypatch.setattr(pipeline, "run", fake_run)
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
    p = pipeline.plot_before_after(r, r, tmp_path / "ba.png")
    hist = [{"iteration": 1, "success_rate": 0.3}, {"iteration": 2, "success_rate": 0.5}]
    evals = [{"iteration": 0, "success": 0.2, "ci95": [0.1, 0.3]}, {"iteration": 2, "success": 0.4, "ci95": [0.2, 0.6]}]
    q = pipeline.plot_imagined_vs_real(hist, evals, tmp_path / "iv.png")
    for f in (p, q):
        assert f.is_file() and f.read_bytes()[:4] == b"\x89PNG"
