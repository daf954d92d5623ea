"""``wmrl refine``: fine-tune the world model (and the critic) on failures recorded by the robot
bridge, and report the fidelity change on those failures and on the held-out set.

    wmrl refine worldmodel_checkpoint=runs/wm/checkpoints/last store=runs/collect/store \\
        failures_store=runs/deploy/episodes [critic_checkpoint=runs/critic/checkpoints/last]

* failures: episodes of ``failures_store`` (an EpisodeStore written by ``wmrl robot``) that did not
  succeed (optionally only those whose ``info.failure_label`` is in ``failure_labels``);
* held-out set: the episodes of ``store`` (the world model's training store) that
  ``wmrl train-worldmodel`` held out (``i % heldout_every == heldout_every - 1``);
* fine-tuning data: the failures plus ``replay_episodes`` episodes of the store's training split
  (replay against forgetting), trained with ``worldmodels.train.train_world_model`` (and
  ``train_critic``) from the given checkpoint's weights;
* error: mean over horizons ``1..eval_chunks`` of the autoregressive per-pixel MSE
  (``worldmodels.evaluate.horizon_metrics``, images in [0, 1], fixed sampling seed), before and
  after. Reported: relative change on the failures (goal: at most -20 %) and on the held-out set
  (goal: at most +5 %); with ``failure_holdout_every > 0`` some failures are kept out of the
  fine-tuning and reported separately.
"""

from __future__ import annotations

import logging

import hydra
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from wmrl.run.common import RunContext, run_main

log = logging.getLogger("wmrl.refine")


def world_model_error(model, data, eval_chunks: int, start_stride: int, seed: int) -> float:
    """Mean over horizons of the per-pixel MSE (images in [0, 1]) of autoregressive rollouts."""
    from worldmodels.evaluate import horizon_metrics

    m = horizon_metrics(model, data, max_chunks=eval_chunks, start_stride=start_stride,
                        generator=torch.Generator().manual_seed(seed))
    mse = [10 ** (-p / 10) for p in m["psnr"]]
    return float(np.mean(mse))


def _model_config(folder) -> dict:
    cfg = OmegaConf.to_container(OmegaConf.load(folder / "config.yaml"), resolve=True)
    cfg.pop("_target_", None)
    return cfg


def _failed_episodes(fstore, cfg: DictConfig) -> list[int]:
    """Indices of the failed episodes of ``fstore`` (with ``cfg.failure_labels``: only those whose
    ``info["failure_label"]``, or its part before ``:``, is one of them). Raises ``ValueError`` if none."""
    labels = set(cfg.failure_labels) if cfg.get("failure_labels") else None
    fail_idx = []
    for i in range(len(fstore)):
        if bool(fstore.successes[i]):
            continue
        if labels is not None:
            lab = fstore.episode(i, images=False).info.get("failure_label", "")
            if lab not in labels and lab.split(":")[0] not in labels:
                continue
        fail_idx.append(i)
    if not fail_idx:
        raise ValueError(f"{cfg.failures_store} holds no failed episode"
                         f"{' with labels ' + str(sorted(labels)) if labels else ''}; nothing to refine on")
    return fail_idx


def _refine_critic(cfg: DictConfig, ctx: RunContext, mixed, eval_set) -> dict:
    """Fine-tune ``cfg.critic_checkpoint`` on ``mixed``; its AUROC on ``eval_set`` before and after."""
    from wmrl.kernel.checkpoint import load_checkpoint
    from worldmodels.evaluate import critic_auroc
    from worldmodels.train import train_critic

    c_dir = ctx.path(cfg.critic_checkpoint)
    critic = load_checkpoint(c_dir)
    critic.eval()
    c_before = critic_auroc(critic, eval_set)
    cc, tc = cfg.critic_train, cfg.train
    c_report = train_critic(critic, _model_config(c_dir), mixed, ctx.out_dir / "critic", steps=int(cc.steps),
                            batch_size=int(cc.batch_size), lr=float(cc.lr), max_minutes=cc.max_minutes,
                            checkpoint_every=int(cc.steps), eval_every=int(cc.steps), resume=bool(cfg.resume),
                            tensorboard=bool(tc.tensorboard), progress=bool(cfg.progress), seed=int(cfg.seed))
    critic.eval()
    return {"before": c_before, "after": critic_auroc(critic, eval_set), "train": c_report}


def run(cfg: DictConfig, ctx: RunContext) -> dict:
    from wmrl.kernel.checkpoint import load_checkpoint
    from wmrl.kernel.storage import EpisodeStore
    from worldmodels.data import EpisodeFrames, heldout_episodes
    from worldmodels.train import train_world_model

    wm_dir = ctx.path(cfg.worldmodel_checkpoint)
    if not (wm_dir / "config.yaml").is_file():
        raise ValueError(f"worldmodel_checkpoint={cfg.worldmodel_checkpoint!r}: no checkpoint folder at {wm_dir}")
    model = load_checkpoint(wm_dir)
    model.eval()
    cams = list(model.cameras)

    fstore = EpisodeStore.open(ctx.path(cfg.failures_store), mode="r")
    fail_idx = _failed_episodes(fstore, cfg)
    missing = [c for c in cams if c not in fstore.cameras]
    if missing:
        raise ValueError(f"the world model needs cameras {missing}; {cfg.failures_store} has {list(fstore.cameras)}")
    fh = int(cfg.get("failure_holdout_every", 0) or 0)
    if fh > 0 and len(fail_idx) >= fh:
        f_tr_i, f_ho_i = heldout_episodes(len(fail_idx), fh)
        f_train = [fail_idx[i] for i in f_tr_i]
        f_test = [fail_idx[i] for i in f_ho_i]
    else:
        f_train, f_test = fail_idx, []
    failures = EpisodeFrames.from_store(fstore, f_train, cams)
    fail_test = EpisodeFrames.from_store(fstore, f_test, cams) if f_test else None

    bstore = EpisodeStore.open(ctx.path(cfg.store), mode="r")
    tr, ho = heldout_episodes(len(bstore), int(cfg.heldout_every))
    held = EpisodeFrames.from_store(bstore, ho, cams)
    rng = np.random.default_rng(int(cfg.seed))
    replay = sorted(rng.choice(tr, size=min(len(tr), int(cfg.replay_episodes)), replace=False).tolist()) if tr else []
    mixed = EpisodeFrames([fstore.episode(i, cams) for i in f_train] + [bstore.episode(i, cams) for i in replay],
                          cameras=cams)
    if failures.image_size != held.image_size:
        raise ValueError(f"failure images are {failures.image_size}, the store's are {held.image_size}")

    ev = dict(eval_chunks=int(cfg.eval_chunks), start_stride=int(cfg.eval_stride), seed=int(cfg.seed))
    before = {"failures": world_model_error(model, failures, **ev), "heldout": world_model_error(model, held, **ev)}
    if fail_test is not None:
        before["failures_heldout"] = world_model_error(model, fail_test, **ev)
    log.info("before: %s", before)

    tc = cfg.train
    wm_report = train_world_model(
        model, _model_config(wm_dir), mixed, ctx.out_dir / "worldmodel", steps=int(tc.steps),
        batch_size=int(tc.batch_size), lr=float(tc.lr), warmup=int(tc.warmup), max_minutes=tc.max_minutes,
        checkpoint_every=int(tc.steps), eval_every=int(tc.steps), resume=bool(cfg.resume), tensorboard=bool(tc.tensorboard),
        progress=bool(cfg.progress), seed=int(cfg.seed))
    model.eval()
    after = {"failures": world_model_error(model, failures, **ev), "heldout": world_model_error(model, held, **ev)}
    if fail_test is not None:
        after["failures_heldout"] = world_model_error(model, fail_test, **ev)
    change = {k: (after[k] - before[k]) / before[k] for k in before}
    report = {
        "failure_episodes": f_train, "failure_heldout_episodes": f_test, "replay_episodes": replay,
        "heldout_episodes": ho, "error_before": before, "error_after": after, "relative_change": change,
        "goal_failures_drop_20pct": change["failures"] <= -0.20, "goal_heldout_rise_le_5pct": change["heldout"] <= 0.05,
        "error_definition": "mean over horizons 1..eval_chunks of per-pixel MSE of autoregressive rollouts, images in [0,1]",
        "worldmodel": wm_report,
    }
    if cfg.get("critic_checkpoint"):
        eval_set = EpisodeFrames([fstore.episode(i, cams) for i in fail_idx] + [bstore.episode(i, cams) for i in ho],
                                 cameras=cams)
        report["critic"] = _refine_critic(cfg, ctx, mixed, eval_set)
    print(f"world-model error on recorded failures: {before['failures']:.5f} -> {after['failures']:.5f} "
          f"({100 * change['failures']:+.1f} %)")
    print(f"world-model error on the held-out set:  {before['heldout']:.5f} -> {after['heldout']:.5f} "
          f"({100 * change['heldout']:+.1f} %)")
    if "failures_heldout" in change:
        print(f"... on held-out failures: {100 * change['failures_heldout']:+.1f} %")
    return report


@hydra.main(version_base="1.3", config_path="pkg://configs", config_name="refine")
def main(cfg: DictConfig) -> None:
    run_main(cfg, run, "refine")


if __name__ == "__main__":
    main()
