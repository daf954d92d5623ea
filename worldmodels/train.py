"""Reusable training loops for the world model and the progress critic (called by
``wmrl train-worldmodel`` / ``wmrl train-critic`` and by the pipeline).

Both loops: AdamW with linear warm-up and cosine decay, bfloat16 autocast inside the models,
tqdm progress, TensorBoard scalars under ``out_dir/tb``, checkpoints (``wmrl.kernel.checkpoint`` folders:
``config.yaml`` + ``model.safetensors`` + optimizer state in ``extra.safetensors`` + step in
``meta.json``) under ``out_dir/checkpoints/step_<n>`` and ``.../last``; with ``resume=True`` they
continue from ``last`` (model, optimizer, step and data RNG). A wall-clock budget
(``max_minutes``) stops training early and still checkpoints.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from wmrl.kernel.checkpoint import (
    checkpoint_exists,
    load_checkpoint,
    load_checkpoint_meta,
    load_extra_tensors,
    save_checkpoint,
)
from wmrl.kernel.precision import Precision
from worldmodels.critic import ProgressValueCritic
from worldmodels.data import EpisodeFrames
from worldmodels.video_wm import ChunkFlowWorldModel, WMState, to_uint8, to_unit

log = logging.getLogger("wmrl.worldmodels")


# ---------------------------------------------------------------------------- optimizer state
def optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """Flatten an optimizer's state into named tensors plus JSON metadata (no pickle)."""
    sd = opt.state_dict()
    tensors, scalars = {}, {}
    for pid, st in sd["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                tensors[f"opt.{pid}.{k}"] = v
            else:
                scalars[f"{pid}.{k}"] = v
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def load_optimizer_tensors(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Inverse of :func:`optimizer_tensors`."""
    state: dict[int, dict[str, Any]] = {}
    for name, v in tensors.items():
        if not name.startswith("opt."):
            continue
        _, pid, k = name.split(".", 2)
        state.setdefault(int(pid), {})[k] = v
    for key, v in meta.get("scalars", {}).items():
        pid, k = key.split(".", 1)
        state.setdefault(int(pid), {})[k] = v
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def lr_at(step: int, total: int, lr: float, warmup: int, time_frac: float = 0.0) -> float:
    """Linear warm-up for ``warmup`` steps, then cosine decay to 10 % of ``lr`` at ``total`` steps or
    at the end of the time budget (``time_frac`` = fraction of it used), whichever comes first."""
    if step < warmup:
        return lr * (step + 1) / warmup
    frac = min(1.0, max((step - warmup) / max(1, total - warmup), time_frac))
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def _save(model, config: dict, opt, step: int, rng: np.random.Generator, out_dir: Path, tag: str | None,
          gen: torch.Generator | None = None, progress: dict | None = None, report: dict | None = None) -> Path:
    """Write ``last`` (and ``tag``) with everything an exact resume needs: optimizer, the numpy window
    generator ``rng``, the torch noise generator ``gen`` and the process-wide RNGs (``wmrl.kernel.rng``), the
    recent losses and elapsed budget time (``progress``); the final checkpoint also carries ``report``."""
    from wmrl.kernel.rng import capture_rng

    tens, ometa = optimizer_tensors(opt)
    rng_tensors, rng_meta = capture_rng({"noise": gen} if gen is not None else {})
    tens.update(rng_tensors)
    meta = {"step": step, "optimizer": ometa, "rng": rng.bit_generator.state, "rng_streams": rng_meta,
            "progress": progress or {}}
    if report is not None:
        meta["report"] = report
    meta = json.loads(json.dumps(meta, default=float))
    ck = out_dir / "checkpoints"
    last = save_checkpoint(model, ck / "last", config, extra_tensors=tens, meta=meta)
    if tag:
        save_checkpoint(model, ck / tag, config, extra_tensors=tens, meta=meta)
    return last


class Resumed:
    """What :func:`_resume` read from ``last``: model, optimizer, step, the window generator ``rng``,
    ``progress`` (recent losses, elapsed budget time), the finished run's ``report`` (or ``None``),
    and the saved RNG state for :meth:`restore_noise`."""

    def __init__(self, model, opt, step: int, rng: np.random.Generator, meta: dict, rng_tensors: dict, where: Path):
        self.model, self.opt, self.step, self.rng = model, opt, step, rng
        self.progress = dict(meta.get("progress", {}))
        self.report = meta.get("report")
        self._meta, self._tensors, self.where = meta, rng_tensors, where

    def restore_noise(self, gen: torch.Generator | None, seed: int) -> None:
        """Put the saved noise generator ``gen`` (if the loop has one) and the process-wide RNGs back;
        a checkpoint of an older wmrl without them re-seeds ``gen`` (``seed + step``) and says the
        resume is not exact."""
        from wmrl.kernel.rng import restore_rng

        if "rng_streams" in self._meta:
            restore_rng(self._tensors, self._meta["rng_streams"], {"noise": gen} if gen is not None else {})
            return
        if gen is not None:
            gen.manual_seed(seed + self.step)
        log.warning("%s was written by an older wmrl without its RNG states: the resumed run is not bitwise the "
                    "uninterrupted one", self.where)

    def finished(self, steps: int, max_minutes: float | None) -> dict | None:
        """The report of a run that already ended (all ``steps``, or cut by a budget already spent)."""
        if self.report is None:
            return None
        spent = max_minutes is not None and float(self.progress.get("elapsed_s", 0.0)) > 60 * max_minutes
        return self.report if self.step >= steps or (self.report.get("cut_by_budget") and spent) else None


def _resume(out_dir: Path, opt_factory, model: torch.nn.Module) -> Resumed | None:
    """Load ``out_dir/checkpoints/last`` into ``model`` (in place, so the caller's object holds the
    weights) and a new optimizer; ``None`` when there is no checkpoint.

    Raises:
        RuntimeError: the checkpoint's weights do not fit ``model`` (another architecture).
    """
    from wmrl.kernel.rng import split_rng_tensors

    last = out_dir / "checkpoints" / "last"
    if not checkpoint_exists(last):
        return None
    try:
        model.load_state_dict(load_checkpoint(last).state_dict())
    except RuntimeError as e:
        raise RuntimeError(f"{last} does not fit this {type(model).__name__} (another architecture? start a new "
                           f"run directory or pass resume=false): {e}") from None
    opt = opt_factory(model)
    meta = load_checkpoint_meta(last)
    rng_tensors, tensors = split_rng_tensors(load_extra_tensors(last))
    load_optimizer_tensors(opt, tensors, meta["optimizer"])
    rng = np.random.default_rng()
    rng.bit_generator.state = meta["rng"]
    return Resumed(model, opt, int(meta["step"]), rng, meta, rng_tensors, last)


class BudgetClock:
    """Elapsed training time for the ``max_minutes`` budget.

    ``"wall"``: wall-clock seconds. ``"process"``: this process's CPU seconds divided by the torch
    thread count, i.e. the wall time the same work takes on an otherwise idle machine (use it when
    other jobs share the CPU; spin-waiting under contention still counts, so it is conservative).
    """

    def __init__(self, kind: str = "wall", before: dict | None = None):
        if kind not in ("wall", "process"):
            raise ValueError(f"budget_clock must be 'wall' or 'process', got {kind!r}")
        self.kind = kind
        self.w0, self.p0 = time.time(), time.process_time()
        before = before or {}
        self.wall_before, self.process_before = float(before.get("wall_s", 0.0)), float(before.get("process_s", 0.0))

    def wall(self) -> float:
        return self.wall_before + time.time() - self.w0

    def process(self) -> float:
        return self.process_before + (time.process_time() - self.p0) / max(1, torch.get_num_threads())

    def elapsed(self) -> float:
        return self.wall() if self.kind == "wall" else self.process()

    def state(self) -> dict:
        """Elapsed seconds so far (this run plus ``before``), to carry over a resume."""
        return {"wall_s": self.wall(), "process_s": self.process(), "elapsed_s": self.elapsed()}


def _warn_if_cut(what: str, stopped_by_time: bool, step: int, steps: int, max_minutes: float | None) -> bool:
    """``True`` (and one warning line) when the time budget stopped training before ``steps``."""
    cut = bool(stopped_by_time and step < steps)
    if cut:
        log.warning("%s: the time budget of %.1f min stopped training at step %d of %d planned; this run is cut "
                    "short and not comparable with a full one (raise max_minutes or set it to null)",
                    what, float(max_minutes or 0.0), step, steps)
    return cut


def _writer(out_dir: Path, enabled: bool):
    if not enabled:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(out_dir / "tb"))


# ---------------------------------------------------------------------------- videos
@torch.no_grad()
def side_by_side_video(model: ChunkFlowWorldModel, data: EpisodeFrames, episode: int, n_chunks: int,
                       path: Path | None = None, fps: int = 4) -> np.ndarray:
    """Autoregressive imagination of ``n_chunks`` chunks of held-out ``episode`` (position in
    ``data``) with its true actions, next to the real frames.

    Each video frame is ``[real cam 1 | imagined cam 1 | real cam 2 | imagined cam 2]`` at chunk
    boundaries. Returns ``uint8 (N, Hi, n_cam * 2 * Wi, 3)`` and writes an mp4 to ``path`` if given.
    """
    H = model.chunk_size
    T = int(data.lengths[episode])
    n = max(0, min(n_chunks, (T - 1) // H))
    state = model.init(data.obs_at(episode, 0).to(model.proprio_mean.device))
    frames = []
    for k in range(n + 1):
        real = torch.from_numpy(data.images[data.step_index(episode, k * H)])
        imag = to_uint8(state.frames[0]).cpu()
        cols = []
        for c in range(len(model.cameras)):
            cols += [real[3 * c: 3 * c + 3], imag[3 * c: 3 * c + 3]]
        frames.append(torch.cat(cols, dim=2).permute(1, 2, 0).numpy())
        if k < n:
            g = data.step_index(episode, k * H)
            a = torch.from_numpy(data.actions[g: g + H])[None].to(model.proprio_mean.device)
            state, _ = model.imagine(state, a)
    video = np.stack(frames)
    if path is not None:
        import imageio.v2 as imageio

        path.parent.mkdir(parents=True, exist_ok=True)
        big = video.repeat(2, axis=1).repeat(2, axis=2)  # 2x nearest upscale for viewing
        imageio.mimwrite(str(path), list(big), fps=fps, macro_block_size=1)
    return video


# ---------------------------------------------------------------------------- world model
def fit_world_model_stats(model: ChunkFlowWorldModel, data: EpisodeFrames) -> None:
    """Set the model's proprio / proprio-change stats from every window of ``data``."""
    eps, ts = data.window_starts(model.chunk_size)
    g = data.offsets[eps] + ts
    p = torch.from_numpy(data.proprio[g])
    d = torch.from_numpy(data.proprio[g + model.chunk_size]) - p
    model.set_norm_stats(p, d)


@torch.no_grad()
def one_chunk_psnr(model: ChunkFlowWorldModel, data: EpisodeFrames, n: int = 64, seed: int = 0) -> tuple[float, float]:
    """Quick held-out check: (PSNR of the model, PSNR of copy-last-frame) one chunk ahead, in dB,
    over ``n`` random windows (aggregate MSE)."""
    w = data.sample_windows(n, model.chunk_size, np.random.default_rng(seed))
    dev = model.proprio_mean.device
    res = model.sample_residual(to_unit(w.frames.to(dev)), w.proprio.to(dev), w.actions.to(dev))
    pred = (to_unit(w.frames.to(dev)) + res).clamp(-1, 1)
    tgt = to_unit(w.next_frames.to(dev))
    base = to_unit(w.frames.to(dev))

    def psnr(x):
        mse = ((x - tgt) / 2).pow(2).mean().clamp_min(1e-10)
        return float(-10 * torch.log10(mse))

    return psnr(pred), psnr(base)


def train_world_model(model: ChunkFlowWorldModel, model_config: dict, train: EpisodeFrames, out_dir: Path,
                      heldout: EpisodeFrames | None = None, steps: int = 2000, batch_size: int = 32,
                      lr: float = 1e-3, weight_decay: float = 1e-4, warmup: int = 50, grad_clip: float = 1.0,
                      max_minutes: float | None = None, log_every: int = 25, eval_every: int = 250,
                      checkpoint_every: int = 250, video_chunks: int = 8, resume: bool = True,
                      tensorboard: bool = True, progress: bool = True, seed: int = 0,
                      p_deterministic: float = 0.25, p_pure_noise: float = 0.25, budget_clock: str = "wall",
                      fit_stats: bool = True, lr_follows_budget: bool = True) -> dict:
    """Train ``model`` on chunk windows of ``train``; returns a report dict.

    ``model_config`` is the model's constructor arguments (saved in the checkpoint). Stats are fitted
    from ``train`` unless resuming or ``fit_stats=False`` (fine-tuning a trained model keeps its
    normalisation). ``max_minutes`` bounds wall-clock time (checkpoint at the end); the LR decays over
    it when it ends before ``steps`` unless ``lr_follows_budget=False`` (then over the steps only, and
    a run does not depend on the machine's speed).
    """
    out_dir = Path(out_dir)
    H = model.chunk_size

    def make_opt(m):
        return torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=weight_decay)

    resumed = _resume(out_dir, make_opt, model) if resume else None
    gen = torch.Generator().manual_seed(seed)
    if resumed is not None:
        model, opt, step, rng = resumed.model, resumed.opt, resumed.step, resumed.rng
        if (done := resumed.finished(steps, max_minutes)) is not None:
            log.info("world model in %s finished before (step %d): its report is returned unchanged", out_dir, step)
            return done
        resumed.restore_noise(gen, seed)
    else:
        if fit_stats:
            fit_world_model_stats(model, train)
        opt, step, rng = make_opt(model), 0, np.random.default_rng(seed)
    start_step = step
    writer = _writer(out_dir, tensorboard)
    before = resumed.progress if resumed is not None else {}
    clock = BudgetClock(budget_clock, before.get("clock"))
    model.train()
    hist: list[float] = list(before.get("recent", []))
    bar = tqdm(total=steps, initial=step, desc="train world model", disable=not progress, dynamic_ncols=True)
    stopped_by_time = False
    while step < steps:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, warmup,
                            clock.elapsed() / (60 * max_minutes) if max_minutes and lr_follows_budget else 0.0)
        w = train.sample_windows(batch_size, H, rng)
        out = model.loss(w.frames, w.proprio, w.actions, w.next_frames, w.next_proprio, generator=gen,
                         p_deterministic=p_deterministic, p_pure_noise=p_pure_noise)
        opt.zero_grad(set_to_none=True)
        out["loss"].backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        step += 1
        hist.append(float(out["loss"].detach()))
        bar.update(1)
        if step % log_every == 0:
            bar.set_postfix(loss=f"{np.mean(hist[-log_every:]):.5f}")
            if writer:
                writer.add_scalar("train/loss", float(out["loss"].detach()), step)
                writer.add_scalar("train/pixel_mse", float(out["pixel"]), step)
                writer.add_scalar("train/proprio_mse", float(out["proprio"]), step)
                writer.add_scalar("train/grad_norm", float(gn), step)
                writer.add_scalar("train/lr", opt.param_groups[0]["lr"], step)
        over = max_minutes is not None and clock.elapsed() > 60 * max_minutes
        if heldout is not None and writer and (step % eval_every == 0 or step == steps or over):
            model.eval()
            p_model, p_copy = one_chunk_psnr(model, heldout)
            writer.add_scalar("heldout/psnr_1chunk", p_model, step)
            writer.add_scalar("heldout/psnr_gain_over_copy", p_model - p_copy, step)
            vid = side_by_side_video(model, heldout, 0, video_chunks, out_dir / "videos" / f"step_{step:06d}.mp4")
            writer.add_images("heldout/real_vs_imagined", torch.from_numpy(vid).permute(0, 3, 1, 2), step)
            model.train()
        hist = hist[-log_every:]
        if step % checkpoint_every == 0 and not (step == steps or over):
            _save(model, model_config, opt, step, rng, out_dir, f"step_{step:06d}", gen,
                  {"recent": hist, "clock": clock.state()})
        if over:
            stopped_by_time = True
            break
    bar.close()
    if writer:
        writer.close()
    model.eval()
    cut = _warn_if_cut("world model", stopped_by_time, step, steps, max_minutes)
    report = {"steps": step, "steps_planned": steps, "cut_by_budget": cut,
              "precision": model.precision().as_dict(), "steps_this_run": step - start_step, "train_seconds": round(clock.wall(), 1),
              "train_cpu_seconds_per_thread": round(clock.process(), 1), "budget_clock": budget_clock,
              "final_loss": float(np.mean(hist[-log_every:])) if hist else None, "stopped_by_time": stopped_by_time,
              "resumed_from": start_step if resumed is not None else None,
              "parameters": sum(p.numel() for p in model.parameters()),
              "checkpoint": str(out_dir / "checkpoints" / "last")}
    if heldout is not None:
        p_model, p_copy = one_chunk_psnr(model, heldout)
        report.update(heldout_psnr_1chunk=p_model, heldout_psnr_copy_1chunk=p_copy)
    if step > start_step:
        _save(model, model_config, opt, step, rng, out_dir, f"step_{step:06d}", gen,
              {"recent": hist, "clock": clock.state()}, report=report)
    return report


# ---------------------------------------------------------------------------- critic
def _augment(frames: torch.Tensor, rng: np.random.Generator, shift: int = 4, p_blur: float = 0.3) -> torch.Tensor:
    """Random shift (pad + crop) and, for a fraction ``p_blur`` of the batch, a 3x3 box blur (so
    blurrier imagined frames are scored like real ones)."""
    b, c, h, w = frames.shape
    x = frames.float()
    if shift:
        pad = torch.nn.functional.pad(x, (shift,) * 4, mode="replicate")
        dx, dy = rng.integers(0, 2 * shift + 1, 2)
        x = pad[:, :, dy: dy + h, dx: dx + w]
    if p_blur > 0:
        blur = torch.nn.functional.avg_pool2d(x, 3, 1, 1, count_include_pad=False)
        m = torch.from_numpy(rng.random(b) < p_blur)[:, None, None, None]
        x = torch.where(m, blur, x)
    return x.round().clamp(0, 255).to(torch.uint8)


@torch.no_grad()
def imagined_frame_bank(world_model: ChunkFlowWorldModel, data: EpisodeFrames, size: int, max_chunks: int,
                        rng: np.random.Generator, batch_size: int = 64, progress: bool = True
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """World-model versions of stored frames, to train the critic on what it will score in imagination.

    For ``size`` random steps ``t`` (with ``t >= H``) of ``data``, the model imagines ``k`` chunks
    (``k`` uniform in ``1..max_chunks``, at most ``t // H``) from the real frame at ``t - k H`` with the
    episode's true actions; the result stands in for the real frame at ``t`` and takes its labels
    (as in WMRL's and WoVR's point that rewards must be computed on imagined, not real, frames).

    Returns:
        ``images uint8 (size, 3 * n_cam, Hi, Wi)`` in ``data.cameras`` order, ``proprio float32
        (size, D_s)`` (the model's prediction) and ``flat_index int64 (size,)`` (the real step each
        replaces, aligned with ``data.images``).

    Raises:
        ValueError: the model's cameras differ from ``data.cameras`` or no episode is longer than H.
    """
    if list(world_model.cameras) != list(data.cameras):
        raise ValueError(f"world model cameras {world_model.cameras} differ from the critic's {data.cameras}; "
                         "train both on the same cameras in the same order")
    H = world_model.chunk_size
    long = np.nonzero(data.lengths > H)[0]
    if len(long) == 0:
        raise ValueError(f"no episode is longer than the chunk length H={H}")
    ep = rng.choice(long, size=size)
    t = (rng.random(size) * (data.lengths[ep] - H)).astype(np.int64) + H   # H .. T-1
    k = np.minimum(rng.integers(1, max_chunks + 1, size=size), t // H)
    dev = world_model.proprio_mean.device
    images = np.empty((size, *data.images.shape[1:]), dtype=np.uint8)
    proprio = np.empty((size, data.proprio.shape[1]), dtype=np.float32)
    order = np.argsort(k, kind="stable")
    bar = tqdm(total=size, desc="imagined frames for the critic", disable=not progress, dynamic_ncols=True)
    for i in range(0, size, batch_size):
        sel = order[i:i + batch_size]
        kk = int(k[sel].max())
        g0 = data.offsets[ep[sel]] + t[sel] - k[sel] * H
        state = WMState(to_unit(torch.from_numpy(data.images[g0]).to(dev)), torch.from_numpy(data.proprio[g0]).to(dev),
                        [data.instructions[e] for e in ep[sel]])
        for c in range(kk):
            live = torch.from_numpy(k[sel] > c)   # slots still to roll; the others keep their frame
            a_idx = g0[live.numpy()][:, None] + c * H + np.arange(H)[None]
            sub, _ = world_model.imagine(state.index(live), torch.from_numpy(data.actions[a_idx]).to(dev))
            state.frames[live], state.proprio[live] = sub.frames, sub.proprio
        images[sel] = to_uint8(state.frames).cpu().numpy()
        proprio[sel] = state.proprio.float().cpu().numpy()
        bar.update(len(sel))
    bar.close()
    return images, proprio, data.offsets[ep] + t


def train_critic(critic: ProgressValueCritic, critic_config: dict, train: EpisodeFrames, out_dir: Path,
                 heldout: EpisodeFrames | None = None, steps: int = 1500, batch_size: int = 64, lr: float = 1e-3,
                 weight_decay: float = 1e-4, warmup: int = 50, success_tail: int = 10, fail_progress: float = 0.3,
                 max_minutes: float | None = None, log_every: int = 25, eval_every: int = 250,
                 checkpoint_every: int = 250, resume: bool = True, tensorboard: bool = True,
                 progress: bool = True, seed: int = 0, augment: bool = True, budget_clock: str = "wall",
                 imagined: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
                 imagined_fraction: float = 0.0, fit_stats: bool = True, lr_follows_budget: bool = True) -> dict:
    """Train the progress-value critic on every frame of ``train`` (targets from
    :meth:`EpisodeFrames.frame_labels`); returns a report dict (held-out AUROC when given).

    ``imagined``: a bank from :func:`imagined_frame_bank`; a fraction ``imagined_fraction`` of every
    batch is drawn from it (imagined frames with the labels of the real frames they replace)."""
    from worldmodels.evaluate import critic_auroc

    out_dir = Path(out_dir)
    prog_all, succ_all = train.frame_labels(success_tail, fail_progress)
    step_ep = np.repeat(np.arange(train.num_episodes), train.lengths)
    n_pos = float(succ_all.sum())
    pos_weight = float(min(20.0, (len(succ_all) - n_pos) / max(n_pos, 1.0)))

    def make_opt(m):
        return torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=weight_decay)

    resumed = _resume(out_dir, make_opt, critic) if resume else None
    if resumed is not None:
        critic, opt, step, rng = resumed.model, resumed.opt, resumed.step, resumed.rng
        if (done := resumed.finished(steps, max_minutes)) is not None:
            log.info("critic in %s finished before (step %d): its report is returned unchanged", out_dir, step)
            return done
        resumed.restore_noise(None, seed)
    else:
        if critic.use_proprio and fit_stats:
            critic.set_norm_stats(torch.from_numpy(train.proprio))
        opt, step, rng = make_opt(critic), 0, np.random.default_rng(seed)
    start_step = step
    writer = _writer(out_dir, tensorboard)
    before = resumed.progress if resumed is not None else {}
    clock = BudgetClock(budget_clock, before.get("clock"))
    critic.train()
    hist: list[float] = list(before.get("recent", []))
    bar = tqdm(total=steps, initial=step, desc="train critic", disable=not progress, dynamic_ncols=True)
    stopped_by_time = False
    while step < steps:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, warmup,
                            clock.elapsed() / (60 * max_minutes) if max_minutes and lr_follows_budget else 0.0)
        n_im = int(round(imagined_fraction * batch_size)) if imagined is not None else 0
        idx = rng.integers(0, len(prog_all), size=batch_size - n_im)
        frames_np, prop_np = train.images[idx], train.proprio[idx]
        if n_im:
            j = rng.integers(0, len(imagined[2]), size=n_im)
            idx = np.concatenate([idx, imagined[2][j]])
            frames_np = np.concatenate([frames_np, imagined[0][j]])
            prop_np = np.concatenate([prop_np, imagined[1][j]])
        frames = torch.from_numpy(frames_np)
        if augment:
            frames = _augment(frames, rng)
        texts = [train.instructions[e] for e in step_ep[idx]]
        out = critic.loss(frames, torch.from_numpy(prop_np), texts,
                          torch.from_numpy(prog_all[idx]), torch.from_numpy(succ_all[idx]), pos_weight=pos_weight)
        opt.zero_grad(set_to_none=True)
        out["loss"].backward()
        torch.nn.utils.clip_grad_norm_(critic.parameters(), 1.0)
        opt.step()
        step += 1
        hist.append(float(out["loss"].detach()))
        bar.update(1)
        if step % log_every == 0:
            bar.set_postfix(loss=f"{np.mean(hist[-log_every:]):.4f}")
            if writer:
                for k in ("loss", "progress", "success"):
                    writer.add_scalar(f"train/{k}", float(out[k].detach()), step)
                writer.add_scalar("train/lr", opt.param_groups[0]["lr"], step)
        over = max_minutes is not None and clock.elapsed() > 60 * max_minutes
        if heldout is not None and writer and (step % eval_every == 0 or step == steps or over):
            critic.eval()
            au = critic_auroc(critic, heldout)
            if au["auroc"] is not None:
                writer.add_scalar("heldout/auroc", au["auroc"], step)
            critic.train()
        hist = hist[-log_every:]
        if (step % checkpoint_every == 0) and not (step == steps or over):
            _save(critic, critic_config, opt, step, rng, out_dir, f"step_{step:06d}", None,
                  {"recent": hist, "clock": clock.state()})
        if over:
            stopped_by_time = True
            break
    bar.close()
    if writer:
        writer.close()
    critic.eval()
    cut = _warn_if_cut("critic", stopped_by_time, step, steps, max_minutes)
    report = {"steps": step, "steps_planned": steps, "cut_by_budget": cut,
              "precision": Precision.fixed_fp32(next(critic.parameters()).device,
                                                "critic: fp32 (it has no bf16 autocast path)").as_dict(),
              "steps_this_run": step - start_step, "train_seconds": round(clock.wall(), 1),
              "train_cpu_seconds_per_thread": round(clock.process(), 1), "budget_clock": budget_clock,
              "final_loss": float(np.mean(hist[-log_every:])) if hist else None, "stopped_by_time": stopped_by_time,
              "resumed_from": start_step if resumed is not None else None, "pos_weight": pos_weight,
              "parameters": sum(p.numel() for p in critic.parameters()),
              "checkpoint": str(out_dir / "checkpoints" / "last")}
    if heldout is not None:
        report["heldout"] = critic_auroc(critic, heldout)
    if step > start_step:
        _save(critic, critic_config, opt, step, rng, out_dir, f"step_{step:06d}", None,
              {"recent": hist, "clock": clock.state()}, report=report)
    return report
