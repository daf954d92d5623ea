"""``wmrl bench imagination``: imagined control steps per second (``ImaginationEnv`` with the world
model and critic) next to the real ``SimEnv`` on the same machine.

Example::

    wmrl bench imagination world_model=runs/wm/checkpoints/last critic_checkpoint=runs/critic/checkpoints/last
    wmrl bench imagination               # untrained models of the configured size (same compute)

Control steps/s = ``B * H * chunks / seconds`` (batch ``B`` = 32, two 64x64 cameras, ``H`` = 8 by
default). Both environments start from the same real frames (the sim's reset observations) and
take the same random action chunks.
"""

from __future__ import annotations

import hydra
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from wmrl.kernel.types import Obs, Start
from wmrl.run.common import RunContext, run_main
from wmrl.run.measure import random_chunks, timed_chunks


def run(cfg: DictConfig, ctx: RunContext) -> dict:
    from wmrl.imagination import ImaginationEnv
    from wmrl.kernel.checkpoint import load_checkpoint

    dev = cfg.device
    if cfg.get("world_model"):
        wm = load_checkpoint(ctx.path(cfg.world_model), map_location=dev).eval()
    else:
        wm = instantiate(cfg.worldmodel, _convert_="all").to(dev).eval()
        wm.set_norm_stats(torch.zeros(2, wm.state_dim), torch.zeros(2, wm.state_dim))  # untrained: same compute
    if cfg.get("critic_checkpoint"):
        critic = load_checkpoint(ctx.path(cfg.critic_checkpoint), map_location=dev).eval()
    else:
        critic = instantiate(cfg.critic_model, _convert_="all").to(dev).eval()
        if critic.use_proprio:
            critic.set_norm_stats(torch.zeros(2, critic.state_dim))
    B, H, D = int(cfg.batch_size), int(wm.chunk_size), int(wm.action_dim)
    report: dict = {"batch_size": B, "chunk_size": H, "cameras": list(wm.cameras), "image_size": list(wm.image_size),
                    "threads": torch.get_num_threads(), "trained_world_model": bool(cfg.get("world_model"))}

    # real frames from the simulator (also the sim benchmark), or random frames without it
    sim_sps = None
    if cfg.sim.enabled:
        suite = instantiate(cfg.sim.suite)
        sim_env = suite.make_env(int(cfg.sim.num_envs))
        task = suite.task_names[0]
        sim_starts = [suite.eval_start(task, j) for j in range(int(cfg.sim.num_envs))]
        first = sim_env.reset(sim_starts)
        chunks = random_chunks(int(cfg.sim.chunks), int(cfg.sim.num_envs), H, D, int(cfg.seed))
        sec, steps = timed_chunks(sim_env, sim_starts, chunks)
        sim_sps = steps / sec
        report["sim"] = {"num_envs": int(cfg.sim.num_envs), "control_steps": steps, "seconds": round(sec, 3),
                         "steps_per_s": sim_sps}
        ctx_obs = [first.index([j % first.batch_size]) for j in range(B)]
        starts = [Start(task_name=task, instruction=o.task[0], context=o) for o in ctx_obs]
    else:
        hi, wi = wm.image_size
        g = torch.Generator().manual_seed(int(cfg.seed))
        starts = []
        for _ in range(B):
            o = Obs({c: torch.randint(0, 256, (1, 3, hi, wi), dtype=torch.uint8, generator=g) for c in wm.cameras},
                    torch.zeros(1, wm.state_dim), ["bench"])
            starts.append(Start(task_name="bench", instruction="bench", context=o))

    env = ImaginationEnv(wm, critic, num_envs=B, max_chunks=10 ** 6, success_threshold=2.0, seed=int(cfg.seed))
    warm = random_chunks(int(cfg.warmup_chunks), B, H, D, int(cfg.seed) + 1)
    timed_chunks(env, starts, warm)
    chunks = random_chunks(int(cfg.chunks), B, H, D, int(cfg.seed) + 2)
    sec, steps = timed_chunks(env, starts, chunks)
    im_sps = steps / sec
    report["imagination"] = {"control_steps": steps, "seconds": round(sec, 3), "steps_per_s": im_sps,
                             "chunks_per_s": int(cfg.chunks) * B / sec}
    if sim_sps:
        report["speedup"] = im_sps / sim_sps
    print(f"{'':<14}{'steps/s':>10}")
    if sim_sps:
        print(f"{'SimEnv':<14}{sim_sps:>10.1f}   (B={cfg.sim.num_envs}, {len(wm.cameras)} cameras {wm.image_size})")
    print(f"{'Imagination':<14}{im_sps:>10.1f}   (B={B}, H={H}, threads={torch.get_num_threads()})")
    if sim_sps:
        print(f"speed-up: {im_sps / sim_sps:.1f}x")
    return report


@hydra.main(version_base="1.3", config_path="pkg://configs", config_name="bench_imagination")
def main(cfg: DictConfig) -> None:
    run_main(cfg, run, "bench imagination")


if __name__ == "__main__":
    main()
