"""``wmrl train-critic``: train the progress-value critic on an EpisodeStore.

Example::

    wmrl train-critic store=runs/collect/store hydra.run.dir=runs/critic

Successful episodes give progress ``t / (T-1)`` and success labels on their last
``train.success_tail`` steps; failed episodes give low progress and no success. Held-out episodes
(``i % heldout_every == heldout_every - 1``) give the AUROC in the report. With
``imagined.world_model`` set, a fraction of every batch are world-model frames of the training
episodes (``worldmodels.train.imagined_frame_bank``) with the labels of the real frames they stand
for, so the critic scores imagined rollouts as it scores real ones. Resumable
(``resume=true``). The loop itself is ``worldmodels.train.train_critic``.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from wmrl.run.common import RunContext, run_main
from wmrl.run.data import model_and_splits


def run(cfg: DictConfig, ctx: RunContext) -> dict:
    from worldmodels.train import train_critic

    critic_cfg, critic, train, held, _ = model_and_splits(cfg.critic, ctx, cfg)
    tc = cfg.train
    bank, im = None, cfg.get("imagined") or {}
    if im.get("world_model") and float(im.get("fraction", 0.0)) > 0:
        import numpy as np

        from wmrl.kernel.checkpoint import load_checkpoint
        from worldmodels.train import imagined_frame_bank

        wm = load_checkpoint(ctx.path(im.world_model), map_location=str(cfg.device)).eval()
        bank = imagined_frame_bank(wm, train, int(im.bank_size), int(im.max_chunks),
                                   np.random.default_rng([int(cfg.seed), 7]), progress=bool(cfg.progress))
        del wm
    report = train_critic(
        critic, critic_cfg, train, ctx.out_dir, heldout=held, steps=int(tc.steps), batch_size=int(tc.batch_size),
        lr=float(tc.lr), weight_decay=float(tc.weight_decay), warmup=int(tc.warmup),
        success_tail=int(tc.success_tail), fail_progress=float(tc.fail_progress), max_minutes=tc.max_minutes,
        log_every=int(tc.log_every), eval_every=int(tc.eval_every), checkpoint_every=int(tc.checkpoint_every),
        resume=bool(cfg.resume), tensorboard=bool(tc.tensorboard), progress=bool(cfg.progress),
        seed=int(cfg.seed), augment=bool(tc.augment), budget_clock=str(tc.budget_clock),
        lr_follows_budget=bool(tc.get("lr_follows_budget", True)),
        imagined=bank, imagined_fraction=float(im.get("fraction", 0.0)) if bank is not None else 0.0)
    report.update(imagined_bank=0 if bank is None else int(len(bank[2])))
    report.update(store=str(ctx.path(cfg.store)), train_episodes=train.num_episodes,
                  heldout_episodes=held.num_episodes, train_success_rate=float(train.success.mean()))
    return report


@hydra.main(version_base="1.3", config_path="pkg://configs", config_name="train_critic")
def main(cfg: DictConfig) -> None:
    run_main(cfg, run, "train-critic")


if __name__ == "__main__":
    main()
