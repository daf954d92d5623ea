"""A toy run of the one trainer, launched by tests/test_distributed.py under torchrun (and in process).

    python -m torch.distributed.run --nproc-per-node 2 tests/ddp_worker.py OUT STEPS CKPT_EVERY KILL_AT

A linear model on batches of 16 rows drawn from the task's generator; the loss is a plain mean, so the
data-parallel gradient must equal the one-process gradient of the whole batch. Each rank writes
``OUT/rank<r>.pt``: the final parameters, the gradient of step 1, the noise it drew inside the loss at
step 1 and its generator state after step 1. ``KILL_AT > 0``: rank 1 SIGKILLs itself after that step.
"""

from __future__ import annotations

import os
import signal
import sys

import torch

from wmrl.kernel.trainer import TrainConfig, Trainer, TrainTask

BATCH = 16


class ToyNet(torch.nn.Module):
    def __init__(self, d_in: int = 6, hidden: int = 8):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(d_in, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 2))

    def forward(self, x):
        return self.net(x)


class ToyTask(TrainTask):
    name = "toy"

    def __init__(self, kill_at: int = 0):
        torch.manual_seed(0)
        self.module = ToyNet()
        self.gen = torch.Generator().manual_seed(1)
        self.kill_at, self.step = kill_at, 0
        self.record: dict = {}

    def batch(self):
        x = torch.randn(BATCH, 6, generator=self.gen)
        return {"x": x, "y": torch.sin(x[:, :2] * 3), "texts": [f"row {i}" for i in range(BATCH)]}

    def batches(self, start, stop):
        return (self.batch() for _ in range(start, stop))

    def loss(self, batch):
        assert len(batch["texts"]) == batch["x"].shape[0]
        noise = torch.randn(3, generator=self.gen)          # drawn inside the loss, not used by it
        if self.step == 0:
            self.record["noise"] = noise
        return torch.nn.functional.mse_loss(self.module(batch["x"]), batch["y"]), {}

    def after_step(self):
        self.step += 1
        if self.step == 1:
            self.record["grad"] = [p.grad.clone() for p in self.module.parameters()]
            self.record["gen_state"] = self.gen.get_state()
        if self.kill_at and self.step == self.kill_at and int(os.environ.get("RANK", "0")) == 1:
            os.kill(os.getpid(), signal.SIGKILL)

    def streams(self):
        return {"toy": self.gen}

    def load_meta(self, meta):
        self.step = int(meta["step"])

    def checkpoint_config(self):
        return {"_target_": "ddp_worker.ToyNet", "d_in": 6, "hidden": 8}


def main(out: str, steps: int, ckpt_every: int, kill_at: int) -> None:
    task = ToyTask(kill_at)
    cfg = TrainConfig(steps=steps, lr=1e-2, warmup=2, ckpt_every=ckpt_every, log_every=2, progress=False,
                      tensorboard=kill_at == 0 and "resumed" not in out)
    tr = Trainer(task, cfg, out).run()
    tr.finish({"steps": tr.step})
    rank = int(os.environ.get("RANK", "0"))
    torch.save({"params": [p.detach().clone() for p in task.module.parameters()], "world": tr.dp.world if tr.dp else 1,
                "start_step": tr.start_step, **task.record}, os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
