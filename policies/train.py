"""Behaviour cloning of a flow-matching policy on windows of an ``EpisodeStore``, as a task of the one
trainer (``wmrl.kernel.trainer``).

``train_bc(policy, dataset, cfg, out_dir) -> dict`` is called by ``wmrl train-policy`` and by the
pipeline. The policy must provide ``loss(batch, generator) -> (loss, metrics)`` (e.g.
``FlowVLAPolicy``) and ``init_config`` (its constructor arguments, saved in the checkpoint).
:class:`BCTask` says how batches are drawn (:func:`_batches`), adds the EMA and the bf16 autocast
(``wmrl.kernel.precision``); the trainer owns the optimizer, schedule, budget, logging and checkpoints.

Checkpoints (``out_dir/checkpoints/step_<n>`` and ``.../last``) are written with
``wmrl.kernel.checkpoint.save_checkpoint`` (``config.yaml`` + ``model.safetensors``, loadable with
``wmrl.kernel.checkpoint.load_checkpoint``); when an EMA is kept the EMA weights are the model weights. The
optimizer state (``opt/<index>/<key>``), raw (non-EMA) weights (``raw.<name>``) and RNG states needed to
resume go in the checkpoint's ``extra.safetensors``, the step and loss history in ``meta.json`` (no pickle).
``resume=True`` continues from ``last`` when it exists.
"""

from __future__ import annotations

import copy
import logging
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

from wmrl.kernel.trainer import TrainConfig, Trainer, TrainTask

log = logging.getLogger("wmrl.policies")

DEFAULTS = dict(steps=2000, batch_size=64, lr=3e-4, weight_decay=1e-4, warmup_steps=100, min_lr_ratio=0.1,
                grad_clip=1.0, ema_decay=0.995, log_every=25, ckpt_every=500, num_workers=0, seed=0,
                resume=True, time_budget_s=0.0, bf16="auto", lr_follows_budget=True)


def _cfg(cfg: Any) -> dict:
    if cfg is None:
        return dict(DEFAULTS)
    if hasattr(cfg, "items"):
        try:
            from omegaconf import OmegaConf

            if OmegaConf.is_config(cfg):
                cfg = OmegaConf.to_container(cfg, resolve=True)
        except ImportError:  # pragma: no cover
            pass
        unknown = set(cfg) - set(DEFAULTS)
        if unknown:
            raise ValueError(f"unknown train options {sorted(unknown)}; known: {sorted(DEFAULTS)}")
        return {**DEFAULTS, **dict(cfg)}
    raise TypeError(f"train cfg must be a mapping, got {type(cfg)}")


def policy_device_type(policy) -> str:
    """``"cpu"`` or ``"cuda"``: the device type of the policy's parameters (for autocast)."""
    return next(policy.parameters()).device.type


def policy_checkpoint_config(policy) -> dict:
    """The constructor config saved with a policy: ``init_config`` plus its sampler as a ``_target_``."""
    cfg = dict(policy.init_config)
    s = policy.sampler
    sc = {"_target_": f"{type(s).__module__}.{type(s).__qualname__}", "num_steps": s.num_steps}
    if s.stochastic:
        sc["noise_level"] = s.noise_level
        if s.noise_steps is not None:
            sc["noise_steps"] = s.noise_steps
    elif s.noise_scale != 1.0:
        sc["noise_scale"] = s.noise_scale
    cfg["sampler"] = sc
    return cfg


def save_policy(policy, folder: str | Path) -> Path:
    """Save ``policy`` as a checkpoint folder via ``wmrl.kernel.checkpoint.save_checkpoint``."""
    from wmrl.kernel.checkpoint import save_checkpoint

    folder = Path(folder)
    save_checkpoint(policy, folder, policy_checkpoint_config(policy))
    return folder


class StepBatchSampler(Sampler):
    """Batches of ``batch_size`` window indices drawn uniformly with replacement, batch ``s`` from a
    generator seeded by ``(seed, s)``: the batch of a step does not depend on what was drawn before
    it, so a ``DataLoader`` that prefetches (``num_workers > 0``) and a run resumed at ``start`` see
    exactly the batches of the uninterrupted run."""

    def __init__(self, n: int, batch_size: int, seed: int, start: int, stop: int):
        self.n, self.batch_size, self.seed, self.start, self.stop = n, batch_size, int(seed), int(start), int(stop)

    def __len__(self) -> int:
        return max(0, self.stop - self.start)

    def __iter__(self):
        for s in range(self.start, self.stop):
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + s)
            yield torch.randint(self.n, (self.batch_size,), generator=g).tolist()


def _batches(dataset, start: int, stop: int, c: dict, gen: torch.Generator):
    """The batches of steps ``start..stop-1``: vectorised ``sample_batch`` of an in-memory
    ``WindowDataset`` (drawn from ``gen``, restored on resume), else a ``DataLoader`` over a
    :class:`StepBatchSampler`."""
    if getattr(dataset, "in_memory", False) and hasattr(dataset, "sample_batch"):
        return (dataset.sample_batch(c["batch_size"], generator=gen) for _ in range(stop - start))
    sampler = StepBatchSampler(len(dataset), c["batch_size"], c["seed"], start, stop)
    return DataLoader(dataset, batch_sampler=sampler, num_workers=c["num_workers"])


def _ema_update(ema, policy, decay: float) -> None:
    with torch.no_grad():
        for pe, pp in zip(ema.parameters(), policy.parameters()):
            pe.lerp_(pp, 1 - decay)
        for be, bp in zip(ema.buffers(), policy.buffers()):
            be.copy_(bp)


class BCTask(TrainTask):
    """Behaviour cloning as a :class:`wmrl.kernel.trainer.TrainTask`: batches of windows, the policy's
    ``loss(batch, generator)``, an optional EMA (``ema_decay > 0``; the EMA weights are the checkpoint's
    model weights, the raw ones go in ``extra.safetensors`` as ``raw.<name>``)."""

    name = "BC"

    def __init__(self, policy, dataset, c: dict):
        self.module, self.dataset, self.c = policy, dataset, c
        self.ema = None
        if c["ema_decay"] > 0:
            self.ema = copy.deepcopy(policy).eval()
            for p in self.ema.parameters():
                p.requires_grad_(False)
        self.gen = torch.Generator().manual_seed(int(c["seed"]))

    def params(self):
        return [p for p in self.module.parameters() if p.requires_grad]

    def batches(self, start, stop):
        return _batches(self.dataset, start, stop, self.c, self.gen)

    def loss(self, batch):
        return self.module.loss(batch, generator=self.gen)

    def after_step(self):
        if self.ema is not None:
            _ema_update(self.ema, self.module, self.c["ema_decay"])

    def scalars(self, metrics, info):
        sps = info["steps_this_run"] * self.c["batch_size"] / max(1e-9, info["seconds"])
        return {"bc/loss": info["avg"], "bc/lr": info["lr"], "bc/grad_norm": info["grad_norm"], "bc/samples_per_s": sps}

    def tag(self, step):
        return f"step_{step}"

    def streams(self):
        return {"bc": self.gen}

    def checkpoint_model(self):
        return self.ema if self.ema is not None else self.module

    def checkpoint_config(self):
        return policy_checkpoint_config(self.checkpoint_model())

    def extra_tensors(self):
        if self.ema is None:
            return {}
        return {f"raw.{k}": v.detach().cpu().contiguous() for k, v in self.module.state_dict().items()}

    def load(self, loaded, tensors, meta):
        raw = {k[4:]: v for k, v in tensors.items() if k.startswith("raw.")}
        self.module.load_state_dict(raw if raw else loaded.state_dict())
        if self.ema is not None:
            self.ema.load_state_dict(loaded.state_dict())


def _trainer_config(c: dict, precision) -> TrainConfig:
    budget = float(c["time_budget_s"] or 0.0)
    return TrainConfig(steps=int(c["steps"]), lr=c["lr"], weight_decay=c["weight_decay"], warmup=c["warmup_steps"],
                       min_lr_ratio=c["min_lr_ratio"], grad_clip=c["grad_clip"], log_every=c["log_every"],
                       ckpt_every=c["ckpt_every"], budget_s=budget if budget > 0 else None,
                       lr_follows_budget=c["lr_follows_budget"], resume=c["resume"], seed=int(c["seed"]),
                       desc="bc", check_finite=True, precision=precision)


def train_bc(policy, dataset, cfg: Any, out_dir: str | Path, val_dataset=None) -> dict:
    """Behaviour cloning with flow matching, on the one trainer (:class:`wmrl.kernel.trainer.Trainer`).

    Args:
        policy: a ``torch.nn.Module`` with ``loss(batch, generator)`` and ``init_config``; its
            normalisation statistics must already be set (``policy.set_norm_stats(store.stats())``).
        dataset: map-style dataset of windows (``wmrl.kernel.storage.WindowDataset(store, n_obs, horizon)``
            items: ``images``, ``proprio``, ``actions``, ``action_pad``, ``instruction``, ...).
        cfg: mapping with keys of :data:`DEFAULTS` (``steps``, ``batch_size``, ``lr``, ``ema_decay`` (0 =
            off), ``ckpt_every``, ``resume``, ``time_budget_s`` (stop early after this much training time,
            summed over resumed runs; 0 = off), ``lr_follows_budget`` (the LR decays over the time budget
            when it runs out before the steps; ``False``: over the steps only, so the run does not depend
            on the machine's speed), ``bf16`` (``"auto"``, ``True`` or ``False``: bfloat16 autocast of the
            forward pass, ``wmrl.kernel.precision.resolve_bf16``; weights, optimizer and EMA stay float32)...).
        out_dir: run directory; TensorBoard scalars go to ``out_dir/tb``, checkpoints to
            ``out_dir/checkpoints``.
        val_dataset: optional held-out windows; their loss is reported at the end.

    Resume is exact: a run killed at any moment and started again with the same arguments ends with
    the weights of the uninterrupted run. Started again after it finished, it returns the report it
    finished with and writes nothing.

    Returns:
        report dict: ``steps``, ``steps_planned``, ``cut_by_budget``, ``final_loss`` (mean of the last
        ``log_every`` steps), ``val_loss``, ``train_time_s`` (over all resumed runs), ``samples_per_s``
        (of this run), ``checkpoint`` (path of ``last``), ``resumed_from``, ``precision``
        (``wmrl.kernel.precision.Precision.as_dict()``).

    Raises:
        ValueError: an empty dataset, unknown options or a bad ``bf16`` setting.
        FloatingPointError: a non-finite loss.
    """
    from wmrl.kernel.precision import resolve_bf16

    c = _cfg(cfg)
    precision = resolve_bf16(c["bf16"], policy_device_type(policy), "BC")
    log.info("precision: %s (%s)", precision.dtype, precision.reason)
    if len(dataset) == 0:
        raise ValueError("the training dataset has no windows; is the store empty?")
    task = BCTask(policy, dataset, c)
    tr = Trainer(task, _trainer_config(c, precision), out_dir).run()
    if tr.finished is not None:
        return tr.finished
    ckpt_root, step, recent = tr.ckpt_root, tr.step, tr.recent
    done_samples = (step - tr.start_step) * c["batch_size"]
    train_time = time.time() - tr.t0
    report = {"steps": step, "steps_planned": c["steps"], "cut_by_budget": tr.cut,
              "precision": precision.as_dict(), "final_loss": (sum(recent) / len(recent)) if recent else None,
              "train_time_s": round(tr.clock.wall(), 2),
              "samples_per_s": round(done_samples / max(1e-9, train_time), 2) if done_samples else None,
              "checkpoint": str(ckpt_root / "last"), "step_checkpoint": str(ckpt_root / f"step_{step}"),
              "resumed_from": tr.resumed, "num_params": sum(p.numel() for p in policy.parameters()),
              "data_parallel": tr.parallel(c["batch_size"])}
    if val_dataset is not None and len(val_dataset) > 0:
        report["val_loss"] = evaluate_loss(task.checkpoint_model(), val_dataset, c["batch_size"], seed=c["seed"])
        if tr.writer is not None:
            tr.writer.add_scalar("bc/val_loss", report["val_loss"], step)
    tr.finish(report if step >= c["steps"] or tr.cut else None)
    policy.eval()
    return report


@torch.no_grad()
def evaluate_loss(policy, dataset, batch_size: int = 64, seed: int = 0, max_batches: int = 20) -> float:
    """Mean flow-matching loss of ``policy`` on ``dataset`` (fixed seed, no augmentation)."""
    was = policy.training
    policy.eval()
    gen = torch.Generator().manual_seed(seed)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False)
    tot, n = 0.0, 0
    for i, batch in enumerate(loader):
        if i >= max_batches:
            break
        loss, _ = policy.loss(batch, generator=gen)
        tot += float(loss)
        n += 1
    policy.train(was)
    return tot / max(1, n)
