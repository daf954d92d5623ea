"""World-model and progress-critic training as tasks of the one trainer (``wmrl.kernel.trainer``), called
by ``wmrl train-worldmodel`` / ``wmrl train-critic``, the pipeline and (injected through
:class:`RefreshFineTunes`) the world-model refresher.

:class:`WorldModelTask` and :class:`CriticTask` say how batches are drawn, what the loss is and what
the held-out evaluation logs; the trainer owns AdamW, warm-up + cosine LR, the ``max_minutes``
budget, TensorBoard (``out_dir/tb``), the progress bar, checkpoints (``out_dir/checkpoints/step_<n>``
and ``.../last``: ``config.yaml`` + ``model.safetensors`` + optimizer (``opt/<index>/<key>``) and RNG
state in ``extra.safetensors`` + step, window generator and progress in ``meta.json``) and exact resume.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from wmrl.kernel.precision import Precision
from wmrl.kernel.trainer import BudgetClock, TrainConfig, Trainer, TrainTask  # noqa: F401 (BudgetClock: re-export)
from worldmodels.critic import ProgressValueCritic
from worldmodels.data import EpisodeFrames, heldout_episodes
from worldmodels.evaluate import one_chunk_psnr, side_by_side_video  # noqa: F401 (re-exported)
from worldmodels.video_wm import ChunkFlowWorldModel, WMState, to_uint8, to_unit

log = logging.getLogger("wmrl.worldmodels")


# ---------------------------------------------------------------------------- tasks
class _WindowTask(TrainTask):
    """Shared part of the world-model and critic tasks: a numpy window generator ``rng`` (saved in
    ``meta.json`` as ``rng``), the model's constructor ``config`` saved with every checkpoint."""

    def __init__(self, model, config: dict, rng: np.random.Generator):
        self.module, self.config, self.rng = model, config, rng

    def checkpoint_config(self):
        return self.config

    def save_meta(self):
        return {"rng": self.rng.bit_generator.state}

    def load_meta(self, meta):
        self.rng.bit_generator.state = meta["rng"]


def _fit(task: TrainTask, out_dir: Path, max_minutes: float | None, **cfg) -> Trainer:
    """Run ``task`` on the one trainer; ``max_minutes`` (``None``: no budget) becomes ``budget_s``."""
    budget_s = None if max_minutes is None else 60 * max_minutes
    return Trainer(task, TrainConfig(budget_s=budget_s, **cfg), out_dir).run()


def _common_report(tr: Trainer, budget_clock: str) -> dict:
    hist = tr.recent
    return {"steps": tr.step, "steps_planned": tr.cfg.steps, "cut_by_budget": tr.cut,
            "steps_this_run": tr.step - tr.start_step, "train_seconds": round(tr.clock.wall(), 1),
            "train_cpu_seconds_per_thread": round(tr.clock.process(), 1), "budget_clock": budget_clock,
            "final_loss": float(np.mean(hist)) if hist else None, "stopped_by_time": tr.over,
            "resumed_from": tr.start_step if tr.resumed is not None else None,
            "data_parallel": tr.parallel(int(getattr(tr.task, "batch_size", 0)))}


# ---------------------------------------------------------------------------- world model
def fit_world_model_stats(model: ChunkFlowWorldModel, data: EpisodeFrames) -> None:
    """Set the model's proprio / proprio-change stats from every window of ``data``."""
    eps, ts = data.window_starts(model.chunk_size)
    g = data.offsets[eps] + ts
    p = torch.from_numpy(data.proprio[g])
    d = torch.from_numpy(data.proprio[g + model.chunk_size]) - p
    model.set_norm_stats(p, d)


class WorldModelTask(_WindowTask):
    """The world model's :class:`wmrl.kernel.trainer.TrainTask`: random chunk windows of ``data`` (numpy
    ``rng``), ``model.loss`` with the torch noise generator ``gen``; held-out PSNR and real-vs-imagined
    videos as its evaluation."""

    name = "world model"

    def __init__(self, model, config, data, heldout, rng, gen, batch_size: int, p_deterministic: float,
                 p_pure_noise: float, video_chunks: int, out_dir: Path, fit_stats: bool, dynamics: dict | None = None,
                 grasp: dict | None = None, frames: dict | None = None):
        super().__init__(model, config, rng)
        self.data, self.heldout, self.gen, self.batch_size = data, heldout, gen, batch_size
        self.p_det, self.p_noise, self.video_chunks, self.out_dir = p_deterministic, p_pure_noise, video_chunks, out_dir
        self.fit_stats = fit_stats
        self.dyn = None if model.dynamics is None else {**DYNAMICS_TRAIN, **(dynamics or {})}
        self.grasp = None if model.grasp is None else {**GRASP_TRAIN, **(grasp or {})}
        self.frames = {**FRAMES_TRAIN, **(frames or {})}
        unknown = set(frames or {}) - set(FRAMES_TRAIN)
        if unknown:
            raise ValueError(f"unknown world-model frame training options {sorted(unknown)}; known: {sorted(FRAMES_TRAIN)}")
        self._switches = None

    def fresh_start(self):
        if self.fit_stats:
            fit_world_model_stats(self.module, self.data)

    def batches(self, start, stop):
        H = self.module.chunk_size
        for _ in range(start, stop):
            eps, ts = self.data.window_starts(H)
            pick = self.rng.integers(0, len(eps), size=self.batch_size)
            ep, t = eps[pick], ts[pick]
            w = self.data.windows(ep, t, H)
            cond = self.frame_conditioning(ep, t) if self.module.anchor_frames else None
            if self.dyn is None:
                yield w, None, None, cond
                continue
            path = self.data.sample_paths(int(self.dyn["batch_size"]), H * int(self.dyn["unroll_chunks"]), self.rng)
            k = self.module.dynamics.k
            path["mask"] = (torch.rand(k, int(self.dyn["batch_size"]), generator=self.gen) < float(self.dyn["bootstrap"])).float()
            yield w, path, (None if self.grasp is None else self.grasp_windows()), cond

    def frame_conditioning(self, ep: np.ndarray, t: np.ndarray) -> dict:
        """For a model with ``anchor``: what each window's frames are conditioned on, as inside an
        imagined rollout (:data:`FRAMES_TRAIN`). The anchor is a real frame of the same episode at or
        before the window (its first step with probability ``anchor_first``, else up to
        ``anchor_back_chunks`` chunks back). For an ``own_fraction`` of the windows that start a chunk
        or more into their episode, the start frames and proprio are the model's own, imagined
        1..``own_chunks`` chunks from the real state that much earlier (which is then their anchor),
        so the model learns to restore from the anchor what its own frames have lost (exposure bias:
        trained only on real starts, the residual model blurs further every chunk). Returns
        ``{"anchor_u8", "anchor_proprio", "frames" (float32 in [-1, 1] or None), "proprio" (or None)}``."""
        H, d, c = self.module.chunk_size, self.data, self.frames
        ta = self._anchor_steps(t, int(c["anchor_back_chunks"]), float(c["anchor_first"]))
        own, k = self._imagined_depths(t, float(c["own_fraction"]), int(c["own_chunks"]))
        frames = proprio = None
        if own.any():
            sel = np.flatnonzero(k > 0)
            ta[sel] = t[sel] - k[sel] * H
            st = self._imagine_eval(ep[sel], t[sel], k[sel])
            frames = to_unit(torch.from_numpy(d.images[d.offsets[ep] + t]))
            proprio = torch.from_numpy(d.proprio[d.offsets[ep] + t]).float()
            frames[torch.from_numpy(sel)] = st.frames.float().cpu()
            proprio[torch.from_numpy(sel)] = st.proprio.float().cpu()
        g = d.offsets[ep] + ta
        return {"anchor_u8": torch.from_numpy(d.images[g]), "anchor_proprio": torch.from_numpy(d.proprio[g]).float(),
                "frames": frames, "proprio": proprio}

    def grasp_windows(self):
        """The finger-gap head's batch: a ``switch_fraction`` of windows in which the fingers move or
        the commanded gripper switches (where the gap is decided), the rest drawn from every window.
        For an ``imagined_fraction`` of the windows (those after the first chunk of their episode) the
        start (frames and proprio) is where the model's own rollout of 1..``imagined_chunks`` chunks
        from the real state that much earlier puts it, as inside an imagined rollout (a head trained
        on real frames only is misled by imagined ones: docs/measurements.md). Returns ``(windows, anchor frames,
        anchor proprio)``: for an anchor head, the frames and proprio at an earlier step of the same episode
        (its first with probability ``anchor_first``, else up to ``anchor_back_chunks`` chunks back; for an
        imagined start, the real step its rollout began from), else ``None``."""
        H, n = self.module.chunk_size, int(self.grasp["batch_size"])
        d = self.data
        if self._switches is None:
            e0, t0 = d.window_starts(H)
            g0, g1 = d.proprio[d.offsets[e0] + t0], d.proprio[d.offsets[e0] + t0 + H]
            moving = np.abs((g1[:, 7] - g1[:, 8]) - (g0[:, 7] - g0[:, 8])) > float(self.grasp["moving_m"])
            se, st = d.gripper_switch_starts(H)
            self._switches = (np.concatenate([e0[moving], se]), np.concatenate([t0[moving], st]))
        eps, ts = d.window_starts(H)
        se, st = self._switches
        n_sw = int(round(n * float(self.grasp["switch_fraction"]))) if len(se) else 0
        a = self.rng.integers(0, max(len(se), 1), size=n_sw)
        b = self.rng.integers(0, len(eps), size=n - n_sw)
        ep, t = np.concatenate([se[a], eps[b]]), np.concatenate([st[a], ts[b]])
        w = d.windows(ep, t, H)
        imagined, k = self._imagined_depths(t, float(self.grasp["imagined_fraction"]), int(self.grasp["imagined_chunks"]))
        if imagined.any():
            sel = np.flatnonzero(k > 0)
            w.frames, w.proprio, w.prev_proprio = w.frames.clone(), w.proprio.clone(), w.prev_proprio.clone()
            w.frames[sel], w.proprio[sel], w.prev_proprio[sel] = self._imagined_start(ep[sel], t[sel], k[sel])
        w.frames = _augment(w.frames, self.rng, shift=int(self.grasp["shift_px"]), p_blur=float(self.grasp["p_blur"]))
        anchor = anchor_p = None
        if self.module.grasp_anchor_camera is not None:
            ta = self._anchor_steps(t, int(self.grasp["anchor_back_chunks"]), float(self.grasp["anchor_first"]))
            if imagined.any():   # an imagined start's anchor is the real frame its rollout began from
                ta = np.where(imagined, t - k * H, ta)
            reprojected = self.module.reproject is not None and self.module.grasp_anchor_camera == self.module.reproject_camera
            anchor = _augment(torch.from_numpy(d.images[d.offsets[ep] + ta]), self.rng,
                              shift=0 if reprojected else int(self.grasp["shift_px"]), p_blur=0.0)
            anchor_p = torch.from_numpy(d.proprio[d.offsets[ep] + ta]).float()
        return w, anchor, anchor_p

    def _anchor_steps(self, t: np.ndarray, back_chunks: int, p_first: float) -> np.ndarray:
        """An anchor step for each window start ``t`` of the same episode: its first step with
        probability ``p_first``, else uniform in the ``back_chunks`` chunks at or before ``t``."""
        back = np.minimum(t, back_chunks * self.module.chunk_size)
        ta = t - (self.rng.random(len(t)) * (back + 1)).astype(np.int64)
        return np.where(self.rng.random(len(t)) < p_first, 0, ta)

    def _imagined_depths(self, t: np.ndarray, fraction: float, max_chunks: int) -> tuple[np.ndarray, np.ndarray]:
        """Which window starts ``t`` (a ``fraction`` of those a chunk or more into their episode) begin
        from the model's own rollout, and how many chunks deep (``1..max_chunks``, at most ``t // H``;
        0 for the others): ``(bool mask, int64 k)``. Draws ``k`` only when some window is picked."""
        H, n = self.module.chunk_size, len(t)
        picked = (self.rng.random(n) < fraction) & (t >= H)
        k = np.zeros(n, dtype=np.int64)
        if picked.any():
            most = np.minimum(t // H, max_chunks)
            k = np.where(picked, 1 + (self.rng.random(n) * most).astype(np.int64), 0)
        return picked, k

    @torch.no_grad()
    def _imagine_eval(self, ep: np.ndarray, t: np.ndarray, chunks: np.ndarray) -> WMState:
        """:func:`imagine_from_real` with ``chunks`` per window, the model in eval mode (its
        deterministic path) and back in its training mode after."""
        m = self.module
        was = m.training
        m.eval()
        try:
            return imagine_from_real(m, self.data, ep, t, chunks)
        finally:
            m.train(was)

    def _imagined_start(self, ep: np.ndarray, t: np.ndarray, chunks: np.ndarray):
        """The state at steps ``t`` as an imagined rollout reaches it (:meth:`_imagine_eval`). Returns
        ``(frames uint8 (B, 3 * n_cam, Hi, Wi), proprio, prev_proprio (B, D_s))``."""
        state = self._imagine_eval(ep, t, chunks)
        prev = state.proprio if state.prev_proprio is None else state.prev_proprio
        return to_uint8(state.frames), state.proprio.float(), prev.float()

    def shard(self, batch, rank, world):
        """Under torchrun each of the three sub-batches is split on its own (they have their own
        sizes); the dynamics' bootstrap mask ``(K, B)`` is split on its batch dimension. The masked
        dynamics loss is a ratio of sums, so its rank mean is close to, not equal to, the one-process
        loss; the frame loss is an exact mean."""
        from wmrl.kernel.distributed import shard

        w, path, gw, cond = batch
        w = shard(w, rank, world, "world-model window batch")
        if cond is not None:
            cond = shard({k: v for k, v in cond.items() if v is not None}, rank, world, "frame conditioning batch")
        if path is not None:
            mask = path.get("mask")
            path = shard({k: v for k, v in path.items() if k != "mask"}, rank, world, "dynamics path batch")
            if mask is not None:
                path["mask"] = shard(mask.T.contiguous(), rank, world, "dynamics mask").T
        if gw is not None:
            gw = shard(gw, rank, world, "finger-gap batch")
        return w, path, gw, cond

    def loss(self, batch):
        w, path, gw, cond = batch   # windows; the dynamics' proprio paths, the grasp head's windows, the anchors, or None
        cond = cond or {}
        proprio = w.proprio if cond.get("proprio") is None else cond["proprio"]
        out = self.module.loss(w.frames, proprio, w.actions, w.next_frames, w.next_proprio, generator=self.gen,
                               p_deterministic=self.p_det, p_pure_noise=self.p_noise, anchor_u8=cond.get("anchor_u8"),
                               anchor_proprio=cond.get("anchor_proprio"), frames=cond.get("frames"))
        if path is not None:
            d_loss, d_metrics = self.module.dynamics_loss(path)
            out = {**out, "loss": out["loss"] + float(self.dyn["weight"]) * d_loss, "proprio": d_loss.detach(),
                   "dynamics_end_pos_err_cm": d_metrics["end_pos_err_cm"]}
        if gw is not None:
            gw, anchor, anchor_p = gw
            g_loss = self.module.grasp_loss(gw.frames, gw.proprio, gw.prev_proprio, gw.actions, gw.next_proprio, anchor,
                                            anchor_p)
            out = {**out, "loss": out["loss"] + float(self.grasp["weight"]) * g_loss, "grasp": g_loss.detach()}
        return out["loss"], out

    def scalars(self, out, info):
        sc = {"train/loss": float(out["loss"].detach()), "train/pixel_mse": float(out["pixel"]),
              "train/proprio_mse": float(out["proprio"]), "train/grad_norm": info["grad_norm"], "train/lr": info["lr"]}
        if "dynamics_end_pos_err_cm" in out:
            sc["train/dynamics_end_pos_err_cm"] = out["dynamics_end_pos_err_cm"]
        if "grasp" in out:
            sc["train/grasp_loss"] = float(out["grasp"])
        return sc

    def evaluate(self, step, writer):
        if self.heldout is None:
            return
        model = self.module
        model.eval()
        p_model, p_copy = one_chunk_psnr(model, self.heldout)
        writer.add_scalar("heldout/psnr_1chunk", p_model, step)
        writer.add_scalar("heldout/psnr_gain_over_copy", p_model - p_copy, step)
        vid = side_by_side_video(model, self.heldout, 0, self.video_chunks, self.out_dir / "videos" / f"step_{step:06d}.mp4")
        writer.add_images("heldout/real_vs_imagined", torch.from_numpy(vid).permute(0, 3, 1, 2), step)
        model.train()

    def streams(self):
        return {"noise": self.gen}


#: training of a world model's dynamics ensemble (``dynamics`` of :func:`train_world_model`): proprio
#: paths per step, their length in chunks (the unrolled loss), each member's bootstrap fraction, and
#: the weight of its loss beside the frames' (its loss is in cm^2-like units, see ProprioDynamics.loss)
DYNAMICS_TRAIN = {"batch_size": 64, "unroll_chunks": 4, "bootstrap": 0.8, "weight": 0.1}

#: what a world model with ``anchor`` is conditioned on in training (:meth:`WorldModelTask.frame_conditioning`):
#: the anchor's step (the episode's first with probability ``anchor_first``, else up to ``anchor_back_chunks``
#: chunks back) and the fraction of windows starting from the model's own frames 1..``own_chunks`` chunks deep
FRAMES_TRAIN = {"anchor_first": 0.5, "anchor_back_chunks": 12, "own_fraction": 0.25, "own_chunks": 3}

#: training of a world model's finger-gap head (``grasp`` of :func:`train_world_model`): windows per
#: step, the fraction of them in which the fingers move more than ``moving_m`` or the commanded
#: gripper switches, the fraction whose start frame is the model's own prediction, the anchor's
#: choice (:meth:`WorldModelTask.grasp_windows`), the frames' random shift (px) and blur fraction
#: (:func:`_augment`), and the weight of its loss (smooth-L1 in 5 mm units)
GRASP_TRAIN = {"batch_size": 64, "switch_fraction": 0.5, "moving_m": 0.005, "imagined_fraction": 0.5, "imagined_chunks": 3,
               "anchor_first": 0.5, "anchor_back_chunks": 12, "shift_px": 4, "p_blur": 0.3, "weight": 0.1}


def train_world_model(model: ChunkFlowWorldModel, model_config: dict, train: EpisodeFrames, out_dir: Path,
                      heldout: EpisodeFrames | None = None, steps: int = 2000, batch_size: int = 32,
                      lr: float = 1e-3, weight_decay: float = 1e-4, warmup: int = 50, grad_clip: float = 1.0,
                      max_minutes: float | None = None, log_every: int = 25, eval_every: int = 250,
                      checkpoint_every: int = 250, video_chunks: int = 8, resume: bool = True,
                      tensorboard: bool = True, progress: bool = True, seed: int = 0,
                      p_deterministic: float = 0.25, p_pure_noise: float = 0.25, budget_clock: str = "wall",
                      fit_stats: bool = True, lr_follows_budget: bool = True, dynamics: dict | None = None,
                      grasp: dict | None = None, frames: dict | None = None) -> dict:
    """Train ``model`` on chunk windows of ``train`` with the one trainer; returns a report dict.

    ``model_config`` is the model's constructor arguments (saved in the checkpoint). Stats are fitted
    from ``train`` unless resuming or ``fit_stats=False`` (fine-tuning a trained model keeps its
    normalisation). ``max_minutes`` bounds the training time (checkpoint at the end); the LR decays over
    it when it ends before ``steps`` unless ``lr_follows_budget=False`` (then over the steps only, and
    a run does not depend on the machine's speed). ``dynamics`` overrides :data:`DYNAMICS_TRAIN` for
    a model with a dynamics ensemble (each step then also draws proprio paths), ``grasp``
    :data:`GRASP_TRAIN` for one with a finger-gap head (each step then also draws its windows), ``frames``
    :data:`FRAMES_TRAIN` for one with ``anchor`` (its anchors and own-frame starts). Resume is exact (``resume=True``, from
    ``out_dir/checkpoints/last``); a finished run returns its report unchanged.

    Raises:
        RuntimeError: ``last`` holds another architecture.
    """
    out_dir = Path(out_dir)
    task = WorldModelTask(model, model_config, train, heldout, np.random.default_rng(seed),
                          torch.Generator().manual_seed(seed), batch_size, p_deterministic, p_pure_noise,
                          video_chunks, out_dir, fit_stats, dynamics, grasp, frames)
    tr = _fit(task, out_dir, max_minutes, steps=steps, lr=lr, weight_decay=weight_decay, warmup=warmup,
              grad_clip=grad_clip, log_every=log_every, eval_every=eval_every, ckpt_every=checkpoint_every,
              budget_clock=budget_clock, lr_follows_budget=lr_follows_budget, resume=resume, tensorboard=tensorboard,
              progress=progress, seed=seed, desc="train world model")
    if tr.finished is not None:
        return tr.finished
    report = {**_common_report(tr, budget_clock), "precision": model.precision().as_dict(),
              "parameters": sum(p.numel() for p in model.parameters()),
              "checkpoint": str(out_dir / "checkpoints" / "last")}
    if heldout is not None:
        p_model, p_copy = one_chunk_psnr(model, heldout)
        report.update(heldout_psnr_1chunk=p_model, heldout_psnr_copy_1chunk=p_copy)
    tr.finish(report, save=tr.step > tr.start_step)
    return report

def retrain_grasp_head(model: ChunkFlowWorldModel, model_config: dict, train: EpisodeFrames, steps: int = 700,
                       head: dict | None = None, grasp: dict | None = None, lr: float = 1e-3, seed: int = 0,
                       progress: bool = True) -> tuple[ChunkFlowWorldModel, dict]:
    """A copy of a trained world model with a new finger-gap head (``worldmodels.grasp.GraspHead``)
    trained alone on ``train``; the dynamics, frames and statistics stay as they are (frozen), so two
    heads can be compared on one world model. Each step draws the head's windows as
    :func:`train_world_model` does (:meth:`WorldModelTask.grasp_windows`); AdamW with a one-cycle LR.

    Args:
        model: a world model with ``dynamics`` and a ``grasp`` head (not changed).
        model_config: its constructor arguments (the checkpoint's ``config.yaml``).
        head: overrides of the head's settings (``model_config["grasp"]``), e.g. ``{"wrist": False}``.
        grasp: overrides of :data:`GRASP_TRAIN` (e.g. ``imagined_chunks``).

    Returns:
        ``(new model (eval mode), its constructor arguments)``.

    Raises:
        ValueError: a model without a grasp head, or head settings the head refuses.
    """
    import copy

    if model.grasp is None or model_config.get("grasp") is None:
        raise ValueError("retrain_grasp_head needs a world model with a grasp head (grasp=...)")
    cfg = copy.deepcopy(model_config)
    cfg["grasp"] = {**cfg["grasp"], **(head or {})}
    torch.manual_seed(seed)
    new = ChunkFlowWorldModel(**{k: v for k, v in cfg.items() if k != "_target_"})
    missing, unexpected = new.load_state_dict({k: v for k, v in model.state_dict().items()
                                               if not k.startswith("grasp.")}, strict=False)
    if unexpected or any(not k.startswith("grasp.") for k in missing):
        raise ValueError(f"the world model's weights do not fit its config: missing {missing}, unexpected {unexpected}")
    new.eval()
    for p in new.parameters():
        p.requires_grad_(False)
    params = list(new.grasp.parameters())
    for p in params:
        p.requires_grad_(True)
    # only the head's windows are drawn (grasp_windows): the frame-batch settings are not used
    task = WorldModelTask(new, cfg, train, heldout=None, rng=np.random.default_rng(seed),
                          gen=torch.Generator().manual_seed(seed), batch_size=1, p_deterministic=0.0,
                          p_pure_noise=0.0, video_chunks=0, out_dir=Path("."), fit_stats=False, grasp=grasp)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=max(int(steps), 1), pct_start=0.05)
    bar = tqdm(range(int(steps)), desc="retrain grasp head", disable=not progress)
    for _ in bar:
        w, anchor, anchor_p = task.grasp_windows()
        new.grasp.train()
        loss = new.grasp_loss(w.frames, w.proprio, w.prev_proprio, w.actions, w.next_proprio, anchor, anchor_p)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        new.grasp.eval()
        bar.set_postfix(loss=f"{float(loss.detach()):.3f}")
    for p in params:
        p.requires_grad_(False)
    return new, cfg



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
@torch.no_grad()
def imagine_from_real(world_model: ChunkFlowWorldModel, data: EpisodeFrames, ep: np.ndarray, t: np.ndarray,
                      k: np.ndarray) -> WMState:
    """The states at steps ``t`` of episode positions ``ep`` as imagination reaches them: ``k[i]``
    chunks imagined from the real state ``k[i] * H`` steps earlier with the recorded actions (``k = 0``:
    the real state; int arrays of one length ``B``, ``t >= k * H``). The model's own mode is used
    (call it in eval mode for the deterministic path)."""
    H, dev = world_model.chunk_size, world_model.proprio_mean.device
    t0 = t - k * H
    g0 = data.offsets[ep] + t0
    state = WMState(to_unit(torch.from_numpy(data.images[g0]).to(dev)), torch.from_numpy(data.proprio[g0]).to(dev),
                    [data.instructions[e] for e in ep], prev_proprio=data.proprio_before(ep, t0).to(dev))
    for c in range(int(k.max()) if len(k) else 0):
        live = torch.from_numpy(k > c)   # slots still to roll; the others keep their state
        a_idx = g0[live.numpy()][:, None] + c * H + np.arange(H)[None]
        sub, _ = world_model.imagine(state.index(live), torch.from_numpy(data.actions[a_idx]).to(dev))
        state.assign(live, sub)
    return state


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
        state = imagine_from_real(world_model, data, ep[sel], t[sel], k[sel])
        images[sel] = to_uint8(state.frames).cpu().numpy()
        proprio[sel] = state.proprio.float().cpu().numpy()
        bar.update(len(sel))
    bar.close()
    return images, proprio, data.offsets[ep] + t


class CriticTask(_WindowTask):
    """The critic's :class:`wmrl.kernel.trainer.TrainTask`: random frames of ``data`` (and of an
    imagined bank), shift/blur augmentation, ``critic.loss``; held-out AUROC as its evaluation."""

    name = "critic"

    def __init__(self, critic, config, data, heldout, rng, batch_size: int, success_tail: int,
                 fail_progress: float, augment: bool, imagined, imagined_fraction: float, fit_stats: bool):
        super().__init__(critic, config, rng)
        self.data, self.heldout, self.batch_size, self.augment = data, heldout, batch_size, augment
        self.imagined, self.imagined_fraction, self.fit_stats = imagined, imagined_fraction, fit_stats
        self.prog, self.succ = data.frame_labels(success_tail, fail_progress)
        self.step_ep = np.repeat(np.arange(data.num_episodes), data.lengths)
        n_pos = float(self.succ.sum())
        self.pos_weight = float(min(20.0, (len(self.succ) - n_pos) / max(n_pos, 1.0)))

    def fresh_start(self):
        if self.module.use_proprio and self.fit_stats:
            self.module.set_norm_stats(torch.from_numpy(self.data.proprio))

    def _batch(self):
        data, rng, im = self.data, self.rng, self.imagined
        n_im = int(round(self.imagined_fraction * self.batch_size)) if im is not None else 0
        idx = rng.integers(0, len(self.prog), size=self.batch_size - n_im)
        frames_np, prop_np = data.images[idx], data.proprio[idx]
        if n_im:
            j = rng.integers(0, len(im[2]), size=n_im)
            idx = np.concatenate([idx, im[2][j]])
            frames_np = np.concatenate([frames_np, im[0][j]])
            prop_np = np.concatenate([prop_np, im[1][j]])
        frames = torch.from_numpy(frames_np)
        if self.augment:
            frames = _augment(frames, rng)
        texts = [data.instructions[e] for e in self.step_ep[idx]]
        return frames, torch.from_numpy(prop_np), texts, torch.from_numpy(self.prog[idx]), torch.from_numpy(self.succ[idx])

    def batches(self, start, stop):
        return (self._batch() for _ in range(start, stop))

    def loss(self, batch):
        out = self.module.loss(*batch, pos_weight=self.pos_weight)
        return out["loss"], out

    def scalars(self, out, info):
        return {**{f"train/{k}": float(out[k].detach()) for k in ("loss", "progress", "success")}, "train/lr": info["lr"]}

    def evaluate(self, step, writer):
        from worldmodels.evaluate import critic_auroc

        if self.heldout is None:
            return
        self.module.eval()
        au = critic_auroc(self.module, self.heldout)
        if au["auroc"] is not None:
            writer.add_scalar("heldout/auroc", au["auroc"], step)
        self.module.train()


def train_critic(critic: ProgressValueCritic, critic_config: dict, train: EpisodeFrames, out_dir: Path,
                 heldout: EpisodeFrames | None = None, steps: int = 1500, batch_size: int = 64, lr: float = 1e-3,
                 weight_decay: float = 1e-4, warmup: int = 50, success_tail: int = 10, fail_progress: float = 0.3,
                 max_minutes: float | None = None, log_every: int = 25, eval_every: int = 250,
                 checkpoint_every: int = 250, resume: bool = True, tensorboard: bool = True,
                 progress: bool = True, seed: int = 0, augment: bool = True, budget_clock: str = "wall",
                 imagined: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
                 imagined_fraction: float = 0.0, fit_stats: bool = True, lr_follows_budget: bool = True) -> dict:
    """Train the progress-value critic on every frame of ``train`` (targets from
    :meth:`EpisodeFrames.frame_labels`) with the one trainer; returns a report dict (held-out AUROC
    when given). Gradients are clipped at norm 1.

    ``imagined``: a bank from :func:`imagined_frame_bank`; a fraction ``imagined_fraction`` of every
    batch is drawn from it (imagined frames with the labels of the real frames they replace)."""
    from worldmodels.evaluate import critic_auroc

    out_dir = Path(out_dir)
    task = CriticTask(critic, critic_config, train, heldout, np.random.default_rng(seed), batch_size, success_tail,
                      fail_progress, augment, imagined, imagined_fraction, fit_stats)
    tr = _fit(task, out_dir, max_minutes, steps=steps, lr=lr, weight_decay=weight_decay, warmup=warmup,
              grad_clip=1.0, log_every=log_every, eval_every=eval_every, ckpt_every=checkpoint_every,
              budget_clock=budget_clock, lr_follows_budget=lr_follows_budget, resume=resume, tensorboard=tensorboard,
              progress=progress, seed=seed, desc="train critic")
    if tr.finished is not None:
        return tr.finished
    report = {**_common_report(tr, budget_clock),
              "precision": Precision.fixed_fp32(next(critic.parameters()).device,
                                                "critic: fp32 (it has no bf16 autocast path)").as_dict(),
              "pos_weight": task.pos_weight, "parameters": sum(p.numel() for p in critic.parameters()),
              "checkpoint": str(out_dir / "checkpoints" / "last")}
    if heldout is not None:
        report["heldout"] = critic_auroc(critic, heldout)
    tr.finish(report, save=tr.step > tr.start_step)
    return report


class RefreshFineTunes:
    """What ``wmrl.refresh.WorldModelRefresher`` needs from this package, injected by the composition
    root (the engine imports the kernel only): the episode split, the frames container, the two
    fine-tunes and the imagined frame bank."""

    heldout_split = staticmethod(heldout_episodes)
    world_model = staticmethod(train_world_model)
    critic = staticmethod(train_critic)
    bank = staticmethod(imagined_frame_bank)

    @staticmethod
    def frames(episodes, cameras) -> EpisodeFrames:
        return EpisodeFrames(episodes, cameras=cameras)
