"""The one supervised trainer of wmrl: BC policy, world model, critic and the refresher's fine-tunes.

A model learns through a :class:`TrainTask` (a small object around it): ``batches(start, stop)``
yields the batches of steps ``start..stop-1``, ``loss(batch) -> (loss, metrics)`` gives the scalar
loss to back-propagate and a dict of floats / 0-d tensors; optional hooks add evaluation, EMA,
extra checkpoint tensors and RNG streams. :class:`Trainer` owns everything else: AdamW, the
warm-up + cosine schedule (:func:`lr_at`), the step / time budget (:class:`BudgetClock`),
TensorBoard scalars (``out_dir/tb``), the tqdm bar, checkpoints (``out_dir/checkpoints/<tag>`` and
``.../last`` via :func:`wmrl.kernel.checkpoint.save_checkpoint`; optimizer state through the one codec
:func:`wmrl.kernel.checkpoint.optimizer_to_tensors`, keys ``opt/<param index>/<key>``) and exact
resume (optimizer, the task's generators and the process-wide RNGs, :mod:`wmrl.kernel.rng`).

One step, in this order: LR set for every group, ``loss`` (inside ``TrainConfig.precision``'s
autocast when given), optional finite check, ``zero_grad``, ``backward``, gradient clipping (when
``grad_clip > 0``), ``opt.step()``, ``task.after_step()`` (e.g. EMA), logging, budget check,
``task.evaluate``, periodic checkpoint. Batches are drawn from the task's iterator before the LR is
set (the LR draws no random numbers).

Under ``torchrun`` (``WORLD_SIZE > 1``) the same run is data-parallel (:mod:`wmrl.kernel.distributed`):
every rank draws the same global batch and keeps its rows (``task.shard``), the loss's own random
numbers are drawn per rank, gradients are averaged in one all-reduce after ``backward``, and rank 0
alone writes checkpoints, TensorBoard and the bar; every rank resumes from rank 0's ``last``. The
configured batch is the effective batch and the LR is unchanged, whatever the number of ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("wmrl.trainer")


def lr_at(step: int, total: int, lr: float, warmup: int, min_ratio: float = 0.1, time_frac: float = 0.0) -> float:
    """Learning rate of ``step`` (0-based): linear warm-up ``lr * (step + 1) / warmup`` for ``warmup``
    steps, then cosine decay from ``lr`` to ``min_ratio * lr`` at ``total`` steps or at the end of the time
    budget (``time_frac``: fraction of it used), whichever comes first. The one schedule of every trainer
    (it reproduces, bit for bit, the BC and the world-model schedules it replaced)."""
    if step < warmup:
        return lr * (step + 1) / max(1, warmup)
    frac = min(1.0, max((step - warmup) / max(1, total - warmup), time_frac))
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


class BudgetClock:
    """Elapsed training time for a time budget, summed over resumed runs.

    ``"wall"``: wall-clock seconds. ``"process"``: this process's CPU seconds divided by the torch
    thread count, i.e. the wall time the same work takes on an otherwise idle machine (use it when
    other jobs share the CPU; spin-waiting under contention still counts, so it is conservative).
    ``before``: :meth:`state` of the run this one resumes.

    Raises:
        ValueError: ``kind`` is neither ``"wall"`` nor ``"process"``.
    """

    def __init__(self, kind: str = "wall", before: dict | None = None):
        if kind not in ("wall", "process"):
            raise ValueError(f"budget_clock must be 'wall' or 'process', got {kind!r}")
        self.kind = kind
        self.w0, self.p0 = time.time(), time.process_time()
        before = before or {}
        self.wall_before, self.process_before = float(before.get("wall_s", 0.0)), float(before.get("process_s", 0.0))
        self.elapsed_before = float(before.get("elapsed_s", 0.0))

    def wall(self) -> float:
        return self.wall_before + time.time() - self.w0

    def process(self) -> float:
        return self.process_before + (time.process_time() - self.p0) / max(1, torch.get_num_threads())

    def elapsed(self) -> float:
        return self.wall() if self.kind == "wall" else self.process()

    def state(self) -> dict:
        """Elapsed seconds so far (this run plus ``before``), to carry over a resume."""
        return {"wall_s": self.wall(), "process_s": self.process(), "elapsed_s": self.elapsed()}


@dataclasses.dataclass
class TrainConfig:
    """Settings of one :class:`Trainer` run.

    ``budget_s``: time budget in seconds (``None``: none); the run stops after the step at which
    :class:`BudgetClock` passes it (a checkpoint is still written). ``lr_follows_budget``: the cosine
    decays over the budget when it ends before ``steps`` (``False``: over the steps only, so the run
    does not depend on the machine's speed). ``precision``: a :class:`wmrl.kernel.precision.Precision`
    whose autocast wraps ``task.loss`` (``None``: the task handles precision itself).
    ``check_finite``: raise ``FloatingPointError`` on a non-finite loss. ``eval_every``: 0 = no
    periodic ``task.evaluate``.
    """

    # optimizer and schedule (lr_at)
    steps: int
    lr: float
    weight_decay: float = 1e-4
    warmup: int = 50
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0                     # 0: no clipping
    # what happens every so many steps
    log_every: int = 25
    eval_every: int = 0
    ckpt_every: int = 0
    # time budget (BudgetClock)
    budget_s: float | None = None
    budget_clock: str = "wall"
    lr_follows_budget: bool = True
    # run
    resume: bool = True
    tensorboard: bool = True
    progress: bool = True
    seed: int = 0                              # re-seeds the task's torch generators after an RNG-less checkpoint
    desc: str = "train"
    check_finite: bool = False
    precision: Any = None


class TrainTask:
    """The model side of a :class:`Trainer` run; subclasses override what they need.

    ``module`` is the trained ``nn.Module``; ``name`` names it in messages."""

    name = "model"
    module: torch.nn.Module

    def params(self) -> list[torch.nn.Parameter]:
        """The parameters AdamW updates and gradient clipping sees (default: all)."""
        return list(self.module.parameters())

    def fresh_start(self) -> None:
        """Called when the run starts without a checkpoint (e.g. to fit normalisation statistics)."""

    def batches(self, start: int, stop: int) -> Iterable:
        """The batches of steps ``start..stop-1``, in order."""
        raise NotImplementedError

    def loss(self, batch) -> tuple[torch.Tensor, dict]:
        """``(scalar loss to back-propagate, metrics)``; ``metrics["loss"]`` (float), when present,
        is what the recent-loss average records (else ``float(loss)``)."""
        raise NotImplementedError

    def after_step(self) -> None:
        """Called after every optimizer step (e.g. an EMA update)."""

    def scalars(self, metrics: dict, info: dict) -> dict[str, float]:
        """TensorBoard scalars of a logging step; ``info``: ``avg`` (recent loss mean), ``lr``,
        ``grad_norm``, ``steps_this_run``, ``seconds`` (of this run)."""
        return {"train/loss": info["avg"], "train/lr": info["lr"]}

    def evaluate(self, step: int, writer) -> None:
        """Periodic evaluation (every ``eval_every`` steps, at the last step and when the budget ends)."""

    def tag(self, step: int) -> str:
        return f"step_{step:06d}"

    def shard(self, batch, rank: int, world: int):
        """This rank's part of a global batch under torchrun (default
        :func:`wmrl.kernel.distributed.shard`: rows ``rank*B/world ..`` of every batch-sized tensor).
        Override when a batch holds several sub-batches or a batch dimension that is not the first."""
        from wmrl.kernel.distributed import shard

        return shard(batch, rank, world, what=f"{self.name} batch")

    def streams(self) -> dict:
        """Named ``torch.Generator`` / ``numpy.random.Generator`` of the run, saved for exact resume."""
        return {}

    def checkpoint_model(self) -> torch.nn.Module:
        return self.module

    def checkpoint_config(self) -> dict:
        raise NotImplementedError

    def extra_tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def save_meta(self) -> dict:
        return {}

    def load_meta(self, meta: dict) -> None:
        """Read back what :meth:`save_meta` wrote (called on resume, before the RNG streams are restored)."""

    def load(self, loaded: torch.nn.Module, tensors: dict, meta: dict) -> None:
        """Put a checkpoint back: ``loaded`` is the checkpoint's model, ``tensors`` its extra tensors
        (without RNG), ``meta`` its ``meta.json``."""
        self.module.load_state_dict(loaded.state_dict())


def _legacy_optimizer(tensors: dict, meta: dict, param_groups: list) -> tuple[dict, dict]:
    """Checkpoints of an older wmrl kept the optimizer under ``opt.<index>.<key>`` (BC: scalars in
    ``meta["steps"]``, no param groups; world model / critic: ``meta["optimizer"]``); translated to the
    codec's ``opt/<index>/<key>`` format."""
    log.warning("the checkpoint keeps its optimizer state in the old 'opt.' format; read it once (the next "
                "checkpoint uses 'opt/<index>/<key>')")
    new = {"opt/" + "/".join(k[4:].split(".", 1)): v for k, v in tensors.items() if k.startswith("opt.")}
    if "optimizer" in meta:
        om = dict(meta["optimizer"])
        om["scalars"] = {k.replace(".", "/", 1): v for k, v in om.get("scalars", {}).items()}
        return new, om
    for key, v in meta.get("steps", {}).items():
        new["opt/" + key.replace(".", "/", 1)] = torch.tensor(v)
    return new, {"param_groups": param_groups, "scalars": {}}


class Trainer:
    """Runs one supervised training of ``task`` under ``cfg`` in ``out_dir`` (see module docstring).

    :meth:`run` trains (or finds the run finished before) and returns itself; read ``finished`` (the
    report a finished run ended with, else ``None``), ``step``, ``start_step``, ``resumed``, ``recent``
    (the last ``log_every`` losses), ``over`` (the budget ran out), ``cut`` (it ran out before
    ``steps``), ``clock``; then :meth:`finish` writes the final checkpoint with the report."""

    def __init__(self, task: TrainTask, cfg: TrainConfig, out_dir: str | Path):
        self.task, self.cfg, self.out_dir = task, cfg, Path(out_dir)
        self.ckpt_root = self.out_dir / "checkpoints"
        self.params = task.params()
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.step = self.start_step = 0
        self.resumed: str | None = None
        self.finished: dict | None = None
        self.history: list[dict] = []
        self.progress: dict = {}
        self.writer = None
        self.over = self.cut = False
        from wmrl.kernel.distributed import DataParallel, init_from_env

        self.dp = DataParallel(self.params) if init_from_env() else None
        self.main = self.dp is None or self.dp.rank == 0

    # ------------------------------------------------------------ resume
    def _resume(self) -> bool:
        """Load ``last`` when resuming and it exists; ``True`` when the run had finished before."""
        from wmrl.kernel.checkpoint import (
            checkpoint_exists,
            load_checkpoint,
            load_checkpoint_meta,
            load_extra_tensors,
            optimizer_from_tensors,
        )
        from wmrl.kernel.rng import restore_rng, split_rng_tensors

        last = self.ckpt_root / "last"
        if not (self.cfg.resume and checkpoint_exists(last) and (last / "meta.json").exists()):
            return False
        meta = load_checkpoint_meta(last)
        rng_tensors, tensors = split_rng_tensors(load_extra_tensors(last))
        try:
            self.task.load(load_checkpoint(last), tensors, meta)
        except RuntimeError as e:
            raise RuntimeError(f"{last} does not fit this {type(self.task.module).__name__} (another architecture? "
                               f"start a new run directory or pass resume=false): {e}") from None
        if any(k.startswith("opt.") for k in tensors):
            otens, ometa = _legacy_optimizer(tensors, meta, self.opt.state_dict()["param_groups"])
        else:
            otens, ometa = tensors, meta.get("optimizer", {})
        if any(k.startswith("opt/") for k in otens):
            optimizer_from_tensors(self.opt, otens, ometa)
        self.step = self.start_step = int(meta["step"])
        self.history, self.progress = list(meta.get("history", [])), dict(meta.get("progress", {}))
        self.resumed = str(last)
        if self._finished_report(meta.get("report")):
            self.finished = meta["report"]
            return True
        self.task.load_meta(meta)
        streams = self.task.streams()
        rng_meta = meta.get("rng_streams", meta.get("rng") if "numpy_streams" in meta.get("rng", {}) else None)
        if rng_meta is not None:
            restore_rng(rng_tensors, rng_meta, streams)
        else:
            for g in streams.values():
                if isinstance(g, torch.Generator):
                    g.manual_seed(self.cfg.seed + self.step)
            log.warning("%s was written by an older wmrl without its RNG states: the generators are re-seeded, so "
                        "the resumed run is not bitwise the uninterrupted one", last)
        log.info("resumed %s from %s at step %d", self.task.name, last, self.step)
        return False

    def _finished_report(self, report: dict | None) -> bool:
        """A run ended before: all its steps, or cut by a budget already spent."""
        if report is None:
            return False
        p = self.progress
        spent_s = float(p.get("clock", {}).get("elapsed_s", p.get("train_time_s", 0.0)))
        spent = self.cfg.budget_s is not None and spent_s > self.cfg.budget_s
        return self.step >= self.cfg.steps or bool(report.get("cut_by_budget") and spent)

    # ------------------------------------------------------------ checkpoints
    def save(self, report: dict | None = None) -> Path:
        """Write ``<tag>`` and ``last`` (each atomically) with everything an exact resume needs (rank 0
        only under torchrun; the other ranks wait until it is written)."""
        if not self.main:
            self._barrier()
            return self.ckpt_root / "last"
        from wmrl.kernel.checkpoint import optimizer_to_tensors, save_checkpoint
        from wmrl.kernel.rng import capture_rng

        tensors, ometa = optimizer_to_tensors(self.opt)
        tensors.update(self.task.extra_tensors())
        rng_tensors, rng_meta = capture_rng(self.task.streams())
        tensors.update(rng_tensors)
        meta = {"step": self.step, "optimizer": ometa, "rng_streams": rng_meta, "history": self.history[-200:],
                "progress": {"recent": self.recent, "clock": self.clock.state(), "cut_by_budget": self.cut},
                **self.task.save_meta()}
        if report is not None:
            meta["report"] = report
        meta = json.loads(json.dumps(meta, default=float))
        model, config = self.task.checkpoint_model(), self.task.checkpoint_config()
        for f in (self.ckpt_root / self.task.tag(self.step), self.ckpt_root / "last"):
            save_checkpoint(model, f, config, extra_tensors=tensors or None, meta=meta)
        self._barrier()
        return self.ckpt_root / "last"

    def _barrier(self) -> None:
        if self.dp is not None:
            from wmrl.kernel.distributed import barrier

            barrier()

    # ------------------------------------------------------------ training
    def _one_step(self, batch) -> tuple[dict, float, Any, float]:
        c, step = self.cfg, self.step
        frac = self.clock.elapsed() / c.budget_s if c.budget_s and c.lr_follows_budget else 0.0
        lr = lr_at(step, c.steps, c.lr, c.warmup, c.min_lr_ratio, frac)
        for g in self.opt.param_groups:
            g["lr"] = lr
        dp = self.dp
        if dp is not None:
            batch = self.task.shard(batch, dp.rank, dp.world)
        with (dp.rank_rng(self.task.streams()) if dp is not None else contextlib.nullcontext()):
            if c.precision is not None:
                with c.precision.autocast():
                    loss, metrics = self.task.loss(batch)
            else:
                loss, metrics = self.task.loss(batch)
        if c.check_finite and not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite {self.task.name} loss at step {step}: {float(loss)}")
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        value = metrics.get("loss", loss)
        value = float(value.detach() if isinstance(value, torch.Tensor) else value)
        if dp is not None:
            value = dp.all_reduce_grads(value)
        gnorm = torch.nn.utils.clip_grad_norm_(self.params, c.grad_clip) if c.grad_clip > 0 else torch.tensor(0.0)
        self.opt.step()
        self.task.after_step()
        self.step += 1
        return metrics, value, gnorm, lr

    def _log(self, metrics: dict, lr: float, gnorm) -> None:
        avg = sum(self.recent) / len(self.recent)
        self.history.append({"step": self.step, "loss": avg})
        self.bar.set_postfix(loss=f"{avg:.4f}", lr=f"{lr:.1e}")
        if self.writer is not None:
            info = {"avg": avg, "lr": lr, "grad_norm": float(gnorm), "steps_this_run": self.step - self.start_step,
                    "seconds": time.time() - self.t0}
            for k, v in self.task.scalars(metrics, info).items():
                self.writer.add_scalar(k, v, self.step)

    def run(self) -> Trainer:
        from tqdm.auto import tqdm

        c = self.cfg
        self.recent: list[float] = []
        self.ckpt_root.mkdir(parents=True, exist_ok=True)
        if self._resume():
            log.info("%s run in %s finished before (step %d): its report is returned unchanged", self.task.name,
                     self.out_dir, self.step)
            self.task.module.eval()
            return self
        if self.resumed is None:
            self.task.fresh_start()
        if self.dp is not None:      # rank 0's weights and statistics on every rank
            kept = self.task.checkpoint_model()       # e.g. BC's EMA copy
            self.dp.broadcast_params([self.task.module] + ([kept] if kept is not self.task.module else []))
        self.recent = list(self.progress.get("recent", []))
        if c.tensorboard and self.main:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.out_dir / "tb"))
        self.clock = BudgetClock(c.budget_clock, self.progress.get("clock", {"wall_s": self.progress.get("train_time_s", 0.0)}))
        self.t0 = time.time()
        self.task.module.train()
        self.bar = tqdm(total=c.steps, initial=self.step, desc=c.desc, disable=not (c.progress and self.main),
                        dynamic_ncols=True)
        for batch in (self.task.batches(self.step, c.steps) if self.step < c.steps else ()):
            metrics, value, gnorm, lr = self._one_step(batch)
            self.bar.update(1)
            self.recent = (self.recent + [value])[-max(1, c.log_every):]
            if self.step % c.log_every == 0 or self.step == c.steps:
                self._log(metrics, lr, gnorm)
            self.over = c.budget_s is not None and self.clock.elapsed() > c.budget_s
            if self.dp is not None and c.budget_s is not None:     # every rank stops at the same step
                self.over = self.dp.any_flag(self.over)
            if self.writer is not None and c.eval_every > 0 and (
                    self.step % c.eval_every == 0 or self.step == c.steps or self.over):
                # under torchrun only rank 0 evaluates: its draws must not move the RNG state the ranks share
                with torch.random.fork_rng(enabled=self.dp is not None):
                    self.task.evaluate(self.step, self.writer)
            if self.over:
                break
            if c.ckpt_every > 0 and self.step % c.ckpt_every == 0 and self.step < c.steps:
                self.save()
        self.bar.close()
        self.cut = bool(self.over and self.step < c.steps) or bool(self.progress.get("cut_by_budget", False))
        if self.over and self.step < c.steps:
            log.warning("%s: the time budget of %.0f s stopped training at step %d of %d planned; this run is cut "
                        "short and not comparable with a full one", self.task.name, c.budget_s, self.step, c.steps)
        self.task.module.eval()
        return self

    def parallel(self, batch_size: int) -> dict:
        """The report's ``data_parallel`` entry: ranks, backend, effective (global) and per-rank batch
        and the peak LR (the same for any number of ranks: the configured batch is the global one)."""
        w = 1 if self.dp is None else self.dp.world
        backend = "none" if self.dp is None else torch.distributed.get_backend()
        return {"world_size": w, "backend": backend, "effective_batch": int(batch_size),
                "per_rank_batch": int(batch_size) // w, "lr": self.cfg.lr}

    def finish(self, report: dict | None, save: bool = True) -> None:
        """Write the final checkpoint (carrying ``report``) when ``save``, and close TensorBoard."""
        if save:
            self.save(report=report)
        if self.writer is not None:
            self.writer.close()
            self.writer = None
