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

import hydra
from hydra.utils import instantiate
from omegaconf import DictConfig

from wmrl.run.common import RunContext, run_main
from wmrl.run.measure import sim_rates

log = logging.getLogger("wmrl.bench_sim")


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
        r = sim_rates(suite, str(cfg.task), cams, render, int(cfg.steps), int(cfg.warmup))
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
