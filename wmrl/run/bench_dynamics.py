"""``wmrl bench dynamics``: how well the arm can be predicted from proprio and actions alone.

    wmrl bench dynamics suite=ee [episodes_per_task=40] [noise=0.6] [train.steps=3000]
    wmrl bench dynamics suite=default          # the OSC_POSE delta space, for comparison

Collects scripted-expert episodes of the suite without rendering, holds out every
``holdout_every``-th episode of each task, trains ``worldmodels.dynamics.ProprioDynamics`` (the
ensemble proprio head, no frames) with the one trainer, and reports on the held-out episodes, per
horizon of 1..``max_chunks`` chunks from every chunk boundary: the end-effector error at the
horizon's last step (cm; mean, p90, count) of the ensemble mean, beside two baselines: *copy* (the
arm stays where it was), *commanded* (the arm is at the commanded target, the commands
integrated from the start without looking at the real arm) and *linear* (a second-order linear arm
fitted by least squares, :func:`linear_baseline`). Also the members' disagreement (cm).

Figures go to the log, ``report.json`` and ``paths.png`` (imagined vs real end-effector paths of a
few held-out episodes). The issue's gate 2: one-chunk error < 1.0 cm and 8-chunk drift < 1.5 cm.
"""

from __future__ import annotations

import logging

import hydra
import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from wmrl.kernel.trainer import TrainConfig, Trainer, TrainTask
from wmrl.run.common import RunContext, run_main

log = logging.getLogger("wmrl.bench_dynamics")


class _DynamicsTask(TrainTask):
    name = "dynamics"

    def __init__(self, model, episodes: list, window: int, batch_size: int, bootstrap: float, seed: int):
        self.module = model
        self.eps = [(torch.from_numpy(e.proprio), torch.from_numpy(e.actions)) for e in episodes
                    if len(e.actions) >= window + 2]
        if not self.eps:
            raise ValueError(f"no training episode is longer than the window of {window + 2} steps")
        self.window, self.batch_size, self.bootstrap = int(window), int(batch_size), float(bootstrap)
        self.gen = torch.Generator().manual_seed(int(seed))

    def streams(self) -> dict:
        return {"batches": self.gen}

    def batches(self, start: int, stop: int):
        for _ in range(start, stop):
            idx = torch.randint(len(self.eps), (self.batch_size,), generator=self.gen)
            ps, acts = [], []
            for i in idx.tolist():
                p, a = self.eps[i]
                t = int(torch.randint(1, len(a) - self.window, (1,), generator=self.gen))
                ps.append(p[t - 1:t + self.window + 1])
                acts.append(a[t:t + self.window])
            mask = (torch.rand(self.module.k, self.batch_size, generator=self.gen) < self.bootstrap).float()
            yield {"proprio": torch.stack(ps), "actions": torch.stack(acts), "mask": mask}

    def loss(self, batch):
        return self.module.loss(batch)


@torch.no_grad()
def horizon_errors(model, episodes: list, chunk: int, max_chunks: int) -> dict:
    """Per horizon ``h`` (1..max_chunks chunks): end-effector errors (cm) at the horizon's end of the
    model (ensemble mean), the copy and the commanded baselines, and the members' disagreement."""
    out = {h: {"model": [], "copy": [], "commanded": [], "disagreement": []} for h in range(1, max_chunks + 1)}
    for e in episodes:
        p, a = torch.from_numpy(e.proprio), torch.from_numpy(e.actions)
        starts = list(range(1, len(a) - chunk, chunk))
        if not starts:
            continue
        steps = chunk * max_chunks
        for t in starts:
            n = min(steps, len(a) - t)
            pred = model.rollout(p[t:t + 1], a[t:t + n].unsqueeze(0), p[t - 1:t + 0])  # (K, 1, n, 9)
            mean, dis = pred.mean(0)[0, :, :3], model.disagreement(pred)[0]
            cmd, pos = [], p[t, :3]
            for k in range(n):
                pos = model.commanded(pos, a[t + k])
                cmd.append(pos)
            cmd = torch.stack(cmd)
            for h in range(1, max_chunks + 1):
                k = h * chunk - 1
                if k >= n or t + k + 1 >= len(p):
                    break
                real = p[t + k + 1, :3]
                out[h]["model"].append(float((mean[k] - real).norm()) * 100)
                out[h]["copy"].append(float((p[t, :3] - real).norm()) * 100)
                out[h]["commanded"].append(float((cmd[k] - real).norm()) * 100)
                out[h]["disagreement"].append(float(dis[k]) * 100)
    return {h: {name: {"mean_cm": float(np.mean(v)) if v else None, "p90_cm": float(np.percentile(v, 90)) if v else None,
                       "count": len(v)} for name, v in d.items()} for h, d in out.items()}


@torch.no_grad()
def linear_baseline(model, train: list, held: list, chunk: int, max_chunks: int) -> dict:
    """A second-order linear arm, fitted by least squares on the train episodes' single steps:
    ``p_{k+1} - p_k = A (tgt_k - p_k) + B (p_k - p_{k-1}) + c`` with ``tgt_k`` the model's commanded
    target (box and workspace clip), rolled out from every chunk boundary of ``held``. Returns
    ``{h: {"mean_cm", "p90_cm", "count"}}``: what the ensemble must beat (its MLP models the rest)."""
    def feats(p, pp, a):
        return torch.cat([model.commanded(p[..., :3], a) - p[..., :3], p[..., :3] - pp[..., :3],
                          torch.ones_like(p[..., :1])], -1).double()

    xs, ys = [], []
    for e in train:
        p, a = torch.from_numpy(e.proprio), torch.from_numpy(e.actions)
        xs.append(feats(p[1:-1], p[:-2], a[1:len(p) - 1]))
        ys.append((p[2:, :3] - p[1:-1, :3]).double())
    w = torch.linalg.lstsq(torch.cat(xs), torch.cat(ys)).solution   # (7, 3)
    out = {h: [] for h in range(1, max_chunks + 1)}
    for e in held:
        p, a = torch.from_numpy(e.proprio).double(), torch.from_numpy(e.actions).double()
        for t in range(1, len(a) - chunk, chunk):
            cur, prev = p[t].clone(), p[t - 1].clone()
            for k in range(min(chunk * max_chunks, len(a) - t)):
                nxt = cur.clone()
                nxt[:3] = cur[:3] + feats(cur.float(), prev.float(), a[t + k].float()) @ w
                prev, cur = cur, nxt
                if (k + 1) % chunk == 0 and t + k + 1 < len(p):
                    out[(k + 1) // chunk].append(float((cur[:3] - p[t + k + 1, :3]).norm()) * 100)
    return {h: {"mean_cm": float(np.mean(v)) if v else None, "p90_cm": float(np.percentile(v, 90)) if v else None,
                "count": len(v)} for h, v in out.items()}


def _plot_paths(model, episodes: list, chunk: int, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(episodes), figsize=(4 * len(episodes), 3.5), squeeze=False)
    for ax, e in zip(axes[0], episodes):
        p, a = torch.from_numpy(e.proprio), torch.from_numpy(e.actions)
        with torch.no_grad():
            pred = model.rollout(p[1:2], a[1:].unsqueeze(0), p[0:1]).mean(0)[0].numpy()
        t = np.arange(1, len(p))
        for d, c in zip(range(3), "rgb"):
            ax.plot(t, p[1:, d].numpy() * 100, c, lw=1.5, label=f"real {'xyz'[d]}")
            ax.plot(t[:len(pred)], pred[:len(t), d] * 100, c + "--", lw=1, label=f"imagined {'xyz'[d]}")
        ax.set_title(f"{e.task_name} ({'success' if e.success else 'failure'}), whole episode, one rollout")
        ax.set_xlabel(f"control step (chunk = {chunk})")
        ax.set_ylabel("end effector (cm, base frame)")
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def run(cfg: DictConfig, ctx: RunContext) -> dict:
    from sim.collect import collect_episodes
    from worldmodels.dynamics import ProprioDynamics

    suite = instantiate(cfg.suite, cameras=[])
    eps = list(collect_episodes(suite, int(cfg.episodes_per_task), noise=float(cfg.noise), seed=int(cfg.seed)))
    every = int(cfg.holdout_every)
    held = [e for i, e in enumerate(eps) if i % every == every - 1]
    train = [e for i, e in enumerate(eps) if i % every != every - 1]
    expert_success = float(np.mean([e.success for e in eps]))
    log.info("%d train / %d held-out episodes of %s (%s), expert success %.2f", len(train), len(held), suite.name,
             suite.control.kind, expert_success)
    torch.manual_seed(int(cfg.seed))
    model = ProprioDynamics(suite.action_space, **cfg.model)
    task = _DynamicsTask(model, train, int(cfg.chunk) * int(cfg.unroll_chunks), int(cfg.batch_size),
                         float(cfg.bootstrap), int(cfg.seed))
    tc = TrainConfig(**cfg.train, desc="dynamics")
    Trainer(task, tc, ctx.out_dir / "train").run()
    model.eval()
    table = horizon_errors(model, held, int(cfg.chunk), int(cfg.max_chunks))
    linear = linear_baseline(model, train, held, int(cfg.chunk), int(cfg.max_chunks))
    for h, d in table.items():
        d["linear"] = linear[h]
    log.info("held-out end-effector error (cm, mean / p90) at the end of h chunks:")
    log.info("  h   model         linear        commanded     copy          disagreement   n")
    for h, d in table.items():
        if d["model"]["count"]:
            lin = d["linear"]
            log.info("  %-3d %5.2f / %5.2f  %5.2f / %5.2f  %5.2f / %5.2f  %5.2f / %5.2f  %5.2f          %d", h,
                     d["model"]["mean_cm"], d["model"]["p90_cm"], lin["mean_cm"] or float("nan"),
                     lin["p90_cm"] or float("nan"), d["commanded"]["mean_cm"], d["commanded"]["p90_cm"],
                     d["copy"]["mean_cm"], d["copy"]["p90_cm"], d["disagreement"]["mean_cm"], d["model"]["count"])
    _plot_paths(model, held[:3], int(cfg.chunk), ctx.out_dir / "paths.png")
    gate = {"one_chunk_cm": table[1]["model"]["mean_cm"], "eight_chunk_cm": table.get(8, {}).get("model", {}).get("mean_cm")}
    gate["passes"] = bool(gate["one_chunk_cm"] is not None and gate["one_chunk_cm"] < 1.0
                          and gate["eight_chunk_cm"] is not None and gate["eight_chunk_cm"] < 1.5)
    log.info("gate 2 (one chunk < 1.0 cm, 8 chunks < 1.5 cm): %.2f / %s cm -> %s", gate["one_chunk_cm"],
             f"{gate['eight_chunk_cm']:.2f}" if gate["eight_chunk_cm"] is not None else "n/a",
             "passes" if gate["passes"] else "fails")
    return {"suite": suite.name, "control": suite.control.kind, "episodes": {"train": len(train), "held_out": len(held)},
            "expert_success": expert_success, "horizons": table, "gate2": gate,
            "plot": "paths.png"}


@hydra.main(version_base="1.3", config_path="pkg://configs", config_name="bench_dynamics")
def main(cfg: DictConfig) -> None:
    run_main(cfg, run, "bench dynamics")


if __name__ == "__main__":
    main()
