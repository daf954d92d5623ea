"""``wmrl evaluate``: a policy checkpoint or the scripted expert on the sim suite.

    wmrl evaluate checkpoint=runs/bc/checkpoints/last suite=default episodes_per_task=50 batch_size=10
    wmrl evaluate checkpoint=expert noise=0.6 episodes_per_task=50
    wmrl evaluate checkpoint=runs/bc/checkpoints/last tasks=[lift_red] instruction="lift the green cube"
    wmrl evaluate suite=libero_object checkpoint=<policy> tasks=[0,1,2] suite.inits=[0,1,2,3] workers=2
        # the original LIBERO suites, through LIBERO env workers in .venv-libero (wmrl.run.libero_eval)

Writes ``report.json`` (per-task success rate with 95 % Wilson CI, mean episode length, overall),
``episodes.csv`` / ``episodes.json`` (task, episode, init_index, seed, success, length, reward) and
``videos/*.mp4`` into the run directory. (The key is ``checkpoint``, as in ``wmrl post-train``:
``policy=...`` would select the ``configs/policy`` group in Hydra.) See :func:`wmrl.evaluation.evaluate_policy`.
"""

from __future__ import annotations

import logging

import hydra
from hydra.utils import instantiate
from omegaconf import DictConfig

from wmrl.evaluation import evaluate_policy, format_report
from wmrl.run.builders import build_actor, build_suite
from wmrl.run.common import RunContext, run_main

log = logging.getLogger("wmrl.evaluate")


def run(cfg: DictConfig, ctx: RunContext) -> dict:
    from functools import partial

    from omegaconf import OmegaConf

    if cfg.suite.get("libero"):  # the original LIBERO suites: deployment to LIBERO env workers (wmrl.run.libero_eval)
        from wmrl.run.libero_eval import format_libero_report, run_libero

        report = run_libero(cfg, ctx)
        print(format_libero_report(report))
        return report
    suite = instantiate(cfg.suite)
    suite_cfg = OmegaConf.to_container(cfg.suite, resolve=True)
    ckpt = "expert" if str(cfg.checkpoint) == "expert" else str(ctx.path(cfg.checkpoint))
    if ckpt != "expert" and not ctx.path(ckpt).is_dir():
        raise ValueError(f"checkpoint={cfg.checkpoint!r}: no checkpoint folder at {ckpt}; give a checkpoint folder "
                         "(with config.yaml and model.safetensors) or checkpoint=expert")
    instruction = cfg.get("instruction") or None
    make_actor = partial(build_actor, ckpt, float(cfg.get("noise", 0.0)), suite_cfg, str(cfg.device), None, instruction)
    actor = make_actor()
    report = evaluate_policy(
        actor, suite, episodes_per_task=int(cfg.episodes_per_task), batch_size=int(cfg.batch_size),
        seed=int(cfg.seed), out_dir=ctx.out_dir, videos_per_task=int(cfg.videos_per_task),
        video_camera=str(cfg.video_camera), video_size=tuple(cfg.video_size),
        tasks=list(cfg.tasks) if cfg.get("tasks") else None,
        per_episode_sampling=bool(cfg.per_episode_sampling), device=str(cfg.device),
        workers=int(cfg.get("workers") or 1),
        make_actor=make_actor, make_suite=partial(build_suite, suite_cfg))
    report["policy"] = str(cfg.checkpoint)
    report["instruction_override"] = instruction
    if str(cfg.checkpoint) == "expert":
        report["noise"] = float(cfg.get("noise", 0.0))
    print(format_report(report))
    return report


@hydra.main(version_base="1.3", config_path="pkg://configs", config_name="evaluate")
def main(cfg: DictConfig) -> None:
    run_main(cfg, run, "evaluate")


if __name__ == "__main__":
    main()
