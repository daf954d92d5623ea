"""Timing pieces shared by the benchmarks (``wmrl bench policy|sim``) and the pipeline's time estimate
(``wmrl.run.machine``): a non-entry module of the composition roots."""

from __future__ import annotations

import copy
import dataclasses
import time

import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf


def policy_for_bench(cfg: DictConfig):
    """The benchmarked policy: ``cfg.checkpoint`` loaded, else ``cfg.policy`` built with random
    normalisation stats. Returns ``(policy, loaded_from_checkpoint)``."""
    if cfg.get("checkpoint"):
        from wmrl.kernel.checkpoint import load_checkpoint

        return load_checkpoint(cfg.checkpoint), True
    from wmrl.kernel.storage import NormStats

    pc = OmegaConf.to_container(cfg.policy, resolve=True)
    pc["cameras"] = pc.get("cameras") or list(cfg.cameras)
    pc["image_size"] = pc.get("image_size") or list(cfg.image_size)
    pc["state_dim"] = pc.get("state_dim") or int(cfg.state_dim)
    pc["action_dim"] = pc.get("action_dim") or int(cfg.action_dim)
    if pc.get("action_space") is None and cfg.get("action_space") is not None:   # e.g. the suite's (a dict)
        pc["action_space"] = OmegaConf.to_container(cfg.action_space, resolve=True)
    policy = instantiate(pc, _convert_="all")
    rng = np.random.default_rng(0)
    policy.set_norm_stats(NormStats.from_data({"proprio": rng.standard_normal((256, policy.state_dim)),
                                               "actions": rng.uniform(-1, 1, (256, policy.action_dim))}))
    return policy, False


def random_obs(policy, b: int, seed: int = 0):
    """A batch of ``b`` random observations at ``policy``'s cameras, image size and state dim."""
    from wmrl.kernel.types import Obs

    g = torch.Generator().manual_seed(seed)
    h, w = policy.image_size
    return Obs({c: torch.randint(0, 256, (b, 3, h, w), generator=g, dtype=torch.uint8) for c in policy.cameras},
               torch.randn(b, policy.state_dim, generator=g), ["lift the red cube"] * b)


def time_ms(fn, runs: int, warmup: int) -> np.ndarray:
    """``float64 (runs,)`` milliseconds of each of ``runs`` calls of ``fn()`` after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return np.asarray(out) * 1000.0


def bc_step_fn(policy, b: int, bf16: bool, device_type: str):
    """One BC step (forward under autocast if ``bf16``, backward, AdamW, EMA) on random windows, on a
    fresh copy of ``policy``."""
    from policies.train import DEFAULTS, _cfg

    train_pol = copy.deepcopy(policy).train()
    o = random_obs(train_pol, b, seed=1)
    batch = {"images": o.images, "proprio": o.proprio,
             "actions": torch.rand(b, train_pol.chunk_size, train_pol.action_dim) * 2 - 1,
             "action_pad": torch.zeros(b, train_pol.chunk_size, dtype=torch.bool), "instruction": o.task}
    c = _cfg({"batch_size": b})
    params = [p for p in train_pol.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=c["lr"], weight_decay=c["weight_decay"])
    ema = copy.deepcopy(train_pol)
    gen = torch.Generator().manual_seed(0)

    def step():
        with torch.autocast(device_type=device_type, dtype=torch.bfloat16, enabled=bf16):
            loss, _ = train_pol.loss(batch, generator=gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, c["grad_clip"])
        opt.step()
        with torch.no_grad():
            for pe, pp in zip(ema.parameters(), train_pol.parameters()):
                pe.lerp_(pp, 1 - DEFAULTS["ema_decay"])

    return step


def sim_rates(suite, task: str, cameras, render, steps: int, warmup: int) -> dict:
    """Steps/s and render / physics ms per step of ``task``'s scene driven by its scripted expert."""
    from sim.env import TaskEnv
    from sim.expert import ScriptedExpert

    spec = suite.task(task)
    env = TaskEnv(spec.scene, cameras, suite.image_size, render, suite.control)
    n, idx, t_total, t_render = 0, 0, 0.0, 0.0
    while n < steps + warmup:
        env.reset(spec, suite.init_state(task, "eval", idx % 50))
        expert = ScriptedExpert(spec, 0.0, idx, control=suite.control)
        idx += 1
        while n < steps + warmup:
            t0 = time.perf_counter()
            env.observe()
            t1 = time.perf_counter()
            _, _, te, tr = env.step(expert.act(env.privileged()))
            t2 = time.perf_counter()
            if n >= warmup:
                t_total += t2 - t0
                t_render += t1 - t0
            n += 1
            if te or tr:
                break
    return {"cameras": list(cameras), "image_size": list(suite.image_size), "render": dataclasses.asdict(env.render_settings),
            "steps": steps, "steps_per_s": steps / t_total, "render_ms_per_step": 1000 * t_render / steps,
            "physics_ms_per_step": 1000 * (t_total - t_render) / steps}


def random_chunks(n: int, b: int, h: int, d: int, seed: int) -> torch.Tensor:
    """``n`` seeded batches of uniform action chunks in [-1, 1]: float32 ``(n, b, h, d)``."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, b, h, d, generator=g) * 2 - 1


def timed_chunks(env, starts, chunks: torch.Tensor) -> tuple[float, int]:
    """Reset ``env`` (a ChunkEnv) to ``starts``, step it through ``chunks`` ``(n, B, H, D)``; returns
    ``(seconds, control steps executed)``."""
    env.reset(starts)
    steps = 0
    t0 = time.perf_counter()
    for a in chunks:
        res = env.step(a)
        steps += int(res.steps_executed.sum())
    return time.perf_counter() - t0, steps
