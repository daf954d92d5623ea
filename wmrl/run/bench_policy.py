"""``wmrl bench policy``: inference latency per action chunk at batch 1 and BC training speed.

    wmrl bench policy [num_threads=2] [checkpoint=runs/bc/checkpoints/last] [policy=tiny]

Prints and reports (``report.json``):

* ``inference_ms``: median / p90 wall time of ``policy.sample(obs)`` at batch 1 for the Euler ODE
  sampler (evaluation) and the SDE sampler (GRPO; includes computing the chain log-prob), each with
  the policy's ``num_steps``; the instruction embedding is cached after the first call, as in use;
* ``bc``: median time of one BC step (forward, backward, AdamW, EMA) at ``batch_size`` on random
  windows of the default sizes, samples/s, and the estimated wall time of ``bc_steps`` steps
  (``wmrl train-policy`` default), next to the issue's budgets (50 ms, 8 min).

Figures are wall-clock on this machine with ``num_threads`` torch threads; other processes on the
machine slow them down. Timings are never asserted in tests.
"""

from __future__ import annotations

import copy
import logging
import time

import hydra
import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from wmrl.run.common import RunContext, run_main

log = logging.getLogger("wmrl.bench_policy")


def _build(cfg: DictConfig):
    if cfg.get("checkpoint"):
        from wmrl.checkpoint import load_checkpoint

        return load_checkpoint(cfg.checkpoint), True
    from wmrl.storage import NormStats

    pc = OmegaConf.to_container(cfg.policy, resolve=True)
    pc["cameras"] = pc.get("cameras") or list(cfg.cameras)
    pc["image_size"] = pc.get("image_size") or list(cfg.image_size)
    pc["state_dim"] = pc.get("state_dim") or int(cfg.state_dim)
    pc["action_dim"] = pc.get("action_dim") or int(cfg.action_dim)
    policy = instantiate(pc, _convert_="all")
    rng = np.random.default_rng(0)
    policy.set_norm_stats(NormStats.from_data({"proprio": rng.standard_normal((256, policy.state_dim)),
                                               "actions": rng.uniform(-1, 1, (256, policy.action_dim))}))
    return policy, False


def _obs(policy, b: int, seed: int = 0):
    from wmrl.types import Obs

    g = torch.Generator().manual_seed(seed)
    h, w = policy.image_size
    return Obs({c: torch.randint(0, 256, (b, 3, h, w), generator=g, dtype=torch.uint8) for c in policy.cameras},
               torch.randn(b, policy.state_dim, generator=g), ["lift the red cube"] * b)


def _time(fn, runs: int, warmup: int) -> np.ndarray:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return np.asarray(out) * 1000.0


def run(cfg: DictConfig, ctx: RunContext) -> dict:
    from policies.samplers import EulerODESampler, SDESampler
    from policies.train import DEFAULTS, _cfg

    policy, trained = _build(cfg)
    policy.eval()
    k = int(getattr(policy.sampler, "num_steps", 10))
    obs = _obs(policy, 1)
    report: dict = {"policy": cfg.get("checkpoint") or OmegaConf.select(cfg, "policy._target_"),
                    "trained_checkpoint": trained, "num_threads": torch.get_num_threads(),
                    "num_params": sum(p.numel() for p in policy.parameters()), "inference_ms": {}}
    for name, sampler in (("ode", EulerODESampler(k)), ("sde", SDESampler(k, 0.5))):
        policy.sampler = sampler
        gen = torch.Generator().manual_seed(0)
        ms = _time(lambda: policy.sample(obs, gen), int(cfg.inference_runs), 5)
        report["inference_ms"][name] = {"num_steps": k, "median": float(np.median(ms)), "p90": float(np.percentile(ms, 90))}
        print(f"inference ({name}, K={k}, batch 1): median {np.median(ms):.1f} ms, p90 {np.percentile(ms, 90):.1f} ms "
              f"per chunk (budget {cfg.budget_inference_ms} ms)")

    # BC step timing on random windows of the policy's sizes
    train_pol = copy.deepcopy(policy).train()
    b = int(cfg.batch_size)
    o = _obs(train_pol, b, seed=1)
    batch = {"images": o.images, "proprio": o.proprio,
             "actions": torch.rand(b, train_pol.chunk_size, train_pol.action_dim) * 2 - 1,
             "action_pad": torch.zeros(b, train_pol.chunk_size, dtype=torch.bool), "instruction": o.task}
    c = _cfg({"batch_size": b})
    params = [p for p in train_pol.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=c["lr"], weight_decay=c["weight_decay"])
    ema = copy.deepcopy(train_pol)
    gen = torch.Generator().manual_seed(0)

    bf16 = bool(cfg.get("bf16", True))

    def step():
        with torch.autocast(device_type="cpu" if str(cfg.device) == "cpu" else "cuda", dtype=torch.bfloat16, enabled=bf16):
            loss, _ = train_pol.loss(batch, generator=gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, c["grad_clip"])
        opt.step()
        with torch.no_grad():
            for pe, pp in zip(ema.parameters(), train_pol.parameters()):
                pe.lerp_(pp, 1 - DEFAULTS["ema_decay"])

    ms = _time(step, int(cfg.train_steps), 3)
    med = float(np.median(ms))
    est_min = med * int(cfg.bc_steps) / 60000.0
    report["bc"] = {"batch_size": b, "bf16": bf16, "step_ms_median": med, "samples_per_s": b * 1000.0 / med,
                    "bc_steps": int(cfg.bc_steps), "estimated_bc_minutes": est_min,
                    "budget_minutes": float(cfg.budget_bc_min)}
    report["within_budget"] = {"inference": report["inference_ms"]["ode"]["median"] <= cfg.budget_inference_ms,
                               "bc": est_min <= cfg.budget_bc_min}
    print(f"BC step (batch {b}, bf16 autocast {bf16}): median {med:.0f} ms, {b * 1000.0 / med:.0f} samples/s; "
          f"{cfg.bc_steps} steps ~ {est_min:.1f} min (budget {cfg.budget_bc_min} min)")
    return report


@hydra.main(version_base="1.3", config_path="pkg://configs", config_name="bench_policy")
def main(cfg: DictConfig) -> None:
    run_main(cfg, run, "bench policy")


if __name__ == "__main__":
    main()
