"""`wmrl post-train` run() on the fake ChunkEnv (imagination-like env with a biased reward, real env
for evaluation and debiasing), resume, and the Hydra config composition."""

import json

import pytest
from grpo_fakes import GaussianChunkPolicy
from omegaconf import OmegaConf

from wmrl.kernel.checkpoint import save_checkpoint
from wmrl.run import builders, post_train
from wmrl.run.common import RunContext

TASKS = {"reach_a": "go reach_a", "reach_b": "go reach_b"}


def _cfg(tmp_path, **over):
    pol = GaussianChunkPolicy(init_std=0.5)
    save_checkpoint(pol, tmp_path / "bc", {"chunk_size": 4, "action_dim": 3, "init_std": 0.5})
    env = {"_target_": "grpo_fakes.ToyReachEnv", "num_envs": 8, "max_steps": 16, "reward_bias": 0.3}
    real = {"_target_": "grpo_fakes.ToyReachEnv", "num_envs": 5, "max_steps": 16}
    cfg = OmegaConf.create({
        "seed": 0, "num_threads": 1, "device": "cpu", "checkpoint": str(tmp_path / "bc"), "tasks": TASKS, "suite": None,
        "iterations": 4, "lr": 0.03, "resume": True, "checkpoint_every": 2, "tensorboard": True, "progress": False,
        "rl_sampler": None, "eval_sampler": None,
        "env": {"name": "imagination", "context_starts": True, "chunk_env": env, "context_env": real},
        "grpo": {"group_size": 4, "max_chunks": 4, "epochs": 2, "minibatch_size": 32, "kl_coef": 0.01,
                 "reward_mode": "return+success"},
        "starts": {"n_init": 20, "per_task": 2},
        "evaluation": {"every": 2, "episodes_per_task": 5, "num_envs": 5, "max_chunks": 4, "env": real},
        "mitigations": {"debias": {"enabled": True, "every": 1, "starts": 2, "rollouts_per_start": 2, "momentum": 0.5,
                                   "env": real},
                        "denoise": {"enabled": True, "samples": 2}},
    })
    return OmegaConf.merge(cfg, OmegaConf.create(over))


def test_post_train_runs_reports_and_resumes(tmp_path):
    cfg = _cfg(tmp_path)
    out = tmp_path / "run"
    rep = post_train.run(cfg, RunContext(cfg, out_dir=out))
    assert [e["iteration"] for e in rep["evals"]] == [0, 2, 4]
    assert rep["before"]["n"] == 10 and set(rep["after"]["per_task"]) == set(TASKS)
    assert rep["env_counters"] is None          # the toy env declares no CountingEnv capability
    lo, hi = rep["after"]["ci95"]
    assert lo <= rep["after"]["success"] <= hi
    h = rep["history"][-1]
    # the debiaser saw the +0.3 per chunk reward bias of the "imagination" env
    assert all(v > 0.2 for k, v in rep["debias_state"]["bias"].items())
    assert "denoise_var_mean" in h and "bias/reach_a" in h
    assert rep["mitigations"] == {"debias": True, "denoise": True}
    assert (out / "checkpoints" / "last" / "model.safetensors").is_file()
    assert list((out / "tb").iterdir())
    json.dumps(rep)  # JSON-serialisable
    # resume: asking for 6 iterations continues from iteration 4
    cfg6 = OmegaConf.merge(cfg, {"iterations": 6})
    rep6 = post_train.run(cfg6, RunContext(cfg6, out_dir=out))
    assert rep6["resumed_from"] is not None
    assert [hh["iteration"] for hh in rep6["history"]] == [1, 2, 3, 4, 5, 6]
    assert rep6["history"][:4] == rep["history"]


def test_post_train_with_a_chunk_value_runs_and_resumes(tmp_path):
    cfg = OmegaConf.merge(_cfg(tmp_path), {"iterations": 2, "grpo": {"advantage": "gae", "value_hidden": 32}})
    out = tmp_path / "run"
    rep = post_train.run(cfg, RunContext(cfg, out_dir=out))
    assert all("value_loss" in h and "value_explained_var" in h for h in rep["history"])
    cfg3 = OmegaConf.merge(cfg, {"iterations": 3})
    rep3 = post_train.run(cfg3, RunContext(cfg3, out_dir=out))
    assert rep3["resumed_from"] is not None and rep3["history"][:2] == rep["history"]
    # a run written without a value head is not silently resumed with one
    plain = OmegaConf.merge(_cfg(tmp_path), {"iterations": 1})
    post_train.run(plain, RunContext(plain, out_dir=tmp_path / "plain"))
    with pytest.raises(ValueError, match="without a value head"):
        post_train.run(cfg3, RunContext(cfg3, out_dir=tmp_path / "plain"))


def test_distillation_in_imagination_is_refused_unless_asked_for(tmp_path):
    cfg = OmegaConf.merge(_cfg(tmp_path), {"distill": {"every": 1, "steps": 1, "batch_size": 2, "lr": 1e-4}})
    with pytest.raises(ValueError, match="distill.in_imagination=true"):
        post_train.run(cfg, RunContext(cfg, out_dir=tmp_path / "run"))
    # asked for: the hook runs (the toy's first iteration has no success to distil, so no BC loss is needed)
    cfg = OmegaConf.merge(cfg, {"distill": {"in_imagination": True}, "iterations": 1})
    rep = post_train.run(cfg, RunContext(cfg, out_dir=tmp_path / "run2"))
    assert rep["history"][0]["distill_chunks"] == 0.0


def test_post_train_clear_error_without_policy(tmp_path):
    cfg = _cfg(tmp_path)
    cfg.checkpoint = "???"
    with pytest.raises(ValueError, match="checkpoint=PATH"):
        post_train.run(cfg, RunContext(cfg, out_dir=tmp_path / "x"))


def test_hydra_config_composes_for_both_envs():
    from hydra import compose, initialize_config_module

    with initialize_config_module("configs", version_base="1.3"):
        c = compose("post_train", overrides=["checkpoint=p", "env=sim"])
        assert c.env.name == "sim" and c.grpo.group_size >= 2 and c.evaluation.episodes_per_task == 50
        c = compose("post_train", overrides=["checkpoint=p", "env.world_model=w", "env.critic=c", "suite=tiny"])
        assert c.env.name == "imagination" and c.env.world_model == "w" and c.suite.name == "tiny"


def test_trainable_prefixes_freeze_the_rest():
    pol = GaussianChunkPolicy()
    params = builders.trainable_parameters(pol, ["log_std"])
    assert params == [pol.log_std] and not pol.net.weight.requires_grad and pol.log_std.requires_grad
    assert len(builders.trainable_parameters(GaussianChunkPolicy(), None)) == 3
    with pytest.raises(ValueError, match="modules are"):
        builders.trainable_parameters(GaussianChunkPolicy(), ["head"])


def test_store_only_starts_need_no_sim(tmp_path):
    """starts.per_task=0 with keyframes: GRPO's starts come from the store alone (LIBERO demos), and
    starts.first_steps=1 makes them the episodes' first frames; without keyframes it is an error."""
    from wmrl.kernel.storage import EpisodeStore
    from wmrl.kernel.types import PANDA_OSC_POSE
    from wmrl.rl.starts import KeyframeStarts
    from wmrl.run.grpo_job import _starts
    from worldmodels.synthetic import make_episodes

    store = EpisodeStore.create(tmp_path / "s", cameras={"agentview": (32, 32), "robot0_eye_in_hand": (32, 32)},
                                state_dim=9, action_dim=7, fps=20, action_space=PANDA_OSC_POSE, embodiment="toy",
                                source="synthetic")
    for e in make_episodes(3, length=20, size=32, seed=5):
        store.append(e)
    tasks = {t: t for t in set(store.task_names)}
    cfg = OmegaConf.create({"seed": 0, "env": {"context_starts": False},
                            "starts": {"per_task": 0, "store": str(tmp_path / "s"), "keyframes_per_task": 2,
                                       "first_steps": 1}})
    ctx = RunContext(cfg, out_dir=tmp_path / "run")
    fn = _starts(cfg, ctx, None, tasks, 0)
    assert isinstance(fn, KeyframeStarts)
    got = fn(0)
    assert len(got) == 2 * len(tasks) and {s.step for s in got} == {0}
    cfg.starts.keyframes_per_task = 0
    with pytest.raises(ValueError, match="per_task=0 needs keyframe starts"):
        _starts(cfg, ctx, None, tasks, 0)
