"""The main job on any machine: precision that fits the hardware (wmrl.kernel.precision), threads that fit
the free cores (wmrl.run.common), budgets that say when they cut a run short, the pipeline's time
estimate (wmrl.run.machine) and `wmrl doctor`. The CPU capability is faked both ways."""

from __future__ import annotations

import logging
import subprocess
import sys

import numpy as np
import pytest
import torch

import wmrl.kernel.precision as precision
from wmrl.run import common


@pytest.fixture
def fake_cpu(monkeypatch):
    """``fake_cpu(True | False)``: the CPU reports (or lacks) native bf16."""
    monkeypatch.delenv(precision.ENV_OVERRIDE, raising=False)
    precision._WARNED.clear()

    def set_(native: bool):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)

    yield set_
    precision._WARNED.clear()


# ----------------------------------------------------------------------------- precision
def test_auto_follows_the_cpu_capability_both_ways(fake_cpu):
    fake_cpu(True)
    p = precision.resolve_bf16("auto", "cpu", "BC")
    assert p.bf16 and p.dtype == "bf16" and "AVX512_BF16" in p.reason and p.setting == "auto"
    fake_cpu(False)
    p = precision.resolve_bf16("auto", "cpu", "BC")
    assert not p.bf16 and p.dtype == "fp32" and "no AVX512_BF16" in p.reason
    assert precision.resolve_bf16(None, "cpu").dtype == "fp32"          # None is auto
    assert precision.resolve_bf16(False, "cpu").dtype == "fp32"
    assert p.as_dict() == {"dtype": "fp32", "setting": "auto", "device": "cpu", "reason": p.reason}


def test_env_override_and_bad_settings(fake_cpu, monkeypatch):
    fake_cpu(True)
    monkeypatch.setenv(precision.ENV_OVERRIDE, "0")
    p = precision.resolve_bf16("auto", "cpu")
    assert p.dtype == "fp32" and precision.ENV_OVERRIDE in p.reason
    monkeypatch.setenv(precision.ENV_OVERRIDE, "yes")
    with pytest.raises(ValueError, match="WMRL_NATIVE_BF16 must be 0 or 1"):
        precision.resolve_bf16("auto", "cpu")
    monkeypatch.delenv(precision.ENV_OVERRIDE)
    with pytest.raises(ValueError, match="bf16 must be auto, true or false"):
        precision.resolve_bf16("sometimes", "cpu")
    assert precision.resolve_bf16("TRUE", "cpu").dtype == "bf16"


def test_explicit_true_without_native_bf16_warns_once_with_the_measured_cost(fake_cpu, caplog, monkeypatch):
    fake_cpu(False)
    monkeypatch.setattr(precision, "measure_bf16_slowdown", lambda device="cpu", **k: 11.5)
    with caplog.at_level(logging.WARNING, logger="wmrl.kernel.precision"):
        p = precision.resolve_bf16(True, "cpu", "BC")
        precision.resolve_bf16(True, "cpu", "world model")
    assert p.dtype == "bf16" and "although" in p.reason
    warned = [r.getMessage() for r in caplog.records if "without native bf16" in r.getMessage()]
    assert len(warned) == 1 and "11.5x" in warned[0]


def test_measured_slowdown_is_a_positive_ratio():
    assert precision.measure_bf16_slowdown("cpu", size=32, reps=2) > 0


def _toy_bc(tmp_path, tag, bf16):
    from test_policy import tiny_policy, toy_store

    from policies.train import train_bc
    from wmrl.kernel.storage import WindowDataset

    store = toy_store(tmp_path / f"store_{tag}", n_eps=2, T=8)
    torch.manual_seed(0)
    p = tiny_policy().set_norm_stats(store.stats())
    rep = train_bc(p, WindowDataset(store, n_obs=1, horizon=4),
                   dict(steps=3, batch_size=4, warmup_steps=1, ckpt_every=0, log_every=1, ema_decay=0.0, bf16=bf16),
                   tmp_path / tag)
    return rep, {k: v.clone() for k, v in p.state_dict().items()}


def test_bc_runs_fp32_by_itself_where_bf16_is_not_native(tmp_path, fake_cpu):
    fake_cpu(False)
    rep_auto, w_auto = _toy_bc(tmp_path, "auto", "auto")
    assert rep_auto["precision"]["dtype"] == "fp32" and "no AVX512_BF16" in rep_auto["precision"]["reason"]
    _, w_fp32 = _toy_bc(tmp_path, "fp32", False)
    assert all(torch.equal(w_auto[k], w_fp32[k]) for k in w_auto)          # the same computation as bf16=false
    fake_cpu(True)
    rep_bf, w_bf = _toy_bc(tmp_path, "bf", "auto")
    assert rep_bf["precision"]["dtype"] == "bf16"
    assert any(not torch.equal(w_bf[k], w_fp32[k]) for k in w_bf)           # autocast really on


def test_world_model_precision_is_resolved_per_device(fake_cpu):
    from worldmodels.video_wm import ChunkFlowWorldModel

    kw = dict(cameras=["agentview"], image_size=16, block_out_channels=(16, 16), norm_num_groups=8)
    fake_cpu(False)
    assert ChunkFlowWorldModel(**kw).precision().dtype == "fp32"
    fake_cpu(True)
    m = ChunkFlowWorldModel(**kw)
    assert m.precision().dtype == "bf16" and m.precision().reason.startswith("world model")
    assert ChunkFlowWorldModel(**kw, autocast_bf16=False).precision().dtype == "fp32"
    with pytest.raises(ValueError, match="bf16 must be auto"):
        ChunkFlowWorldModel(**kw, autocast_bf16="maybe")


# ----------------------------------------------------------------------------- threads
def test_auto_threads_leave_busy_cores_alone(monkeypatch):
    monkeypatch.setattr(common, "available_cores", lambda: 4)
    for busy, want in ((0.0, 4), (0.3, 4), (0.7, 3), (1.0, 3), (2.9, 1), (7.0, 1)):
        monkeypatch.setattr(common, "busy_cores_elsewhere", lambda seconds=0.25, b=busy: b)
        k, why = common.resolve_threads("auto")
        assert k == want, (busy, k)
        assert why.startswith("num_threads=auto") and (("busy" in why) == (want < 4))
    assert common.resolve_threads(0) == (4, "num_threads=0: all 4 available core(s)")
    assert common.resolve_threads(3)[0] == 3
    with pytest.raises(ValueError, match="num_threads must be auto"):
        common.resolve_threads("many")


def test_oversubscribed_threads_warn(monkeypatch, caplog):
    monkeypatch.setattr(common, "available_cores", lambda: 2)
    with caplog.at_level(logging.WARNING, logger="wmrl"):
        assert common.resolve_threads(8)[0] == 8
    assert any("more than the 2 core" in r.getMessage() for r in caplog.records)


def test_a_cpu_bound_neighbour_is_seen_as_a_busy_core():
    import os

    cpu = sorted(os.sched_getaffinity(0))[-1]
    nb = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True:\n    pass"])
    try:
        import time

        time.sleep(0.3)
        assert common.busy_cores_elsewhere(0.3) >= 0.6
    finally:
        nb.kill()
        nb.wait()


def test_reports_record_threads_and_wait_policy(tmp_path):
    from omegaconf import OmegaConf

    before = torch.get_num_threads()
    try:
        ctx = common.RunContext(OmegaConf.create({"num_threads": 1}), out_dir=tmp_path)
        rep = __import__("json").loads(ctx.finish({"x": 1}).read_text())
        assert rep["runtime"]["num_threads"] == 1 and rep["runtime"]["threads_reason"] == "num_threads=1"
        assert rep["runtime"]["cores_available"] >= 1 and "omp_wait_policy" in rep["runtime"]
    finally:
        torch.set_num_threads(before)


# ----------------------------------------------------------------------------- budgets
def test_bc_cut_by_its_time_budget_says_so(tmp_path, caplog):
    from test_policy import tiny_policy, toy_store

    from policies.train import train_bc
    from wmrl.kernel.storage import WindowDataset

    store = toy_store(tmp_path / "store", n_eps=2, T=8)
    p = tiny_policy().set_norm_stats(store.stats())
    ds = WindowDataset(store, n_obs=1, horizon=4)
    base = dict(steps=20, batch_size=4, warmup_steps=1, ckpt_every=0, log_every=1, ema_decay=0.0, bf16=False)
    with caplog.at_level(logging.WARNING, logger="wmrl.policies"):
        rep = train_bc(p, ds, {**base, "time_budget_s": 1e-9}, tmp_path / "cut")
    assert rep["cut_by_budget"] and rep["steps"] < rep["steps_planned"] == 20
    assert any("of 20 planned" in r.getMessage() and "not comparable" in r.getMessage() for r in caplog.records)
    full = train_bc(p, ds, base, tmp_path / "full")
    assert not full["cut_by_budget"] and full["steps"] == full["steps_planned"] == 20


def test_world_model_cut_by_its_budget_says_so(tmp_path, monkeypatch):
    from test_worldmodel import TINY, tiny_model

    import worldmodels.train as wt
    from worldmodels.data import EpisodeFrames
    from worldmodels.synthetic import make_episodes

    data = EpisodeFrames(make_episodes(3, length=12, size=32, seed=1))
    monkeypatch.setattr(wt.BudgetClock, "elapsed", lambda self: 1e6)
    rep = wt.train_world_model(tiny_model(), TINY, data, tmp_path / "wm", steps=5, batch_size=2, max_minutes=1.0,
                               progress=False, tensorboard=False, resume=False)
    assert rep["cut_by_budget"] and rep["steps"] == 1 and rep["steps_planned"] == 5
    assert rep["precision"]["dtype"] in ("bf16", "fp32")


def test_pipeline_marks_a_run_cut_by_a_budget_as_not_comparable():
    from wmrl.run.machine import budget_summary as _budget_summary

    full = {"bc": {"steps": 10, "steps_planned": 10, "cut_by_budget": False},
            "worldmodel": {"steps": 7, "steps_planned": 7}, "critic": {"steps": 5, "steps_planned": 5}}
    s = _budget_summary(full)
    assert s["comparable_with_reference"] and s["not_comparable_because"] == []
    cut = {**full, "worldmodel": {"steps": 3, "steps_planned": 7, "cut_by_budget": True}}
    s = _budget_summary(cut)
    assert not s["comparable_with_reference"]
    assert s["not_comparable_because"] == ["worldmodel ran 3 of 7 planned steps (its time budget)"]


# ----------------------------------------------------------------------------- estimate, doctor
def _pipeline_cfg(preset=None):
    from wmrl.run.stages import apply_preset, compose_stage_config

    return apply_preset(compose_stage_config("pipeline", {"preset": preset} if preset else {}))


def test_work_units_come_from_the_stage_settings():
    from omegaconf import OmegaConf

    from wmrl.run.machine import work_units

    cfg = _pipeline_cfg()
    u = work_units(cfg)
    assert u["bc"]["units"] == cfg.stages.bc.steps and u["worldmodel"]["units"] == cfg.stages.worldmodel.train.steps
    assert u["grpo"]["units"] == cfg.stages.grpo.iterations * cfg.stages.grpo.env.num_envs * cfg.stages.grpo.grpo.max_chunks
    more = OmegaConf.merge(cfg, {"stages": {"bc": {"steps": 2 * cfg.stages.bc.steps}}})
    assert work_units(more)["bc"]["units"] == 2 * u["bc"]["units"]


def test_estimate_scales_each_stage_with_its_units_and_unit_cost(monkeypatch):
    import wmrl.run.machine as machine

    cfg = _pipeline_cfg()
    units = machine.work_units(cfg)
    calib = {k: 0.01 for k in ("sim_step_s", "bc_step_s", "wm_step_s", "critic_step_s", "imagine_per_rollout_s",
                               "policy_per_env_s", "policy_sde_per_rollout_s")}
    calib["calibration_s"] = 10.0
    # reference: every stage took 100 s at these units and costs (k = 100 / (units * cost))
    ref = {s: (100.0, u["units"], machine.unit_cost(units, calib, s)) for s, u in units.items()}
    monkeypatch.setattr(machine, "REFERENCE", ref)
    est = machine.estimate_pipeline(cfg, calib)
    assert est["total_s"] == pytest.approx(100.0 * len(units) + 10.0)
    slower = {**calib, "wm_step_s": 0.03}                    # a 3x slower world-model step
    est2 = machine.estimate_pipeline(cfg, slower)
    assert est2["stages"]["worldmodel"] == pytest.approx(300.0) and est2["stages"]["bc"] == pytest.approx(100.0)
    monkeypatch.setattr(machine, "REFERENCE", {})
    none = machine.estimate_pipeline(cfg, calib)
    assert none["total_s"] is None and "no reference figures" in none["why"]


def test_calibration_times_every_unit_and_leaves_the_rngs_alone():
    import random

    from wmrl.run.machine import calibrate

    cfg = _pipeline_cfg("debug")
    torch.manual_seed(3)
    np.random.seed(3)
    random.seed(3)
    want = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(3)
    np.random.seed(3)
    random.seed(3)
    c = calibrate(cfg)
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(want[0], got[0]) and np.array_equal(want[1], got[1]) and want[2] == got[2]
    for k in ("sim_step_s", "bc_step_s", "wm_step_s", "critic_step_s", "imagine_per_rollout_s", "policy_per_env_s",
              "policy_sde_per_rollout_s", "calibration_s"):
        assert c[k] > 0, k


def test_doctor_reports_what_it_found(tmp_path, fake_cpu):
    from omegaconf import OmegaConf

    from wmrl.run import doctor

    fake_cpu(False)
    cfg = OmegaConf.create({"estimate": False, "pipeline": {}, "num_threads": 1})
    before = torch.get_num_threads()
    try:
        rep = doctor.run(cfg, common.RunContext(cfg, out_dir=tmp_path))
    finally:
        torch.set_num_threads(before)
    assert rep["precision"]["dtype"] == "fp32" and rep["bf16_slowdown"] > 0
    assert rep["renderer"]["ok"] and rep["versions"]["torch"] == torch.__version__.split("+")[0]
    assert rep["threads"]["auto"] >= 1 and rep["cpu"]["arch"] and "avx512_bf16" in rep["cpu"]
    assert rep["libero"]["present"] in (True, False) and rep["memory_disk"]["disk_free_gib"] > 0


def test_reference_fitted_from_a_report_reproduces_its_stage_times(monkeypatch):
    import wmrl.run.machine as machine

    cfg = _pipeline_cfg()
    units = machine.work_units(cfg)
    calib = {k: 0.002 * (i + 1) for i, k in enumerate(("sim_step_s", "bc_step_s", "wm_step_s", "critic_step_s",
                                                        "imagine_per_rollout_s", "policy_per_env_s",
                                                        "policy_sde_per_rollout_s"))}
    calib["calibration_s"] = 12.0
    times = {s: 10.0 * (i + 1) for i, s in enumerate(units)}
    report = {"stages": {s: {"wall_time_s": t} for s, t in times.items()},
              "estimate": {"units": units, "calibration": calib}}
    monkeypatch.setattr(machine, "REFERENCE", machine.reference_from_report(report))
    est = machine.estimate_pipeline(cfg, calib)
    assert est["stages"] == pytest.approx(times, rel=1e-4)
    with pytest.raises(ValueError, match="no estimate block"):
        machine.reference_from_report({"stages": {}})


def test_the_world_model_step_is_timed_for_the_default_world_model():
    """The default pipeline's world model (dynamics ensemble, anchor, grasp head) takes its action
    space from the suite in the calibration, as its training stage takes it from the store."""
    from wmrl.run.machine import _time_world_model, pipeline_suite

    cfg = _pipeline_cfg()
    cfg.stages.worldmodel.train.batch_size = 2
    out = {}
    wm = _time_world_model(cfg, out, pipeline_suite(cfg))
    assert out["wm_step_s"] > 0 and wm.dynamics is not None and wm.action_dim == 5 and wm.grasp is not None
