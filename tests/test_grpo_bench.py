"""The arithmetic of `wmrl bench grpo` (time to reach a real-sim success, ratio)."""

from wmrl.run.bench_grpo import compare, time_to_success


def _run(wall, succ):
    hist = [{"iteration": i + 1, "wall_s": wall} for i in range(len(succ) - 1)]
    evals = [{"iteration": i, "success": s} for i, s in enumerate(succ)]
    return {"history": hist, "evals": evals}


def test_time_to_success_counts_training_time_until_first_hit():
    r = _run(2.0, [0.2, 0.3, 0.5, 0.4])
    assert time_to_success(r["history"], r["evals"], 0.5) == (4.0, 2)
    assert time_to_success(r["history"], r["evals"], 0.2) == (0.0, 0)
    assert time_to_success(r["history"], r["evals"], 0.9) == (None, None)


def test_compare_uses_common_best_and_ratio():
    res = compare({"imagination": _run(1.0, [0.2, 0.4, 0.6]), "sim": _run(10.0, [0.2, 0.3, 0.5])})
    assert res["target_success"] == 0.5
    assert res["imagination"]["time_s"] == 2.0 and res["sim"]["time_s"] == 20.0
    assert res["ratio_sim_over_imagination"] == 10.0 and res["iteration_time_ratio"] == 10.0
    flat = compare({"imagination": _run(1.0, [0.2, 0.2]), "sim": _run(3.0, [0.2, 0.1])})
    assert flat["target_success"] is None and flat["ratio_sim_over_imagination"] is None


def _bench_cfg(*overrides):
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="configs", version_base="1.3"):
        return compose("bench_grpo", overrides=["checkpoint=/r/bc", "wm_checkpoint=/r/wm", "critic_checkpoint=/r/critic",
                                                *overrides])


def test_each_run_gets_the_common_settings_deep_merged_with_its_own_recipe():
    import pytest
    from omegaconf import OmegaConf

    from wmrl.run.bench_grpo import run_overrides

    cfg = _bench_cfg("store=/r/mixed.zarr", "post_train.evaluation.episodes_per_task=7")
    im, sim = run_overrides(cfg, "imagination"), run_overrides(cfg, "sim")
    # common keys reach both; a per-run key replaces only its own leaf
    assert im["evaluation"] == {"every": 5, "episodes_per_task": 7}
    assert sim["evaluation"] == {"every": 8, "episodes_per_task": 7}
    assert im["rl_sampler"] == sim["rl_sampler"] == {"noise_level": 0.3, "noise_steps": 3}
    assert im["checkpoint"] == sim["checkpoint"] == "/r/bc"
    # imagination: world model, critic and keyframe store; the sim: filtered BC without a policy-gradient step
    assert (im["env"]["world_model"], im["env"]["critic"], im["starts"]["store"]) == ("/r/wm", "/r/critic", "/r/mixed.zarr")
    assert im["env"]["num_envs"] == 72 and im["grpo"]["epochs"] == 1
    # the imagination recipe is the pipeline's GRPO stage, read from configs/pipeline.yaml, not a copy of it
    from wmrl.run.stages import compose_stage_config
    stage = OmegaConf.to_container(compose_stage_config("pipeline").stages.grpo, resolve=True)
    assert im["env"]["imagination"] == stage["env"]["imagination"] and im["grpo"] == stage["grpo"]
    assert (im["iterations"], im["lr"], im["starts"]["keyframes_per_task"]) == (stage["iterations"], stage["lr"], 3)
    assert im["checkpoint_every"] == 0   # the bench's own setting wins over the stage's
    assert "world_model" not in sim.get("env", {}) and sim["grpo"] == {"epochs": 0}
    assert sim["distill"]["balance_tasks"] is True
    with pytest.raises(ValueError, match="store="):
        run_overrides(_bench_cfg(), "imagination")
    assert "store" not in run_overrides(_bench_cfg("imagination={starts: {keyframes_per_task: 0}}"), "imagination")["starts"]
