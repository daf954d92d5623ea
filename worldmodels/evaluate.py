"""World-model and critic fidelity metrics on held-out episodes.

* :func:`horizon_metrics`: PSNR and SSIM (torchmetrics) ``k = 1..K`` chunks ahead, autoregressive
  (the model's own predictions are fed back), against copy-the-last-frame (the frame at the start of
  the rollout). PSNR is computed from the aggregate MSE over all rollouts and pixels at a horizon
  (so identical frames do not give infinite means), images scaled to [0, 1]. Beside the pixels, the
  imagined proprio against the recorded one: the end-effector position error (m) and the
  per-dimension mean absolute error, each against the copy baseline (the proprio at the start).
* :func:`action_following`: one-chunk-ahead pixel MSE with the true actions against the MSE with
  the actions of another held-out episode at the same step.
* :func:`critic_auroc`: AUROC of ``success_prob`` on each episode's final frame, success vs failure.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torchmetrics.functional.classification import binary_auroc
from torchmetrics.functional.image import (
    peak_signal_noise_ratio,
    structural_similarity_index_measure,
)

from worldmodels.data import EpisodeFrames, split_cameras
from worldmodels.video_wm import ChunkFlowWorldModel, WMState, to_uint8, to_unit


def _to01(x: torch.Tensor) -> torch.Tensor:
    return (x.float().clamp(-1, 1) + 1) / 2


def _accumulate(s: dict, model, data: EpisodeFrames, state: WMState, first: torch.Tensor, p0: torch.Tensor,
                ep: np.ndarray, t_target: np.ndarray, valid: np.ndarray, pos: list[int] | None) -> None:
    """Add one horizon's squared errors, SSIM and proprio errors of the valid rollouts to ``s``."""
    dev = first.device
    v = torch.from_numpy(valid)
    gt = torch.from_numpy(data.images[data.offsets[ep[valid]] + t_target[valid]]).to(dev)
    pred = _to01(state.frames[v.to(dev)])
    tgt = _to01(to_unit(gt))
    copy = _to01(to_unit(first[v.to(dev)]))
    s["se"] += float((pred - tgt).pow(2).sum())
    s["se_copy"] += float((copy - tgt).pow(2).sum())
    s["npix"] += tgt.numel()
    for c in range(len(model.cameras)):
        s["cam_se"][c] += float((pred[:, 3 * c: 3 * c + 3] - tgt[:, 3 * c: 3 * c + 3]).pow(2).sum())
    s["ssim"] += float(structural_similarity_index_measure(pred, tgt, data_range=1.0, reduction="sum"))
    s["ssim_copy"] += float(structural_similarity_index_measure(copy, tgt, data_range=1.0, reduction="sum"))
    p_gt = torch.from_numpy(data.proprio[data.offsets[ep[valid]] + t_target[valid]]).to(dev).float()
    p_im, p_cp = state.proprio[v.to(dev)].float(), p0[v.to(dev)].float()
    s["ae"] += (p_im - p_gt).abs().sum(0).cpu().numpy()
    s["ae_copy"] += (p_cp - p_gt).abs().sum(0).cpu().numpy()
    if pos is not None:
        s["pos"] += float((p_im[:, pos] - p_gt[:, pos]).norm(dim=1).sum())
        s["pos_copy"] += float((p_cp[:, pos] - p_gt[:, pos]).norm(dim=1).sum())
    s["n"] += int(valid.sum())


def _db(se: float, npix: float) -> float:
    return float(-10 * np.log10(max(se / max(npix, 1), 1e-10)))


def _summarise(sums: dict, cameras: Sequence[str], pos: list[int] | None) -> dict:
    """:func:`horizon_metrics`' result from the per-horizon sums."""
    ks = [k for k in sums if sums[k]["n"] > 0]
    out = {"horizon": ks,
           "psnr": [_db(sums[k]["se"], sums[k]["npix"]) for k in ks],
           "psnr_copy": [_db(sums[k]["se_copy"], sums[k]["npix"]) for k in ks],
           "ssim": [sums[k]["ssim"] / sums[k]["n"] for k in ks],
           "ssim_copy": [sums[k]["ssim_copy"] / sums[k]["n"] for k in ks],
           "n": [sums[k]["n"] for k in ks],
           "psnr_per_camera": {c: [_db(sums[k]["cam_se"][j], sums[k]["npix"] / len(cameras)) for k in ks]
                               for j, c in enumerate(cameras)}}
    out["psnr_gain"] = [a - b for a, b in zip(out["psnr"], out["psnr_copy"])]
    out["proprio_mae"] = [(sums[k]["ae"] / sums[k]["n"]).tolist() for k in ks]
    out["proprio_mae_copy"] = [(sums[k]["ae_copy"] / sums[k]["n"]).tolist() for k in ks]
    if pos is not None:
        out["position_error"] = [sums[k]["pos"] / sums[k]["n"] for k in ks]
        out["position_error_copy"] = [sums[k]["pos_copy"] / sums[k]["n"] for k in ks]
    unc = [np.concatenate(sums[k]["unc"]) for k in ks if sums[k]["unc"]]
    if unc:   # a model that reports its uncertainty (the dynamics ensemble's disagreement, m)
        out["uncertainty_mean"] = [float(u.mean()) for u in unc]
        out["uncertainty_q99"] = [float(np.quantile(u, 0.99)) for u in unc]
        out["halt_uncertainty_tau"] = float(np.quantile(np.concatenate(unc), 0.99))
    # the same PSNR via torchmetrics on one batch, as a cross-check of the aggregate formula
    out["psnr_definition"] = "10*log10(1/MSE) over all pixels of all rollouts at a horizon, images in [0,1]"
    return out


@torch.no_grad()
def horizon_metrics(model: ChunkFlowWorldModel, data: EpisodeFrames, max_chunks: int = 8, start_stride: int = 8,
                    batch_size: int = 64, generator: torch.Generator | None = None,
                    position_dims: Sequence[int] | None = (0, 1, 2)) -> dict:
    """Autoregressive PSNR / SSIM and proprio errors per horizon against the copy baseline.

    Rollouts start at steps ``0, start_stride, 2*start_stride, ...`` of every episode of ``data``
    and run with the episode's true actions; horizon ``k`` is scored on the rollouts whose frame
    ``t0 + k*H`` exists.

    Args:
        position_dims: the proprio dims holding the end-effector position in metres (``(0, 1, 2)``
            in this suite's layout, ``sim.env.SimEnv.proprio``, and in LIBERO's ``eef_pos``
            first layout); ``None`` skips ``position_error``.

    Returns:
        ``{"horizon": [1..K], "psnr": [...], "psnr_copy": [...], "ssim": [...], "ssim_copy": [...],
        "psnr_per_camera": {cam: [...]}, "n": [...], "position_error": [...],
        "position_error_copy": [...], "proprio_mae": [[D_s floats], ...], "proprio_mae_copy": [...]}``,
        and for a model whose states carry ``uncertainty`` (the dynamics ensemble) ``uncertainty_mean``
        / ``uncertainty_q99`` per horizon and ``halt_uncertainty_tau``, the 99th percentile of every
        held-out rollout's disagreement over all horizons: the calibrated threshold τ at which an
        imagined rollout halts (``env.imagination.halt_uncertainty``; MOReL halts outside the data's
        support, Kidambi et al. 2020) (dB for PSNR; ``position_error`` is the mean Euclidean distance in metres between the imagined
        and the recorded end-effector position, ``proprio_mae`` the mean absolute error per proprio
        dimension in its units).

    Raises:
        ValueError: no episode longer than one chunk, or ``position_dims`` outside the proprio.
    """
    H = model.chunk_size
    dev = model.proprio_mean.device
    pos = list(position_dims) if position_dims is not None else None
    if pos is not None and (not pos or min(pos) < 0 or max(pos) >= data.state_dim):
        raise ValueError(f"position_dims {pos} must index the proprio of D_s={data.state_dim}; "
                         "set position_dims=None for a proprio without an end-effector position")
    starts = [(e, t) for e in range(data.num_episodes) for t in range(0, int(data.lengths[e]) - H, start_stride)]
    if not starts:
        raise ValueError(f"no held-out episode is longer than one chunk (H={H})")
    sums = {k: {"se": 0.0, "se_copy": 0.0, "npix": 0, "ssim": 0.0, "ssim_copy": 0.0, "n": 0,
                "cam_se": np.zeros(len(model.cameras)), "pos": 0.0, "pos_copy": 0.0,
                "ae": np.zeros(data.state_dim), "ae_copy": np.zeros(data.state_dim), "unc": []}
            for k in range(1, max_chunks + 1)}
    for i in range(0, len(starts), batch_size):
        chunk = starts[i: i + batch_size]
        ep = np.array([e for e, _ in chunk])
        t0 = np.array([t for _, t in chunk])
        g0 = data.offsets[ep] + t0
        first = torch.from_numpy(data.images[g0]).to(dev)
        p0 = torch.from_numpy(data.proprio[g0]).to(dev)
        state = WMState(to_unit(first), p0, [data.instructions[e] for e in ep],
                        prev_proprio=data.proprio_before(ep, t0).to(dev))
        for k in range(1, max_chunks + 1):
            valid = t0 + k * H <= data.lengths[ep] - 1
            if not valid.any():
                break
            a_idx = np.minimum(t0[:, None] + (k - 1) * H + np.arange(H)[None], data.lengths[ep][:, None] - 1)
            acts = torch.from_numpy(data.actions[data.offsets[ep][:, None] + a_idx]).to(dev)
            state, _ = model.imagine(state, acts, generator=generator)
            _accumulate(sums[k], model, data, state, first, p0, ep, t0 + k * H, valid, pos)
            if state.uncertainty is not None:
                sums[k]["unc"].append(state.uncertainty.float().cpu().numpy()[valid])

    return _summarise(sums, model.cameras, pos)


@torch.no_grad()
def closing_gap_error(model: ChunkFlowWorldModel, data: EpisodeFrames, gripper_dim: int = -1,
                      gap_dims: tuple[int, int] = (-2, -1), batch_size: int = 64) -> dict:
    """Finger-gap error of one imagined chunk over the chunks in which the gripper closes (the
    commanded gripper, action dim ``gripper_dim``, goes from open (<= 0) to closed (> 0) inside the
    chunk): what decides whether imagination can tell a grasp from a miss. The gap is
    ``proprio[gap_dims[0]] - proprio[gap_dims[1]]`` (m; the default, the last two proprio dims, is the
    two finger joints in both the embedded suite's 9-D and LIBERO's 8-D proprio) after the chunk, imagined from the real state
    at the chunk's start with the recorded actions, against the recorded one.

    Returns:
        ``{"mae_m", "mae_copy_m", "n"}`` (copy: the gap at the chunk's start); ``None`` values with
        ``n = 0`` when no held-out chunk closes the gripper.
    """
    H = model.chunk_size
    ep, t = data.gripper_switch_starts(H, gripper_dim, closing_only=True)
    dev = model.proprio_mean.device
    err, err_copy = [], []
    for i in range(0, len(ep), batch_size):
        w = data.windows(ep[i:i + batch_size], t[i:i + batch_size], H)
        state = WMState(to_unit(w.frames.to(dev)), w.proprio.to(dev), [data.instructions[e] for e in ep[i:i + batch_size]],
                        prev_proprio=w.prev_proprio.to(dev))
        new, _ = model.imagine(state, w.actions.to(dev))
        gap = lambda p: (p[:, gap_dims[0]] - p[:, gap_dims[1]]).float().cpu()   # noqa: E731
        real = gap(w.next_proprio)
        err.append((gap(new.proprio) - real).abs())
        err_copy.append((gap(w.proprio) - real).abs())
    if not err:
        return {"mae_m": None, "mae_copy_m": None, "n": 0}
    e, c = torch.cat(err), torch.cat(err_copy)
    return {"mae_m": float(e.mean()), "mae_copy_m": float(c.mean()), "n": int(len(e))}


#: chunks before the close from which the world-model reports also imagine the held-out grasps
#: (``grasp_outcome_lead``): an imagined rollout closes the gripper from its own frames, several
#: chunks after its real start (6-10 in the default pipeline's imagination check)
GRASP_LEAD_CHUNKS = 4


@torch.no_grad()
def grasp_outcome(model: ChunkFlowWorldModel, data: EpisodeFrames, chunks: int = 4, held_min_m: float = 0.025,
                  miss_max_m: float = 0.01, gripper_dim: int = -1, batch_size: int = 64, lead_chunks: int = 0) -> dict:
    """Can imagination tell a grasp from a miss? From every chunk start whose chunk closes the gripper
    (:meth:`EpisodeFrames.gripper_switch_starts`), ``chunks`` chunks imagined autoregressively (the
    model's own frames) with the recorded actions; the real outcome after them is a *miss* when the
    real finger gap (the last two proprio dims, the finger joints, m) is below ``miss_max_m`` (closed on nothing), else a *hold*.

    With ``lead_chunks = L > 0`` imagination starts from the real state ``L`` chunks *before* the closing
    chunk (its frames the rollout's anchor) and runs ``L + chunks`` chunks, so the close itself is
    imagined from the model's own frames, as in an imagined rollout that closes the gripper ``L`` chunks
    in (only closes at least ``L`` chunks into their episode count). From the close (``L = 0``) the
    head reads the real frame of the closing chunk, which no imagined rollout has.

    Returns:
        ``{"n", "misses", "miss_called" (fraction of misses whose imagined gap is < held_min_m, the lift
        rule's threshold), "hold_called" (fraction of holds whose imagined gap is >= held_min_m),
        "hold_precision" (fraction of imagined holds that are real holds: what an imagined lift's
        precision is bounded by), "gap_mae_m" (per chunk 1..chunks, over all starts), "lead_chunks"}``;
        ``n = 0`` and ``None`` values when no held-out chunk closes the gripper early enough (``lead_chunks``
        chunks into its episode) to be followed for ``chunks`` chunks.

    Raises:
        ValueError: ``lead_chunks < 0``.
    """
    H = model.chunk_size
    if lead_chunks < 0:
        raise ValueError(f"lead_chunks must be >= 0, got {lead_chunks}")
    ep, t = data.gripper_switch_starts(H, gripper_dim, closing_only=True)
    keep = (t + H * chunks <= data.lengths[ep] - 1) & (t - H * lead_chunks >= 0)
    ep, t = ep[keep], t[keep]
    if len(ep) == 0:
        return {"n": 0, "misses": 0, "miss_called": None, "hold_called": None, "hold_precision": None,
                "gap_mae_m": None, "lead_chunks": lead_chunks}
    dev = model.proprio_mean.device
    gap = lambda p: p[..., -2] - p[..., -1]   # noqa: E731
    pred, real = [], []
    for i in range(0, len(ep), batch_size):
        e, s = ep[i:i + batch_size], t[i:i + batch_size] - H * lead_chunks
        w = data.windows(e, s, H)
        state = WMState(to_unit(w.frames.to(dev)), w.proprio.to(dev), [data.instructions[j] for j in e],
                        prev_proprio=w.prev_proprio.to(dev))
        g_pred, g_real = [], []
        for k in range(lead_chunks + chunks):
            idx = data.offsets[e][:, None] + s[:, None] + k * H + np.arange(H)[None]
            state, _ = model.imagine(state, torch.from_numpy(data.actions[idx]).to(dev))
            if k >= lead_chunks:
                g_pred.append(gap(state.proprio).float().cpu())
                g_real.append(torch.from_numpy(gap(data.proprio[data.offsets[e] + s + (k + 1) * H])))
        pred.append(torch.stack(g_pred, 1))
        real.append(torch.stack(g_real, 1))
    p, r = torch.cat(pred), torch.cat(real)
    miss = r[:, -1] < miss_max_m
    called = lambda m, ok: float(ok[m].float().mean()) if bool(m.any()) else None   # noqa: E731
    held = p[:, -1] >= held_min_m
    return {"n": int(len(r)), "misses": int(miss.sum()), "miss_called": called(miss, ~held),
            "hold_called": called(~miss, held), "hold_precision": called(held, ~miss),
            "gap_mae_m": [float(x) for x in (p - r).abs().mean(0)], "lead_chunks": lead_chunks}


@torch.no_grad()
def action_following(model: ChunkFlowWorldModel, data: EpisodeFrames, n: int = 256, seed: int = 0,
                     batch_size: int = 64) -> dict:
    """One-chunk-ahead pixel MSE with the true actions vs with the actions of a *different* held-out
    episode at the same step (same start frames). Returns ``{"mse_true", "mse_mismatched",
    "reduction"}`` where ``reduction = 1 - mse_true / mse_mismatched`` (target >= 0.2)."""
    H = model.chunk_size
    rng = np.random.default_rng(seed)
    eps, ts = data.window_starts(H)
    if len(set(eps.tolist())) < 2:
        raise ValueError("action following needs at least two held-out episodes")
    pick = rng.choice(len(eps), size=min(n, len(eps)), replace=False)
    ep, t = eps[pick], ts[pick]
    other = np.empty_like(ep)
    for i in range(len(ep)):
        cands = np.flatnonzero(eps != ep[i])
        # prefer the same step in the other episode, else the nearest step it has
        same = cands[ts[cands] == t[i]]
        other[i] = rng.choice(same) if len(same) else rng.choice(cands)
    dev = model.proprio_mean.device
    se_true = se_mis = 0.0
    npix = 0
    for i in range(0, len(ep), batch_size):
        w = data.windows(ep[i: i + batch_size], t[i: i + batch_size], H)
        wm = data.windows(eps[other[i: i + batch_size]], ts[other[i: i + batch_size]], H)
        f, p = to_unit(w.frames.to(dev)), w.proprio.to(dev)
        tgt = to_unit(w.next_frames.to(dev))
        pt = (f + model.sample_residual(f, p, w.actions.to(dev))).clamp(-1, 1)
        pm = (f + model.sample_residual(f, p, wm.actions.to(dev))).clamp(-1, 1)
        se_true += float(((pt - tgt) / 2).pow(2).sum())
        se_mis += float(((pm - tgt) / 2).pow(2).sum())
        npix += tgt.numel()
    mt, mm = se_true / npix, se_mis / npix
    return {"mse_true": mt, "mse_mismatched": mm, "reduction": 1.0 - mt / max(mm, 1e-12), "n": int(len(ep))}


@torch.no_grad()
def critic_auroc(critic, data: EpisodeFrames, last_k: int = 1) -> dict:
    """AUROC of the critic's success probability (max over each episode's last ``last_k`` frames)
    separating successful from failed episodes of ``data``; ``auroc`` is ``None`` when only one
    class is present. Also reports the mean progress on final frames per class."""
    scores, prog, labels = [], [], []
    for e in range(data.num_episodes):
        T = int(data.lengths[e])
        g = data.offsets[e] + np.arange(max(0, T - last_k), T)
        obs_imgs = split_cameras(torch.from_numpy(data.images[g]), data.cameras)
        from wmrl.kernel.types import Obs

        obs = Obs(obs_imgs, torch.from_numpy(data.proprio[g]), [data.instructions[e]] * len(g))
        p, s = critic.evaluate(obs)
        scores.append(float(s.max()))
        prog.append(float(p[-1]))
        labels.append(bool(data.success[e]))
    y = torch.tensor(labels)
    sc = torch.tensor(scores)
    au = float(binary_auroc(sc, y.long())) if 0 < int(y.sum()) < len(y) else None
    pr = torch.tensor(prog)
    return {"auroc": au, "n_success": int(y.sum()), "n_failure": int((~y).sum()),
            "final_progress_success": float(pr[y].mean()) if y.any() else None,
            "final_progress_failure": float(pr[~y].mean()) if (~y).any() else None,
            "success_prob_success": float(sc[y].mean()) if y.any() else None,
            "success_prob_failure": float(sc[~y].mean()) if (~y).any() else None}


def torchmetrics_psnr(pred01: torch.Tensor, target01: torch.Tensor) -> float:
    """torchmetrics PSNR over a whole batch in [0, 1] (same definition as :func:`horizon_metrics`)."""
    return float(peak_signal_noise_ratio(pred01, target01, data_range=1.0))


# ---------------------------------------------------------------------------- videos and quick checks (training's evaluation)
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
