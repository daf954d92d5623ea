"""``wmrl train-worldmodel``: train the action-conditioned video world model on an EpisodeStore.

Example::

    wmrl train-worldmodel store=runs/collect/store hydra.run.dir=runs/wm
    wmrl train-worldmodel store=... worldmodel.block_out_channels=[64,128,128] train.max_minutes=30

Episodes ``i % heldout_every == heldout_every - 1`` are held out (quick PSNR checks and
real-vs-imagined videos in ``<run>/videos`` and TensorBoard ``<run>/tb``; at the end ``report.json``
``heldout_horizons``: PSNR gain and end-effector position error 1..``eval_horizon_chunks`` chunks
ahead). Resumes from
``<run>/checkpoints/last`` when ``resume=true``. The loop itself is ``worldmodels.train.train_world_model``.
"""

from __future__ import annotations

import logging

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from wmrl.run.common import RunContext, run_main
from wmrl.run.data import model_and_splits

log = logging.getLogger("wmrl")


def run(cfg: DictConfig, ctx: RunContext) -> dict:
    from worldmodels.train import train_world_model

    model_cfg, model, train, held, _ = model_and_splits(cfg.worldmodel, ctx, cfg)
    tc = cfg.train
    report = train_world_model(
        model, model_cfg, train, ctx.out_dir, heldout=held, steps=int(tc.steps), batch_size=int(tc.batch_size),
        lr=float(tc.lr), weight_decay=float(tc.weight_decay), warmup=int(tc.warmup), grad_clip=float(tc.grad_clip),
        max_minutes=tc.max_minutes, log_every=int(tc.log_every), eval_every=int(tc.eval_every),
        checkpoint_every=int(tc.checkpoint_every), video_chunks=int(tc.video_chunks), resume=bool(cfg.resume),
        tensorboard=bool(tc.tensorboard), progress=bool(cfg.progress), seed=int(cfg.seed),
        p_deterministic=float(tc.p_deterministic), p_pure_noise=float(tc.p_pure_noise), budget_clock=str(tc.budget_clock),
        lr_follows_budget=bool(tc.get("lr_follows_budget", True)),
        dynamics=OmegaConf.to_container(tc.dynamics) if tc.get("dynamics") is not None else None,
        grasp=OmegaConf.to_container(tc.grasp) if tc.get("grasp") is not None else None,
        frames=OmegaConf.to_container(tc.frames) if tc.get("frames") is not None else None)
    report.update(store=str(ctx.path(cfg.store)), train_episodes=train.num_episodes,
                  heldout_episodes=held.num_episodes)
    hc = int(cfg.get("eval_horizon_chunks") or 0)
    if hc > 0:
        report["heldout_horizons"] = heldout_horizons(report["checkpoint"], held, hc, cfg.get("position_dims"), int(cfg.seed))
    return report


def _frac(x) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def heldout_horizons(checkpoint, held, max_chunks: int, position_dims, seed: int) -> dict:
    """Fidelity of the trained model ``k = 1..max_chunks`` chunks ahead on the held-out episodes
    (``worldmodels.evaluate.horizon_metrics`` with the true actions): PSNR gain over copy-last-frame
    (dB) and the imagined end-effector position error (m) beside the copy baseline's."""
    from wmrl.kernel.checkpoint import load_checkpoint
    from worldmodels.evaluate import GRASP_LEAD_CHUNKS, closing_gap_error, grasp_outcome, horizon_metrics

    model = load_checkpoint(checkpoint, map_location="cpu").eval()
    if int(held.lengths.max()) <= model.chunk_size:
        return {"skipped": f"no held-out episode is longer than one chunk (H={model.chunk_size})"}
    hm = horizon_metrics(model, held, max_chunks=max_chunks, start_stride=model.chunk_size,
                         generator=torch.Generator().manual_seed(seed),
                         position_dims=position_dims)
    out = {"horizon": hm["horizon"], "psnr_gain_db": hm["psnr_gain"], "n": hm["n"],
           "proprio_mae": hm["proprio_mae"], "closing_gap": closing_gap_error(model, held)}
    cg = out["closing_gap"]
    if cg["n"]:
        log.info("held-out finger-gap error over the %d chunks that close the gripper: %.2f cm (copy: %.2f cm)", cg["n"],
                 100 * cg["mae_m"], 100 * cg["mae_copy_m"])
    go = out["grasp_outcome"] = grasp_outcome(model, held)
    if go["n"]:
        log.info("held-out grasps imagined 4 chunks from the close: %s of %d misses and %s of %d holds called right",
                 _frac(go["miss_called"]), go["misses"], _frac(go["hold_called"]), go["n"] - go["misses"])
    gl = out["grasp_outcome_lead"] = grasp_outcome(model, held, lead_chunks=GRASP_LEAD_CHUNKS)
    if gl["n"]:
        log.info("held-out grasps imagined from %d chunks before the close (as in a rollout): %s of %d misses and %s of "
                 "%d holds called right; %s of the imagined holds are real", GRASP_LEAD_CHUNKS,
                 _frac(gl["miss_called"]), gl["misses"], _frac(gl["hold_called"]), gl["n"] - gl["misses"],
                 _frac(gl["hold_precision"]))
    if "halt_uncertainty_tau" in hm:
        out.update(uncertainty_mean_m=hm["uncertainty_mean"], uncertainty_q99_m=hm["uncertainty_q99"],
                   halt_uncertainty_tau_m=hm["halt_uncertainty_tau"])
        log.info("held-out ensemble disagreement 1..%d chunks ahead (mm, mean): %s; calibrated halt threshold "
                 "(p99) %.2f mm", len(hm["horizon"]), " ".join(f"{1000 * u:.1f}" for u in hm["uncertainty_mean"]),
                 1000 * hm["halt_uncertainty_tau"])
    if "position_error" in hm:
        out.update(position_error_m=hm["position_error"], position_error_copy_m=hm["position_error_copy"])
        log.info("held-out end-effector position error (cm) 1..%d chunks ahead: %s (copy: %s)", len(hm["horizon"]),
                 " ".join(f"{100 * e:.1f}" for e in hm["position_error"]),
                 " ".join(f"{100 * e:.1f}" for e in hm["position_error_copy"]))
    return out


@hydra.main(version_base="1.3", config_path="pkg://configs", config_name="train_worldmodel")
def main(cfg: DictConfig) -> None:
    run_main(cfg, run, "train-worldmodel")


if __name__ == "__main__":
    main()
