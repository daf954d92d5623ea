"""Behaviour cloning of a flow-matching policy on windows of an ``EpisodeStore`` (a short linear loop).

``train_bc(policy, dataset, cfg, out_dir) -> dict`` is called by ``wmrl train-policy`` and by the
pipeline. The policy must provide ``loss(batch, generator) -> (loss, metrics)`` (e.g.
``FlowVLAPolicy``) and ``init_config`` (its constructor arguments, saved in the checkpoint).

Checkpoints (``out_dir/checkpoints/step_<n>`` and ``.../last``) are written with
``wmrl.kernel.checkpoint.save_checkpoint`` (``config.yaml`` + ``model.safetensors``, loadable with
``wmrl.kernel.checkpoint.load_checkpoint``); when an EMA is kept the EMA weights are the model weights. The
optimizer state and raw (non-EMA) weights needed to resume go in the checkpoint's
``extra.safetensors``, the step and loss history in ``meta.json`` (no pickle). ``resume=True`` continues from ``last`` when it exists.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler
from tqdm.auto import tqdm

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


def _lr_at(step: int, c: dict, time_frac: float = 0.0) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_ratio`` over the steps or, with a time budget,
    over whichever of steps and budget runs out first (``time_frac``: elapsed / budget)."""
    if step < c["warmup_steps"]:
        return c["lr"] * (step + 1) / max(1, c["warmup_steps"])
    prog = max((step - c["warmup_steps"]) / max(1, c["steps"] - c["warmup_steps"]), time_frac)
    return c["lr"] * (c["min_lr_ratio"] + (1 - c["min_lr_ratio"]) * 0.5 * (1 + math.cos(math.pi * min(1.0, prog))))


def policy_checkpoint_config(policy) -> dict:
    """The constructor config saved with a policy: ``init_config`` plus its sampler as a ``_target_``."""
    cfg = dict(policy.init_config)
    s = policy.sampler
    sc = {"_target_": f"{type(s).__module__}.{type(s).__qualname__}", "num_steps": s.num_steps}
    if getattr(s, "stochastic", False):
        sc["noise_level"] = s.noise_level
        if getattr(s, "noise_steps", None) is not None:
            sc["noise_steps"] = s.noise_steps
    elif getattr(s, "noise_scale", 1.0) != 1.0:
        sc["noise_scale"] = s.noise_scale
    cfg["sampler"] = sc
    return cfg


def save_policy(policy, folder: str | Path) -> Path:
    """Save ``policy`` as a checkpoint folder via ``wmrl.kernel.checkpoint.save_checkpoint``."""
    from wmrl.kernel.checkpoint import save_checkpoint

    folder = Path(folder)
    save_checkpoint(policy, folder, policy_checkpoint_config(policy))
    return folder


def _optimizer_state(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> tuple[dict, dict]:
    tensors, meta = {}, {"steps": {}}
    for i, p in enumerate(params):
        st = opt.state.get(p, {})
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.ndim > 0:
                tensors[f"opt.{i}.{k}"] = v.detach().cpu().contiguous()
            else:
                meta["steps"][f"{i}.{k}"] = float(v)
    return tensors, meta


def _load_optimizer_state(opt, params, tensors: dict, meta: dict) -> None:
    for i, p in enumerate(params):
        st = {}
        for name, v in tensors.items():
            if name.startswith(f"opt.{i}."):
                st[name.split(".", 2)[2]] = v.to(p.device)
        for key, v in meta["steps"].items():
            idx, k = key.split(".", 1)
            if int(idx) == i:
                st[k] = torch.tensor(v)
        if st:
            opt.state[p] = st


def _save_all(policy, ema, opt, params, step: int, ckpt_root: Path, history: list, gen: torch.Generator,
              progress: dict, report: dict | None = None) -> Path:
    """Write ``step_<n>`` and ``last`` (each atomically, via ``wmrl.kernel.checkpoint.save_checkpoint``) with
    everything an exact resume needs: raw weights, optimizer, the batch/noise generator and the
    process-wide RNGs (``wmrl.kernel.rng``), the recent losses and elapsed training time (``progress``); the
    final checkpoint also carries the run's ``report``."""
    from wmrl.kernel.checkpoint import save_checkpoint
    from wmrl.kernel.rng import capture_rng

    tensors, meta = _optimizer_state(opt, params)
    if ema is not None:
        tensors.update({f"raw.{k}": v.detach().cpu().contiguous() for k, v in policy.state_dict().items()})
    rng_tensors, rng_meta = capture_rng({"bc": gen})
    tensors.update(rng_tensors)
    meta.update(step=step, history=history[-200:], rng=rng_meta, progress=progress)
    if report is not None:
        meta["report"] = report
    model = ema if ema is not None else policy
    folder = ckpt_root / f"step_{step}"
    for f in (folder, ckpt_root / "last"):
        save_checkpoint(model, f, policy_checkpoint_config(model), extra_tensors=tensors or None, meta=meta)
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


def _resume_bc(policy, ema, opt, params, gen: torch.Generator, last: Path, seed: int) -> tuple[int, list, dict, dict | None]:
    """Load ``last`` into the policy, EMA, optimizer and generators. Returns ``(step, history,
    progress, report)``; ``report`` is the finished run's report when ``last`` is the final checkpoint."""
    from wmrl.kernel.checkpoint import (
        load_checkpoint,
        load_checkpoint_meta,
        load_extra_tensors,
    )
    from wmrl.kernel.rng import restore_rng, split_rng_tensors

    meta = load_checkpoint_meta(last)
    loaded = load_checkpoint(last)
    rng_tensors, tensors = split_rng_tensors(load_extra_tensors(last))
    raw = {k[4:]: v for k, v in tensors.items() if k.startswith("raw.")}
    policy.load_state_dict(raw if raw else loaded.state_dict())
    if ema is not None:
        ema.load_state_dict(loaded.state_dict())
    _load_optimizer_state(opt, params, {k: v for k, v in tensors.items() if k.startswith("opt.")}, meta)
    start = int(meta["step"])
    if "rng" in meta:
        restore_rng(rng_tensors, meta["rng"], {"bc": gen})
    else:
        gen.manual_seed(seed + start)
        log.warning("%s was written by an older wmrl without RNG state: the generator is re-seeded, so the resumed "
                    "run is not bitwise the uninterrupted one", last)
    log.info("resumed from %s at step %d", last, start)
    return start, list(meta.get("history", [])), dict(meta.get("progress", {})), meta.get("report")


def _ema_update(ema, policy, decay: float) -> None:
    with torch.no_grad():
        for pe, pp in zip(ema.parameters(), policy.parameters()):
            pe.lerp_(pp, 1 - decay)
        for be, bp in zip(ema.buffers(), policy.buffers()):
            be.copy_(bp)


def train_bc(policy, dataset, cfg: Any, out_dir: str | Path, val_dataset=None) -> dict:
    """Behaviour cloning with flow matching.

    Args:
        policy: a ``torch.nn.Module`` with ``loss(batch, generator)`` and ``init_config``; its
            normalisation statistics must already be set (``policy.set_norm_stats(store.stats())``).
        dataset: map-style dataset of windows (``wmrl.kernel.storage.WindowDataset(store, n_obs, horizon)``
            items: ``images``, ``proprio``, ``actions``, ``action_pad``, ``instruction``, ...).
        cfg: mapping with keys of :data:`DEFAULTS` (``steps``, ``batch_size``, ``lr``, ``ema_decay`` (0 =
            off), ``ckpt_every``, ``resume``, ``time_budget_s`` (stop early after this much training time,
            summed over resumed runs; 0 = off), ``lr_follows_budget`` (the LR decays
            over the time budget when it runs out before the steps; ``False``: over the steps only, so the run
            does not depend on the machine's speed), ``bf16`` (``"auto"``, ``True`` or ``False``: bfloat16 autocast of the
            forward pass, ``wmrl.kernel.precision.resolve_bf16``; ``"auto"`` uses it only where the hardware runs
            bf16 natively, about 1.6x faster BC steps there; weights, optimizer and EMA stay float32)...).
        out_dir: run directory; TensorBoard scalars go to ``out_dir/tb``, checkpoints to
            ``out_dir/checkpoints``.
        val_dataset: optional held-out windows; their loss is reported at the end.

    Resume is exact: a run killed at any moment and started again with the same arguments ends with
    the weights of the uninterrupted run (the checkpoint carries the generator states, optimizer,
    EMA, raw weights and recent losses). Started again after it finished, it returns the report it
    finished with and writes nothing.

    Returns:
        report dict: ``steps``, ``steps_planned``, ``cut_by_budget`` (the time budget stopped it before
        ``steps_planned``), ``final_loss`` (mean of the last ``log_every`` steps), ``val_loss``,
        ``train_time_s`` (training time over all resumed runs), ``samples_per_s`` (of this run),
        ``checkpoint`` (path of ``last``), ``resumed_from``, ``precision``
        (``wmrl.kernel.precision.Precision.as_dict()``: dtype and why).

    Raises:
        ValueError: an empty dataset, unknown options or a bad ``bf16`` setting.
        FloatingPointError: a non-finite loss.
    """
    from wmrl.kernel.checkpoint import checkpoint_exists
    from wmrl.kernel.precision import resolve_bf16

    c = _cfg(cfg)
    precision = resolve_bf16(c["bf16"], policy_device_type(policy), "BC")
    log.info("precision: %s (%s)", precision.dtype, precision.reason)
    out_dir = Path(out_dir)
    ckpt_root = out_dir / "checkpoints"
    ckpt_root.mkdir(parents=True, exist_ok=True)
    if len(dataset) == 0:
        raise ValueError("the training dataset has no windows; is the store empty?")
    params = [p for p in policy.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=c["lr"], weight_decay=c["weight_decay"])
    ema = None
    if c["ema_decay"] > 0:
        ema = copy.deepcopy(policy).eval()
        for p in ema.parameters():
            p.requires_grad_(False)
    gen = torch.Generator().manual_seed(int(c["seed"]))
    start, history, progress, resumed_from = 0, [], {}, None
    last = ckpt_root / "last"
    if c["resume"] and checkpoint_exists(last) and (last / "meta.json").exists():
        start, history, progress, finished = _resume_bc(policy, ema, opt, params, gen, last, int(c["seed"]))
        budget_spent = float(c["time_budget_s"] or 0) > 0 and progress.get("train_time_s", 0.0) > float(c["time_budget_s"])
        if finished is not None and (start >= c["steps"] or (finished.get("cut_by_budget") and budget_spent)):
            log.info("BC run in %s finished before (step %d): its report is returned unchanged", out_dir, start)
            policy.eval()
            return finished
        resumed_from = str(last)

    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(out_dir / "tb"))
    remaining = c["steps"] - start
    batches = _batches(dataset, start, c["steps"], c, gen) if remaining > 0 else None
    policy.train()
    t0 = time.time()
    before_s = float(progress.get("train_time_s", 0.0))

    def elapsed() -> float:
        return before_s + time.time() - t0

    step = start
    cut_by_budget = False
    recent: list[float] = list(progress.get("recent", []))
    done_samples = 0
    budget = float(c["time_budget_s"] or 0.0)

    def prog() -> dict:
        return {"recent": recent, "train_time_s": elapsed(), "cut_by_budget": cut_by_budget}

    if batches is not None:
        bar = tqdm(batches, total=c["steps"], initial=start, desc="bc", dynamic_ncols=True)
        for batch in bar:
            lr = _lr_at(step, c, elapsed() / budget if budget > 0 and c["lr_follows_budget"] else 0.0)
            for g in opt.param_groups:
                g["lr"] = lr
            with torch.autocast(device_type=policy_device_type(policy), dtype=torch.bfloat16, enabled=precision.bf16):
                loss, metrics = policy.loss(batch, generator=gen)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"non-finite BC loss at step {step}: {float(loss)}")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(params, c["grad_clip"]) if c["grad_clip"] > 0 else torch.tensor(0.0)
            opt.step()
            if ema is not None:
                _ema_update(ema, policy, c["ema_decay"])
            step += 1
            done_samples += c["batch_size"]
            recent.append(metrics["loss"])
            recent = recent[-c["log_every"]:]
            if step % c["log_every"] == 0 or step == c["steps"]:
                avg = sum(recent) / len(recent)
                for k, v in (("loss", avg), ("lr", lr), ("grad_norm", float(gnorm)),
                             ("samples_per_s", done_samples / max(1e-9, time.time() - t0))):
                    writer.add_scalar(f"bc/{k}", v, step)
                history.append({"step": step, "loss": avg})
                bar.set_postfix(loss=f"{avg:.4f}", lr=f"{lr:.1e}")
            if budget > 0 and elapsed() > budget and step < c["steps"]:
                cut_by_budget = True
                log.warning("time budget of %.0f s reached at step %d of %d planned: this BC run is cut short "
                            "and not comparable with a full one", budget, step, c["steps"])
                break
            if c["ckpt_every"] > 0 and step % c["ckpt_every"] == 0 and step < c["steps"]:
                _save_all(policy, ema, opt, params, step, ckpt_root, history, gen, prog())
        bar.close()
    cut_by_budget = cut_by_budget or bool(progress.get("cut_by_budget", False))
    train_time = time.time() - t0
    report = {"steps": step, "steps_planned": c["steps"], "cut_by_budget": cut_by_budget,
              "precision": precision.as_dict(), "final_loss": (sum(recent) / len(recent)) if recent else None,
              "train_time_s": round(elapsed(), 2),
              "samples_per_s": round(done_samples / max(1e-9, train_time), 2) if done_samples else None,
              "checkpoint": str(ckpt_root / "last"), "step_checkpoint": str(ckpt_root / f"step_{step}"),
              "resumed_from": resumed_from, "num_params": sum(p.numel() for p in policy.parameters())}
    if val_dataset is not None and len(val_dataset) > 0:
        report["val_loss"] = evaluate_loss(ema if ema is not None else policy, val_dataset, c["batch_size"], seed=c["seed"])
        writer.add_scalar("bc/val_loss", report["val_loss"], step)
    _save_all(policy, ema, opt, params, step, ckpt_root, history, gen, prog(),
              report=report if step >= c["steps"] or cut_by_budget else None)
    writer.close()
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
