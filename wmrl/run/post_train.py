"""``wmrl post-train``: GRPO post-training of a policy checkpoint in imagination (``env=imagination``)
or directly in the simulator (``env=sim``, the baseline), with periodic real-sim evaluation on
held-out init states, and resume from ``checkpoints/last``.

    wmrl post-train checkpoint=runs/bc/checkpoints/last env=imagination \
        env.world_model=runs/wm/checkpoints/last env.critic=runs/critic/checkpoints/last iterations=20
    wmrl post-train checkpoint=runs/bc/checkpoints/last env=sim          # the baseline

(The policy checkpoint key is ``checkpoint``: ``policy`` is the name of the policy config group.)

The job itself (what is built and how it is handed to ``wmrl.rl.loop.train_grpo``) is
:func:`wmrl.run.grpo_job.run`, shared with ``wmrl bench grpo``; the builders it uses are in
:mod:`wmrl.run.builders`.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from wmrl.run.common import run_main
from wmrl.run.grpo_job import run

__all__ = ["main", "run"]


@hydra.main(version_base="1.3", config_path="pkg://configs", config_name="post_train")
def main(cfg: DictConfig) -> None:
    run_main(cfg, run, "post-train")


if __name__ == "__main__":
    main()
