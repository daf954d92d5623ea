"""The whole main job with the `debug` preset (tiny sizes, real sim, real policy / world model /
critic): every stage runs in process, report.json has wall times and before/after success with CIs,
plots and videos are written, and a second call resumes (no stage runs again)."""

import json

import pytest


@pytest.mark.slow
def test_pipeline_debug_preset_end_to_end(tmp_path):
    from wmrl.run import pipeline
    from wmrl.run.common import RunContext
    from wmrl.run.stages import compose_stage_config

    cfg = compose_stage_config("pipeline", {"preset": "debug", "num_threads": 1})
    ctx = RunContext(cfg, out_dir=tmp_path)
    rep = pipeline.run(cfg, ctx)
    stages = ["collect", "bc", "bc_rollouts", "worldmodel", "critic", "imagination_check", "eval_before", "grpo",
              "eval_after"]
    assert list(rep["stages"]) == stages
    for s in stages:
        assert (tmp_path / s / "report.json").is_file() and rep["stages"][s]["wall_time_s"] > 0
    assert set(rep["per_task"]) == {"lift_red", "push_red_to_target"}
    for r in (rep["before"], rep["after"]):
        lo, hi = r["ci95"]
        assert 0 <= lo <= r["success"] <= hi <= 1
    assert rep["success_gain"] == pytest.approx(rep["after"]["success"] - rep["before"]["success"])
    for p in rep["plots"].values():
        assert open(p, "rb").read(4) == b"\x89PNG"
    assert len(rep["videos"]) == 4 and all(v.endswith(".mp4") for v in rep["videos"])
    assert (tmp_path / "grpo" / "checkpoints" / "last" / "model.safetensors").is_file()
    # imagination check: 2 tasks x (1 init-state start + 1 keyframe of the run's store) x group of 2,
    # imagined and replayed in the sim
    fid = rep["imagination_check"]
    assert fid["n"] == 8 and fid["groups"] == 4 and set(fid["per_task"]) == {"lift_red", "push_red_to_target"}
    assert {k: v["n"] for k, v in fid["per_start_kind"].items()} == {"init": 4, "keyframe": 4}
    counters = rep["grpo"]["env_counters"]      # the imagination's halts and grasp-box misses during GRPO
    assert set(counters) == {"halted", "grasp_misses"} and min(counters.values()) >= 0
    assert 0 <= fid["imagined_success"] <= 1 and 0 <= fid["replayed_success"] <= 1
    # the debug preset refreshes the world model once (after GRPO iteration 1 of 2) on real rollouts
    rounds = rep["grpo"]["refresh"]["rounds"]
    assert [r["iteration"] for r in rounds] == [1] and rounds[0]["refresh/episodes"] == 2
    assert (tmp_path / "grpo" / "refresh" / "round_0001" / "rollouts.zarr").is_dir()
    json.dumps(rep)
    # resume: every stage is reused, the report is the same
    rep2 = pipeline.run(cfg, RunContext(cfg, out_dir=tmp_path))
    assert rep2["per_task"] == rep["per_task"] and rep2["stages"] == rep["stages"]
    # the saved config is the one that ran: the preset merged in, not the block of every preset
    from omegaconf import OmegaConf

    saved = OmegaConf.load(tmp_path / "config.yaml")
    assert saved.preset == "debug" and "presets" not in saved and saved.stages.grpo.iterations == 2
    assert all((tmp_path / s / "stage_inputs.json").is_file() for s in stages)
    # resuming with other GRPO settings stops before running anything and names what to remove
    cfg3 = OmegaConf.merge(cfg, {"stages": {"grpo": {"lr": 1.0e-4}}})   # a key the preset leaves alone
    before = (tmp_path / "config.yaml").read_text()
    with pytest.raises(ValueError, match=r"stage grpo .* \(lr: 3e-05 -> 0.0001\).*eval_after"):
        pipeline.run(cfg3, RunContext(cfg3, out_dir=tmp_path))
    assert (tmp_path / "config.yaml").read_text() == before     # the refused settings are not saved over it
    assert json.loads((tmp_path / "grpo" / "report.json").read_text())["iterations"] == 2
