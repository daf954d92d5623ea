"""``wmrl bench sim``: control steps per second of one suite environment, with the suite's two
cameras rendered every step, with no camera, and with the robot's visual meshes instead of the
flat-coloured collision geoms (``render.flat_robot``).

    wmrl bench sim [suite=default] [task=lift_red] [steps=300]

Actions are the scripted expert's, so the arm moves and touches objects as in real use. The figure
is single-process, single-thread wall time (other processes on the machine lower it).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import hydra
from hydra.utils import instantiate
from omegaconf import DictConfig

from wmrl.run.common import RunContext, run_main

log = logging.getLogger("wmrl.bench_sim")


def measure(suite, task: str, cameras, render, steps: int, warmup: int) -> dict:
    from sim.env import TaskEnv
    from sim.expert import ScriptedExpert

    spec = suite.task(task)
    env = TaskEnv(spec.scene, cameras, suite.image_size, render)
    n, idx, t_total, t_render = 0, 0, 0.0, 0.0
    while n < steps + warmup:
        env.reset(spec, suite.init_state(task, "eval", idx % 50))
        expert = ScriptedExpert(spec, 0.0, idx)
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


def run(cfg: DictConfig, ctx: RunContext) -> dict:
    suite = instantiate(cfg.suite)
    results = {}
    for name in cfg.settings:
        render = dataclasses.asdict(suite.render)
        cams = suite.cameras
        if name == "no_cameras":
            cams = ()
        elif name == "two_cameras_visual_meshes":
            render["flat_robot"] = False
        elif name == "two_cameras_flat_robot":
            render["flat_robot"] = True
        elif name != "two_cameras":
            raise ValueError(f"unknown bench setting {name!r}; use two_cameras, no_cameras, "
                             "two_cameras_visual_meshes, two_cameras_flat_robot")
        r = measure(suite, str(cfg.task), cams, render, int(cfg.steps), int(cfg.warmup))
        results[name] = r
        print(f"{name:<24} {r['steps_per_s']:7.1f} control steps/s  (render {r['render_ms_per_step']:.1f} ms, "
              f"physics+control {r['physics_ms_per_step']:.1f} ms per step; cameras {r['cameras']} "
              f"{suite.image_size[0]}x{suite.image_size[1]})")
    from sim.render import gl_backend

    return {"task": str(cfg.task), "results": results, "gl_backend": gl_backend(),
            "mujoco_gl": os.environ.get("MUJOCO_GL"), "cpu_count": os.cpu_count(),
            "load_average": list(os.getloadavg()), "target_steps_per_s_two_cameras": 25}


@hydra.main(version_base="1.3", config_path="pkg://configs", config_name="bench_sim")
def main(cfg: DictConfig) -> None:
    run_main(cfg, run, "bench sim")


if __name__ == "__main__":
    main()
