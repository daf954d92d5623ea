"""Exact resume (issue #25): every trainer killed at random moments and started again ends bitwise
equal to the uninterrupted run (weights, optimizer, RNG states), and a finished run started again
returns its report unchanged and writes nothing.

Kills are made in process (an exception from the model's loss at a chosen step, so the run stops
between two checkpoints as a killed process does) and, for BC, with a real SIGKILL of a child process."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from fresh_procs import fresh_processes
from grpo_fakes import GaussianChunkPolicy, NoisyToyEnv, toy_starts
from hydra.utils import instantiate
from omegaconf import OmegaConf
from safetensors.torch import load_file
from test_policy import tiny_policy, toy_store

from wmrl import rl as grpo
from wmrl.kernel.rng import capture_rng, restore_rng
from wmrl.kernel.storage import EpisodeStore, WindowDataset
from wmrl.rl import loop as grpo_loop
from worldmodels.data import EpisodeFrames
from worldmodels.synthetic import make_episodes
from worldmodels.train import train_critic, train_world_model

WM_TINY = OmegaConf.to_container(OmegaConf.load("configs/worldmodel/tiny.yaml"))
CRITIC_TINY = OmegaConf.to_container(OmegaConf.load("configs/critic/tiny.yaml"))
TIME_KEYS = {"train_time_s", "samples_per_s", "train_seconds", "train_cpu_seconds_per_thread", "resumed_from",
             "steps_this_run", "wall_s", "checkpoint", "step_checkpoint"}   # times, and paths of the two run dirs


class Killed(Exception):
    """Stands for a SIGKILL: raised from inside a training step."""


def kill_at(obj, name: str, calls: int) -> None:
    """Make ``obj.<name>`` raise :class:`Killed` on its ``calls``-th call (1-based)."""
    fn = getattr(obj, name)
    n = {"calls": 0}

    def wrapped(*a, **kw):
        n["calls"] += 1
        if n["calls"] >= calls:
            raise Killed
        return fn(*a, **kw)

    setattr(obj, name, wrapped)


def kill_steps(total: int, every: int, seed: int) -> list[int]:
    """Three random steps to kill at, each after a checkpoint the previous kill did not reach yet."""
    rng = np.random.default_rng(seed)
    out, last_ck = [], 0
    for _ in range(3):
        lo = last_ck + every + 1
        k = int(rng.integers(lo, min(total, lo + every)))
        out.append(k)
        last_ck = (k - 1) // every * every
    assert out[-1] < total
    return out


def interrupt_three_times(make_model, train, steps: int, every: int, run_dir: Path, seed: int) -> None:
    """``train(model)`` on a fresh ``make_model()`` three times, each stopped by :class:`Killed` from
    the model's loss at a random step (:func:`kill_steps`) after the checkpoint it resumes from."""
    for k in kill_steps(steps, every, seed=seed):
        m = make_model()
        last = run_dir / "checkpoints" / "last"
        done = json.loads((last / "meta.json").read_text())["step"] if last.exists() else 0
        kill_at(m, "loss", k - done)
        with pytest.raises(Killed):
            train(m)


def checkpoint_tensors(folder: Path) -> dict[str, torch.Tensor]:
    t = load_file(str(folder / "model.safetensors"))
    if (folder / "extra.safetensors").is_file():
        t.update({f"extra/{k}": v for k, v in load_file(str(folder / "extra.safetensors")).items()})
    return t


def assert_same_checkpoint(a: Path, b: Path) -> None:
    ta, tb = checkpoint_tensors(a), checkpoint_tensors(b)
    assert sorted(ta) == sorted(tb)
    different = [k for k in ta if not torch.equal(ta[k], tb[k])]
    assert not different, f"differ after resume: {different[:5]}"


def same_report(a: dict, b: dict) -> bool:
    diff = {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if k not in TIME_KEYS and a.get(k) != b.get(k)}
    assert not diff, f"reports differ: {diff}"
    return True


def test_rng_capture_and_restore_roundtrip():
    g, r = torch.Generator().manual_seed(5), np.random.default_rng(6)
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    tensors, meta = capture_rng({"g": g, "r": r})
    json.dumps(meta)
    want = (torch.rand(3, generator=g), r.random(3), torch.rand(3), np.random.rand(3), random.random())
    torch.rand(7, generator=g), r.random(7), torch.rand(7), np.random.rand(7), random.random()
    assert restore_rng(tensors, meta, {"g": g, "r": r, "new": torch.Generator()}) == ["new"]
    got = (torch.rand(3, generator=g), r.random(3), torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(got[0], want[0]) and np.array_equal(got[1], want[1]) and torch.equal(got[2], want[2])
    assert np.array_equal(got[3], want[3]) and got[4] == want[4]
    with pytest.raises(ValueError, match="must not contain"):
        capture_rng({"a/b": g})
    with pytest.raises(TypeError, match="not a torch.Generator"):
        capture_rng({"x": 3})


# ----------------------------------------------------------------------------- BC

BC_CFG = dict(steps=40, batch_size=16, lr=3e-3, warmup_steps=5, ckpt_every=6, log_every=5, ema_decay=0.9)


@pytest.fixture(scope="module")
def bc_data(tmp_path_factory):
    store = toy_store(tmp_path_factory.mktemp("bc") / "store")
    return store, WindowDataset(store, n_obs=1, horizon=4)


def fresh_policy(store):
    torch.manual_seed(0)
    return tiny_policy().set_norm_stats(store.stats())


def test_bc_killed_three_times_resumes_bitwise(bc_data, tmp_path):
    from policies.train import train_bc

    store, ds = bc_data
    full = train_bc(fresh_policy(store), ds, BC_CFG, tmp_path / "full", val_dataset=ds)
    interrupt_three_times(lambda: fresh_policy(store), lambda m: train_bc(m, ds, BC_CFG, tmp_path / "killed", val_dataset=ds),
                          BC_CFG["steps"], BC_CFG["ckpt_every"], tmp_path / "killed", seed=1)
    resumed = train_bc(fresh_policy(store), ds, BC_CFG, tmp_path / "killed", val_dataset=ds)
    assert resumed["resumed_from"] is not None
    assert_same_checkpoint(tmp_path / "full" / "checkpoints" / "last", tmp_path / "killed" / "checkpoints" / "last")
    assert same_report(full, resumed) and resumed["final_loss"] == full["final_loss"]
    # a finished run started again: the same report, nothing rewritten
    meta = tmp_path / "full" / "checkpoints" / "last" / "meta.json"
    before = meta.stat().st_mtime_ns
    again = train_bc(fresh_policy(store), ds, BC_CFG, tmp_path / "full", val_dataset=ds)
    assert again == json.loads(json.dumps(full)) and meta.stat().st_mtime_ns == before


def test_bc_checkpoint_of_an_older_wmrl_still_resumes_with_a_note(bc_data, tmp_path, caplog):
    from policies.train import train_bc

    store, ds = bc_data
    p = fresh_policy(store)
    kill_at(p, "loss", 10)
    with pytest.raises(Killed):
        train_bc(p, ds, BC_CFG, tmp_path)
    meta_f = tmp_path / "checkpoints" / "last" / "meta.json"
    meta = json.loads(meta_f.read_text())
    del meta["rng_streams"], meta["progress"]
    meta_f.write_text(json.dumps(meta))
    rep = train_bc(fresh_policy(store), ds, BC_CFG, tmp_path)
    assert rep["steps"] == BC_CFG["steps"] and "not bitwise" in caplog.text


def _bc_child(store_path: str, out: str) -> None:
    torch.set_num_threads(1)
    from policies.train import train_bc

    store = EpisodeStore.open(store_path, "r")
    train_bc(fresh_policy(store), WindowDataset(store, n_obs=1, horizon=4), {**BC_CFG, "steps": 150, "ckpt_every": 25},
             out)


def run_to_end(target, args: tuple, ck: Path | None = None) -> float:
    """Run ``target(*args)`` in a fresh process to its end; returns the median time between two new
    ``ck/step_*`` checkpoints (``inf`` when fewer than two were seen or ``ck`` is ``None``)."""
    proc = fresh_processes().Process(target=target, args=args)
    proc.start()
    seen, times = set(), []
    while proc.is_alive():
        if ck is not None and ck.is_dir():
            new = {d.name for d in ck.glob("step_*")} - seen
            if new:
                seen |= new
                times.append(time.monotonic())
        proc.join(0.01)
    proc.join(300)
    assert proc.exitcode == 0
    gaps = np.diff(times)
    return float(np.median(gaps)) if len(gaps) else float("inf")


def sigkill_three_times(target, args: tuple, ck: Path, seed: int, max_delay_s: float) -> None:
    """Start ``target(*args)`` in a fresh process three times and SIGKILL it each time at a random
    moment, up to ``max_delay_s`` after a new ``ck/step_*`` checkpoint appears: mid-step or mid-save
    (``max_delay_s`` below the time between two checkpoints, so the kill lands before the next)."""
    ctx, rng, landed = fresh_processes(), random.Random(seed), 0
    for _ in range(3):
        proc = ctx.Process(target=target, args=args)
        seen = {d.name for d in ck.glob("step_*")} if ck.is_dir() else set()
        proc.start()
        t0 = time.time()
        while proc.is_alive() and time.time() - t0 < 120 and not (
                ck.is_dir() and {d.name for d in ck.glob("step_*")} - seen):
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, max_delay_s))
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
            landed += 1
        proc.join(30)
    assert landed >= 2, "the child finished before the kills: make the run longer"


def kill_delay(interval_s: float) -> float:
    """Kills land up to 80 % of the reference run's time between two checkpoints after one appears."""
    return min(0.4, 0.8 * interval_s)


def final_reports(tmp_path: Path) -> tuple[dict, dict]:
    """The reports saved in the final checkpoints of the ``full`` and ``killed`` runs."""
    return tuple(json.loads((tmp_path / d / "checkpoints" / "last" / "meta.json").read_text())["report"]
                 for d in ("full", "killed"))


def test_bc_sigkilled_three_times_resumes_bitwise(bc_data, tmp_path):
    """Every run in a fresh process, as every command is: bf16 CPU kernels can round differently in
    a process that has computed other things before (the uninterrupted run is a fresh process too)."""
    store, _ = bc_data
    gap = run_to_end(_bc_child, (str(store.path), str(tmp_path / "full")), tmp_path / "full" / "checkpoints")
    ck = tmp_path / "killed" / "checkpoints"
    sigkill_three_times(_bc_child, (str(store.path), str(tmp_path / "killed")), ck, seed=7, max_delay_s=kill_delay(gap))
    run_to_end(_bc_child, (str(store.path), str(tmp_path / "killed")))
    assert_same_checkpoint(tmp_path / "full" / "checkpoints" / "last", ck / "last")
    full, resumed = final_reports(tmp_path)
    assert resumed["steps"] == 150 and resumed["resumed_from"] is not None
    assert resumed["final_loss"] == full["final_loss"]


# ----------------------------------------------------------------------------- world model and critic

@pytest.fixture(scope="module")
def frames():
    return EpisodeFrames(make_episodes(6, length=20, size=32, seed=1))


def fresh(cfg: dict):
    torch.manual_seed(0)
    return instantiate(cfg, _convert_="all")


WM_KW = dict(steps=30, batch_size=4, lr=3e-3, warmup=3, checkpoint_every=5, eval_every=1000, log_every=5,
             progress=False, tensorboard=False, seed=2)
CRITIC_KW = dict(steps=30, batch_size=8, lr=3e-3, warmup=3, checkpoint_every=5, eval_every=1000, log_every=5,
                 success_tail=4, progress=False, tensorboard=False, seed=2)


@pytest.mark.parametrize("which", ["worldmodel", "critic"])
def test_worldmodel_and_critic_killed_three_times_resume_bitwise(which, frames, tmp_path):
    cfg, kw, fn = (WM_TINY, WM_KW, train_world_model) if which == "worldmodel" else (CRITIC_TINY, CRITIC_KW, train_critic)
    full = fn(fresh(cfg), cfg, frames, tmp_path / "full", heldout=frames, **kw)
    interrupt_three_times(lambda: fresh(cfg), lambda m: fn(m, cfg, frames, tmp_path / "killed", heldout=frames, **kw),
                          kw["steps"], kw["checkpoint_every"], tmp_path / "killed", seed=3)
    resumed = fn(fresh(cfg), cfg, frames, tmp_path / "killed", heldout=frames, **kw)
    assert resumed["resumed_from"] is not None and resumed["steps"] == kw["steps"]
    assert_same_checkpoint(tmp_path / "full" / "checkpoints" / "last", tmp_path / "killed" / "checkpoints" / "last")
    assert same_report(full, resumed)
    # a finished run started again: its report unchanged, the caller's model holds the final weights
    meta = tmp_path / "full" / "checkpoints" / "last" / "meta.json"
    before = meta.stat().st_mtime_ns
    m = fresh(cfg)
    again = fn(m, cfg, frames, tmp_path / "full", heldout=frames, **kw)
    assert again == json.loads(json.dumps(full, default=float)) and meta.stat().st_mtime_ns == before
    final = load_file(str(tmp_path / "full" / "checkpoints" / "last" / "model.safetensors"))
    assert all(torch.equal(v, final[k]) for k, v in m.state_dict().items() if k in final)


def test_resume_into_another_architecture_is_refused_clearly(frames, tmp_path):
    train_world_model(fresh(WM_TINY), WM_TINY, frames, tmp_path, **{**WM_KW, "steps": 5})
    other = {**WM_TINY, "block_out_channels": [8, 16]} if WM_TINY.get("block_out_channels") != [8, 16] else \
        {**WM_TINY, "block_out_channels": [16, 32]}
    with pytest.raises(RuntimeError, match="does not fit"):
        train_world_model(fresh(other), other, frames, tmp_path, **{**WM_KW, "steps": 10})


# ----------------------------------------------------------------------------- GRPO

def _grpo(tmp, iterations, kill_after_steps=None, streams=True):
    torch.manual_seed(0)
    pol = GaussianChunkPolicy()
    env = NoisyToyEnv(num_envs=8, max_steps=12, reward_noise=0.3)
    if kill_after_steps is not None:
        kill_at(env, "step", kill_after_steps)
    opt = torch.optim.Adam(pol.parameters(), lr=0.02)
    cfg = grpo.GRPOConfig(group_size=4, max_chunks=3, epochs=1, minibatch_size=16)
    starts = toy_starts(2)
    setup = grpo.GRPOSetup(pol, {"chunk_size": 4, "action_dim": 3}, env, opt, lambda it: starts, cfg,
                           rng_streams=env.rng_streams() if streams else None)
    out = grpo.train_grpo(setup, grpo.LoopConfig(iterations, tmp, seed=3, progress=False))
    return pol, out


@pytest.mark.parametrize("streams", [True, False])
def test_grpo_killed_three_times_resumes_bitwise_with_the_env_streams(streams, tmp_path):
    _, full = _grpo(tmp_path / "full", 6, streams=streams)
    for k in (5, 4, 7):   # env steps into the attempt: 3 chunks per iteration, kills mid-iteration
        with pytest.raises(Killed):
            _grpo(tmp_path / "killed", 6, kill_after_steps=k, streams=streams)
    _, resumed = _grpo(tmp_path / "killed", 6, streams=streams)
    same = [a["reward_mean"] for a in full["history"]] == [b["reward_mean"] for b in resumed["history"]]
    assert same == streams   # without the env's generator in the checkpoint the resumed rewards differ
    if streams:
        assert_same_checkpoint(tmp_path / "full" / "checkpoints" / "last", tmp_path / "killed" / "checkpoints" / "last")


def test_post_train_killed_three_times_resumes_bitwise(tmp_path, monkeypatch):
    """The entry point: imagination-like env with its own noise generator, debiasing and denoising
    on (their envs and generators), evaluation every 2 iterations; killed inside iterations 2, 3, 5."""
    from test_post_train import _cfg

    from wmrl.run import post_train
    from wmrl.run.common import RunContext

    cfg = _cfg(tmp_path, iterations=6, checkpoint_every=1, tensorboard=False)
    cfg.env.chunk_env = {"_target_": "grpo_fakes.NoisyToyEnv", "num_envs": 8, "max_steps": 16, "reward_bias": 0.3,
                         "reward_noise": 0.2, "seed": 0}
    full = post_train.run(cfg, RunContext(cfg, out_dir=tmp_path / "full"))
    for kill in (2, 3, 5):
        last = tmp_path / "killed" / "checkpoints" / "last"
        done = json.loads((last / "meta.json").read_text())["iteration"] if last.exists() else 0
        monkeypatch.setattr(grpo_loop, "grpo_iteration", grpo_loop.grpo_iteration)   # put back at teardown
        kill_at(grpo_loop, "grpo_iteration", kill - done)
        with pytest.raises(Killed):
            post_train.run(cfg, RunContext(cfg, out_dir=tmp_path / "killed"))
        monkeypatch.undo()
    resumed = post_train.run(cfg, RunContext(cfg, out_dir=tmp_path / "killed"))
    assert resumed["resumed_from"] is not None
    assert_same_checkpoint(tmp_path / "full" / "checkpoints" / "last", tmp_path / "killed" / "checkpoints" / "last")

    def strip(h):
        return [{k: v for k, v in e.items() if k not in TIME_KEYS} for e in h]

    assert strip(full["history"]) == strip(resumed["history"]) and full["evals"] == resumed["evals"]
    assert full["debias_state"] == resumed["debias_state"]


def _wm_child(which: str, out: str) -> None:
    torch.set_num_threads(1)
    cfg, kw, fn = (WM_TINY, WM_KW, train_world_model) if which == "worldmodel" else (CRITIC_TINY, CRITIC_KW, train_critic)
    frames = EpisodeFrames(make_episodes(6, length=20, size=32, seed=1))
    fn(fresh(cfg), cfg, frames, Path(out), **{**kw, "steps": 120, "checkpoint_every": 20})


@pytest.mark.parametrize("which", ["worldmodel", "critic"])
def test_worldmodel_and_critic_sigkilled_three_times_resume_bitwise(which, tmp_path):
    """Fresh processes throughout (as for BC above): the reference, three runs SIGKILLed at random
    moments after a new checkpoint, and the run that finishes."""
    gap = run_to_end(_wm_child, (which, str(tmp_path / "full")), tmp_path / "full" / "checkpoints")
    ck = tmp_path / "killed" / "checkpoints"
    sigkill_three_times(_wm_child, (which, str(tmp_path / "killed")), ck, seed=11, max_delay_s=kill_delay(gap))
    run_to_end(_wm_child, (which, str(tmp_path / "killed")))
    assert_same_checkpoint(tmp_path / "full" / "checkpoints" / "last", ck / "last")
    full, resumed = final_reports(tmp_path)
    assert resumed["resumed_from"] is not None and same_report(full, resumed)
