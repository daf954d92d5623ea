"""Does imagination rank a policy's rollouts the way the real simulator does?

GRPO in imagination only improves the real policy when, within a group (several rollouts from one
start), the imagined outcome orders the rollouts as the real world would. :func:`replay_check`
measures exactly that: it rolls the policy out in an ``ImaginationEnv`` (closed loop on imagined
frames), then replays every imagined rollout's action chunks *open loop* in a ``SimEnv`` from the
same MuJoCo state, and compares imagined with replayed success rollout by rollout.

Open-loop replay is a strict test (a closed-loop policy in the sim would correct small deviations),
but it is the one that asks the question GRPO relies on: "were the actions that imagination rewarded
actions that succeed?". The sim replays deterministically: replaying a sim rollout's own actions in
the sim reproduces its outcome exactly (checked in ``tests/test_fidelity.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np
import torch

from wmrl.kernel.interfaces import ChunkEnv, Policy, SimStateEnv
from wmrl.kernel.types import Start
from wmrl.rl.rollout import collect_groups, pad_slots, replay_open_loop, slot_ids


class ChunkEnds:
    """A ``StepRecorder`` (``wmrl.rl.rollout``): every executed chunk's end proprio (``info["final_obs"]``,
    before any auto-reset) and, for a ``SimStateEnv``, each slot's simulator state after the last
    chunk in which it was alive (``None`` where its episode ended in that chunk: the env has reset
    it). The states are those of the last batch recorded: use one recorder per batch to keep them."""

    def __init__(self):
        self.proprio: list[torch.Tensor] = []          # per executed chunk: float32 (B, D_s)
        self.uncertainty: list[torch.Tensor | None] = []   # per executed chunk: info["uncertainty"] (B,) or None
        self.last_state: dict[int, object] = {}        # slot -> state after its last alive chunk, or None

    def before_step(self, env, obs, sample, alive) -> None:
        pass

    def after_step(self, env, res, alive) -> None:
        self.proprio.append(res.info["final_obs"].proprio.float().clone())
        u = res.info.get("uncertainty")
        self.uncertainty.append(None if u is None else torch.as_tensor(u).float().clone())
        if isinstance(env, SimStateEnv):
            done = (torch.as_tensor(res.terminated) | torch.as_tensor(res.truncated)).reshape(-1)
            for b in torch.nonzero(alive).flatten().tolist():
                self.last_state[b] = None if bool(done[b]) else env.sim_state(b)

    @staticmethod
    def _per_batch(per_chunk: list, rollouts: Sequence) -> list[list]:
        """``per_chunk`` (one entry per executed chunk) cut into the ``Rollout`` batches' chunks."""
        out, k = [], 0
        for ro in rollouts:
            out.append(per_chunk[k:k + len(ro.obs)])
            k += len(ro.obs)
        return out

    def split(self, rollouts: Sequence) -> list[torch.Tensor]:
        """Per ``Rollout`` batch (in the order executed): chunk-end proprio ``float32 (N, B, D_s)``."""
        return [torch.stack(p) for p in self._per_batch(self.proprio, rollouts)]

    def split_uncertainty(self, rollouts: Sequence) -> list[torch.Tensor | None]:
        """Per ``Rollout`` batch: the env's ``info["uncertainty"]`` after each chunk, ``float32 (N, B)``
        (the world model's disagreement, ``wmrl.imagination.ImaginationEnv``), or ``None`` for a batch
        whose env gave none."""
        return [None if any(x is None for x in u) else torch.stack(u)
                for u in self._per_batch(self.uncertainty, rollouts)]


def start_kind(start: Start) -> str:
    """``"keyframe"`` for a start cut from a stored episode (``episode`` set, as
    ``wmrl.rl.starts.starts_from_store`` makes them), else ``"init"``."""
    return "keyframe" if start.episode is not None else "init"


def _replay_part(make_env: Callable[[], ChunkEnv], starts: Sequence[Start], chunks: Sequence[torch.Tensor],
                 with_proprio: bool):
    """One worker's share of :func:`replay_actions` (one torch thread, its own env)."""
    torch.set_num_threads(1)
    return replay_actions(make_env(), starts, chunks, with_proprio=with_proprio)


@torch.no_grad()
def replay_actions(sim_env: ChunkEnv | None, starts: Sequence[Start], chunks: Sequence[torch.Tensor],
                   with_proprio: bool = False, workers: int = 1, make_env: Callable[[], ChunkEnv] | None = None
                   ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], list]:
    """Execute fixed action chunks open loop from ``starts`` (each needs ``sim_state`` or ``init_index``).

    Args:
        sim_env: a ``ChunkEnv`` that resets to a ``Start``'s MuJoCo state (``sim.env.SimEnv``);
            unused (may be ``None``) when ``workers > 1``.
        starts: ``M`` starts. chunks: ``M`` tensors ``float32 (N_i, H, D_a)``, ``N_i >= 1``: the
            chunks of rollout ``i``, executed in order; the replay of ``i`` stops after ``N_i``
            chunks or when the env ends its episode.
        workers: processes (``wmrl.kernel.workers.worker_pool``, one torch thread each) that replay
            contiguous shares of the rollouts, each in its own ``make_env()`` (a picklable
            ``() -> ChunkEnv``); the starts travel without their ``context`` frames. Every replay
            resets its slot's MuJoCo state and warm starts, so the results equal one process's.

    Returns:
        ``bool (M,)``: whether each replay succeeded within its ``N_i`` chunks; with ``with_proprio``
        also two lists of ``M`` tensors ``float32 (n_i, D_s)``: the proprio at the start and at the
        end of each chunk the replay executed (``n_i <= N_i``: a replay that succeeds early stops
        there), and ``M`` simulator states after the replay's last chunk (``None`` where the episode
        ended within it, or the env is not a ``SimStateEnv``).

    Raises:
        ValueError: ``len(starts) != len(chunks)``, a rollout without chunks, or ``workers > 1``
            without ``make_env`` (``workers = 1`` without ``sim_env``).
    """
    if len(starts) != len(chunks):
        raise ValueError(f"replay_actions got {len(starts)} starts and {len(chunks)} action sequences")
    if any(c.ndim != 3 or c.shape[0] < 1 for c in chunks):
        raise ValueError("every action sequence must be float32 (N_i >= 1, H, D_a)")
    workers = max(1, min(int(workers), len(starts)))
    if workers > 1:
        if make_env is None:
            raise ValueError("replay_actions(workers > 1) needs make_env: a picklable () -> ChunkEnv each worker "
                             "replays in")
        from wmrl.kernel.workers import worker_pool

        bounds = np.linspace(0, len(starts), workers + 1).round().astype(int)
        light = [dataclasses.replace(s, context=None) for s in starts]
        with worker_pool(workers) as pool:
            futs = [pool.submit(_replay_part, make_env, light[a:b], [c.detach().cpu() for c in chunks[a:b]],
                                with_proprio) for a, b in zip(bounds[:-1], bounds[1:])]
            parts = [f.result() for f in futs]
        if not with_proprio:
            return torch.cat(parts)
        return (torch.cat([p[0] for p in parts]), [x for p in parts for x in p[1]], [x for p in parts for x in p[2]],
                [x for p in parts for x in p[3]])
    if sim_env is None:
        raise ValueError("replay_actions needs sim_env (or workers > 1 with make_env)")
    b = sim_env.num_envs
    out = torch.zeros(len(starts), dtype=torch.bool)
    paths: list[torch.Tensor] = [torch.zeros(0)] * len(starts)
    ends: list[torch.Tensor] = [torch.zeros(0)] * len(starts)
    end_states: list = [None] * len(starts)
    for lo in range(0, len(starts), b):
        idx = list(range(lo, min(lo + b, len(starts))))
        st = pad_slots([starts[i] for i in idx], b)
        seqs = pad_slots([chunks[i].float() for i in idx], b)
        lengths = torch.tensor([q.shape[0] for q in seqs])
        steps = range(int(lengths.max()))          # a sequence repeats its last chunk past its end
        padded = torch.stack([torch.stack([q[min(n, q.shape[0] - 1)] for n in steps]) for q in seqs])
        rec = ChunkEnds() if with_proprio else None
        ro = replay_open_loop(sim_env, st, slot_ids(len(idx), b), padded, lengths, recorder=rec)
        out[idx] = ro.success[: len(idx)]
        if rec is not None:
            e, = rec.split([ro])
            for j, i in enumerate(idx):
                paths[i] = chunk_start_proprio(ro, j)
                ends[i], end_states[i] = e[:int(ro.alive[j].sum()), j], rec.last_state.get(j)
    return (out, paths, ends, end_states) if with_proprio else out


def chunk_start_proprio(ro, j: int) -> torch.Tensor:
    """``float32 (n, D_s)``: slot ``j``'s proprio at the start of each of its ``n`` alive chunks of
    ``Rollout`` ``ro`` (the observation the policy saw before each chunk)."""
    n = int(ro.alive[j].sum())
    return torch.stack([ro.obs[k].proprio[j].float() for k in range(n)]) if n else torch.zeros(0, ro.obs[0].proprio.shape[1])


def outcome_paths(imagined: np.ndarray, replayed: np.ndarray, imagined_paths: Sequence[torch.Tensor],
                  replayed_paths: Sequence[torch.Tensor]) -> dict:
    """Where imagination and the sim part, for each kind of outcome: is a wrong imagined success an
    arm that went elsewhere (dynamics) or an arm in the right place that did not hold the object
    (the success rule, the grasp, the critic)?

    Args:
        imagined, replayed: ``bool (M,)`` outcomes of the same rollouts.
        imagined_paths, replayed_paths: ``M`` tensors ``float32 (n_i, D_s)`` of proprio at each
            chunk start (Panda layout: end-effector position in m at ``[:3]``, finger joints in m at
            ``[7:9]``); compared at the last chunk start both executed.

    Returns:
        ``{"both" | "imagined_only" | "replayed_only": {"n", "ee_err_cm_median", "ee_err_cm_max",
        "far" (end effector > 2 cm apart), "gap_imagined_cm_median", "gap_replayed_cm_median"}}``
        (medians ``None`` for an empty kind); ``gap`` is the finger gap, joint 7 minus joint 8, in cm.
    """
    ee, gi, gr = [], [], []
    for a, b in zip(imagined_paths, replayed_paths):
        k = min(len(a), len(b)) - 1
        if k < 0:
            ee.append(float("nan")); gi.append(float("nan")); gr.append(float("nan"))
            continue
        ee.append(100 * float((a[k, :3] - b[k, :3]).norm()))
        gi.append(100 * float(a[k, 7] - a[k, 8])); gr.append(100 * float(b[k, 7] - b[k, 8]))
    ee_a, gi_a, gr_a = np.asarray(ee), np.asarray(gi), np.asarray(gr)
    im, re = np.asarray(imagined, dtype=bool), np.asarray(replayed, dtype=bool)

    def stats(m: np.ndarray) -> dict:
        ok = m & np.isfinite(ee_a)
        med = (lambda x: round(float(np.median(x[ok])), 3) if ok.any() else None)
        return {"n": int(m.sum()), "ee_err_cm_median": med(ee_a),
                "ee_err_cm_max": round(float(ee_a[ok].max()), 3) if ok.any() else None,
                "far": int((ee_a[ok] > 2.0).sum()), "gap_imagined_cm_median": med(gi_a),
                "gap_replayed_cm_median": med(gr_a)}

    return {"both": stats(im & re), "imagined_only": stats(im & ~re), "replayed_only": stats(~im & re)}


def ranking_stats(imagined: np.ndarray, real: np.ndarray, group_ids: np.ndarray) -> dict:
    """Agreement of imagined and real binary outcomes of the same rollouts.

    Args:
        imagined, real: ``bool`` or ``{0, 1}`` arrays ``(M,)``; group_ids: ``int (M,)``.

    Returns dict:
        ``agreement`` (fraction of rollouts with the same outcome), ``precision`` (fraction of
        imagined successes that are real successes; ``None`` without imagined successes),
        ``recall`` (fraction of real successes imagination also calls successes; ``None`` without),
        ``pairs`` (within-group pairs whose real outcomes differ) and how imagination orders them:
        ``pairs_right`` / ``pairs_tied`` / ``pairs_wrong``; ``pair_accuracy`` (right + half the ties,
        over pairs; 0.5 is chance, ``None`` without pairs), ``mixed_groups_imagined`` /
        ``mixed_groups_real`` (groups with both outcomes: the only groups that give GRPO a
        gradient), ``groups``.
    """
    im = np.asarray(imagined, dtype=float)
    re = np.asarray(real, dtype=float)
    gi = np.asarray(group_ids)
    if not (im.shape == re.shape == gi.shape) or im.ndim != 1:
        raise ValueError(f"imagined, real and group_ids must be (M,) arrays of one length, got {im.shape}, "
                         f"{re.shape}, {gi.shape}")
    right = tied = wrong = 0
    mixed_i = mixed_r = 0
    groups = np.unique(gi)
    for g in groups:
        m = gi == g
        a, r = im[m], re[m]
        mixed_i += int(0 < a.mean() < 1)
        mixed_r += int(0 < r.mean() < 1)
        hi, lo = a[r == 1], a[r == 0]
        if len(hi) and len(lo):
            diff = hi[:, None] - lo[None, :]
            right += int((diff > 0).sum())
            tied += int((diff == 0).sum())
            wrong += int((diff < 0).sum())
    pairs = right + tied + wrong
    return {
        "agreement": float((im == re).mean()) if len(im) else None,
        "precision": float(re[im == 1].mean()) if (im == 1).any() else None,
        "recall": float(im[re == 1].mean()) if (re == 1).any() else None,
        "pairs": pairs, "pairs_right": right, "pairs_tied": tied, "pairs_wrong": wrong,
        "pair_accuracy": (right + 0.5 * tied) / pairs if pairs else None,
        "mixed_groups_imagined": mixed_i, "mixed_groups_real": mixed_r, "groups": int(len(groups)),
    }


def replay_check(imagination_env: ChunkEnv, sim_env: ChunkEnv, policy: Policy, starts: Sequence[Start],
                 group_size: int, max_chunks: int, generator: torch.Generator | None = None,
                 progress: bool = False, keep_rollouts: bool = False, workers: int = 1,
                 make_env: Callable[[], ChunkEnv] | None = None) -> dict:
    """Imagined rollouts of ``policy`` (``group_size`` per start, as GRPO collects them) and their
    open-loop replay in the sim.

    Args:
        imagination_env: an ``ImaginationEnv``; starts need real ``context`` frames.
        sim_env: the real sim; starts need ``sim_state`` or ``init_index`` (the state the context
            frames were rendered from).
        policy: the policy as GRPO samples it (its RL sampler).
        max_chunks: imagined horizon in chunks (GRPO's ``max_chunks``).
        workers, make_env: the replay in ``workers`` processes (see :func:`replay_actions`; ``sim_env``
            then only serves the caller, e.g. for context frames).

    Returns:
        ``{"imagined_success", "replayed_success", "n", "per_task": {task: {"imagined", "replayed",
        "n"}}, "per_start_kind": {"init" | "keyframe": {"imagined", "replayed", "n", "imagined_successes",
        **ranking_stats(...)}}, "imagined_successes", "replayed_successes", "both_successes",
        "outcome_paths", "outcome_paths_per_task": {task: ...}, **ranking_stats(...)}`` (see
        :func:`ranking_stats`; the kind of a start: :func:`start_kind`). ``outcome_paths``:
        :func:`outcome_paths` of the imagined and replayed proprio, where the two part for each kind
        of outcome. With ``keep_rollouts`` also ``rollouts`` (not JSON-able), one entry per rollout:
        ``starts``, ``kind``, ``group``, ``imagined``, ``replayed`` (``(M,)``), ``actions`` (the
        chunks imagined and replayed, ``(N_i, H, D_a)``), ``gripper`` (the gripper command on each
        chunk's last step, ``(N_i,)``), ``imagined_ends`` / ``replayed_ends``
        (chunk-end proprio ``(n_i, D_s)``), ``replayed_end_state`` (see :func:`replay_actions`) and
        ``imagined_uncertainty`` (the imagination env's ``info["uncertainty"]`` after each chunk,
        ``(n_i,)``, or ``None`` without one).
    """
    rec = ChunkEnds()
    rollouts = collect_groups(imagination_env, policy, starts, group_size, max_chunks, generator=generator,
                              progress=progress, recorder=rec)
    seq_starts, seqs, imagined, gids, im_paths, im_ends, im_unc = [], [], [], [], [], [], []
    for ro, e, u in zip(rollouts, rec.split(rollouts), rec.split_uncertainty(rollouts)):
        acts = torch.stack([s.actions for s in ro.samples], 1)          # (B, N, H, D_a)
        for j, g in enumerate(ro.group_ids.tolist()):
            if g < 0:
                continue
            n = int(ro.alive[j].sum())                                   # chunks slot j executed
            seq_starts.append(starts[g])                                 # group g is starts[g]
            seqs.append(acts[j, :n])
            imagined.append(bool(ro.success[j]))
            gids.append(g)
            im_paths.append(chunk_start_proprio(ro, j))
            im_ends.append(e[:n, j])
            im_unc.append(None if u is None else u[:n, j])
    replayed_t, re_paths, re_ends, re_states = replay_actions(sim_env, seq_starts, seqs, with_proprio=True,
                                                           workers=workers, make_env=make_env)
    replayed = replayed_t.numpy()
    imagined_a = np.asarray(imagined)
    gids_a = np.asarray(gids)
    tasks = np.asarray([s.task_name for s in seq_starts])
    def rates(m: np.ndarray) -> dict:
        return {"imagined": float(imagined_a[m].mean()), "replayed": float(replayed[m].mean()), "n": int(m.sum())}

    names = list(dict.fromkeys(tasks.tolist()))
    per_task = {t: rates(tasks == t) for t in names}
    kinds = np.asarray([start_kind(s) for s in seq_starts])
    per_kind = {k: {**rates(kinds == k), "imagined_successes": int(imagined_a[kinds == k].sum()),
                    **ranking_stats(imagined_a[kinds == k], replayed[kinds == k], gids_a[kinds == k])}
                for k in ("init", "keyframe") if (kinds == k).any()}
    return {"imagined_success": float(imagined_a.mean()), "replayed_success": float(replayed.mean()),
            "n": int(len(imagined_a)), "imagined_successes": int(imagined_a.sum()),
            "replayed_successes": int(replayed.sum()), "both_successes": int((imagined_a & replayed).sum()),
            "per_task": per_task, "per_start_kind": per_kind,
            "outcome_paths": outcome_paths(imagined_a, replayed, im_paths, re_paths),
            "outcome_paths_per_task": {t: outcome_paths(imagined_a[tasks == t], replayed[tasks == t],
                                                        [im_paths[i] for i in np.flatnonzero(tasks == t)],
                                                        [re_paths[i] for i in np.flatnonzero(tasks == t)])
                                       for t in names},
            **ranking_stats(imagined_a, replayed, gids_a),
            **({"rollouts": {"starts": seq_starts, "kind": kinds, "group": gids_a, "imagined": imagined_a, "replayed": replayed,
                         "actions": seqs, "gripper": [q[:, -1, -1].clone() for q in seqs], "imagined_ends": im_ends,
                         "replayed_ends": re_ends, "replayed_end_state": re_states,
                         "imagined_uncertainty": im_unc}} if keep_rollouts else {})}
