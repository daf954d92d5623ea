"""Benchmark runner: success rates with confidence intervals, per-episode tables and videos.

``evaluate_policy`` runs a policy (or a scripted-expert actor) on every task of a suite.
Episode ``j`` of task ``t`` always starts from evaluation init state ``j`` (mod the number of
states) with seed ``episode_seed(seed, t, j)``, whatever the batch size: episodes are taken from
one queue by whichever slot is free, each slot runs one episode at a time, and a policy is sampled
per episode with that episode's own ``torch.Generator`` (``per_episode_sampling=True``), so the
numbers of one episode never depend on its batch neighbours. With 50 episodes per task every
evaluation init state is used exactly once.

The suite and the actors are duck-typed (``wmrl`` never imports ``sim``):

* suite: ``task_names``, ``eval_start(task, j) -> Start``, ``make_env(num_envs, auto_reset=False,
  cameras=...) -> env`` with ``reset_slots(slots, starts) -> Obs``, ``step(actions) -> StepResult``
  (``info["episode_length"]``), ``record(slot, camera, size)``, ``take_frames(slot)``;
  optionally ``describe() -> dict``.
* actor: ``chunk_size``, ``begin(slot, task_name, seed)``, ``act(env, obs, active) -> (B, H, D_a)``
  and ``needs_images`` (``False`` lets the runner skip rendering cameras).
  Any ``wmrl.kernel.interfaces.Policy`` is wrapped in :class:`PolicyActor`.

Success rates and their Wilson intervals: :func:`wmrl.rl.evaluate.success_summary`.
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import zlib
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from tqdm import tqdm

from wmrl.kernel.interfaces import Policy
from wmrl.rl.evaluate import per_task_outcomes, success_summary

log = logging.getLogger("wmrl.evaluation")


@runtime_checkable
class EpisodeActor(Protocol):
    """What the episode runner drives (see the module docstring): :class:`PolicyActor`, the suite's
    scripted expert."""

    chunk_size: int
    needs_images: bool

    def begin(self, slot: int, task_name: str, seed: int) -> None: ...

    def act(self, env: Any, obs: Any, active: Any) -> torch.Tensor: ...


def episode_seed(seed: int, task: str, j: int) -> int:
    """Seed of evaluation episode ``j`` of ``task`` (a 32-bit int from ``numpy.random.SeedSequence``)."""
    return int(np.random.SeedSequence([int(seed), zlib.crc32(task.encode()), int(j)]).generate_state(1)[0])


class PolicyActor:
    """Adapts a ``wmrl.kernel.interfaces.Policy`` to the runner.

    Args:
        policy: has ``chunk_size``, ``action_dim`` and ``sample(obs, generator) -> PolicySample``.
        per_episode_sampling: sample each active slot separately with its episode's generator
            (results independent of the batch size); ``False`` samples the whole batch at once with
            one generator (faster, but an episode's noise then depends on its neighbours).
        device: where observations are moved before ``sample``.
    """

    needs_images = True

    def __init__(self, policy, per_episode_sampling: bool = True, device: str | torch.device = "cpu"):
        if not isinstance(policy, Policy):
            raise TypeError(f"{type(policy).__name__} is not a Policy (wmrl.kernel.interfaces.Policy: chunk_size, "
                            "action_dim, supports_rtc, sample, log_prob)")
        self.policy = policy
        self.chunk_size = int(policy.chunk_size)
        self.per_episode = bool(per_episode_sampling)
        self.device = torch.device(device)
        self._gens: dict[int, torch.Generator] = {}
        self._batch_gen: torch.Generator | None = None

    def begin(self, slot: int, task_name: str, seed: int) -> None:
        g = torch.Generator(device=self.device)
        g.manual_seed(int(seed))
        self._gens[slot] = g
        if self._batch_gen is None:
            self._batch_gen = torch.Generator(device=self.device)
            self._batch_gen.manual_seed(int(seed))

    @torch.no_grad()
    def act(self, env, obs, active) -> torch.Tensor:
        b_all = obs.batch_size
        idx = [b for b in range(b_all) if active[b]]
        if not idx:
            return torch.zeros(b_all, self.chunk_size, int(self.policy.action_dim))
        if self.per_episode:
            acts = torch.cat([self.policy.sample(obs.index([b]).to(self.device), self._gens[b]).actions
                              for b in idx]).float().cpu()
        else:
            acts = self.policy.sample(obs.index(idx).to(self.device), self._batch_gen).actions.float().cpu()
        if acts.ndim != 3 or acts.shape[0] != len(idx):
            raise ValueError(f"policy.sample returned actions of shape {tuple(acts.shape)}; expected "
                             f"({len(idx)}, H, D_a)")
        out = torch.zeros(b_all, acts.shape[1], acts.shape[2])
        out[idx] = acts
        return out


def _write_video(path: Path, frames: list[np.ndarray], fps: int) -> None:
    import imageio.v2 as imageio

    path.parent.mkdir(parents=True, exist_ok=True)
    with imageio.get_writer(path, fps=fps, codec="libx264", quality=7, macro_block_size=1) as w:
        for f in frames:
            w.append_data(np.asarray(f, dtype=np.uint8))


def _run_queue(actor, suite, queue: list[tuple[str, int]], B: int, seed: int, out: Path | None,
               videos_per_task: int, video_camera: str, video_size, fps: int, progress: bool,
               desc: str = "evaluate", position: int = 0) -> dict[tuple[str, int], dict]:
    """Run the episodes ``queue`` ``[(task, j)]`` on ``B`` slots; returns ``{(task, j): row}``."""
    cams = None if actor.needs_images else ()
    env = suite.make_env(B, auto_reset=False, cameras=cams)
    slot_ep: list[tuple | None] = [None] * B
    slot_reward = np.zeros(B)
    rows: dict[tuple[str, int], dict] = {}
    qpos = 0

    def assign(slots):
        nonlocal qpos
        starts, used = [], []
        for b in slots:
            if qpos >= len(queue):
                slot_ep[b] = None
                continue
            t, j = queue[qpos]
            qpos += 1
            s = suite.eval_start(t, j)
            sd = episode_seed(seed, t, j)
            film = out is not None and j < videos_per_task
            env.record(b, video_camera if film else None, video_size)
            actor.begin(b, t, sd)
            slot_ep[b] = (t, j, s.init_index, sd, film)
            slot_reward[b] = 0.0
            starts.append(s)
            used.append(b)
        return env.reset_slots(used, starts) if used else None

    obs = assign(range(B))
    bar = tqdm(total=len(queue), desc=desc, disable=not progress, unit="ep", position=position)
    while any(e is not None for e in slot_ep):
        active = [e is not None for e in slot_ep]
        res = env.step(actor.act(env, obs, active))
        slot_reward += res.reward.numpy()
        done = (res.terminated | res.truncated).numpy()
        lengths = res.info["episode_length"].numpy()
        finished = []
        for b in range(B):
            if slot_ep[b] is None or not done[b]:
                continue
            t, j, idx, sd, film = slot_ep[b]
            rows[(t, j)] = {"task": t, "episode": j, "init_index": int(idx), "seed": int(sd),
                            "success": bool(res.success[b]), "length": int(lengths[b]),
                            "reward": float(slot_reward[b])}
            if film:
                frames = env.take_frames(b)
                if frames:
                    name = f"{t}_ep{j:03d}_{'success' if res.success[b] else 'failure'}.mp4"
                    try:
                        _write_video(out / "videos" / name, frames, fps)
                    except OSError as e:  # e.g. ENOMEM forking ffmpeg: the episode's result is kept, the video is not
                        log.error("could not write the video %s (%s: %s); the episode's result is kept, the "
                                  "evaluation goes on without it", out / "videos" / name, type(e).__name__, e)
                        (out / "videos" / name).unlink(missing_ok=True)
            finished.append(b)
            bar.update(1)
        obs = res.obs
        if finished:
            new_obs = assign(finished)
            obs = new_obs if new_obs is not None else obs
    bar.close()
    return rows


def _as_actor(policy_or_actor, per_episode_sampling: bool, device):
    """An actor as is; a ``Policy`` wrapped in :class:`PolicyActor`."""
    if isinstance(policy_or_actor, Policy):
        return PolicyActor(policy_or_actor, per_episode_sampling=per_episode_sampling, device=device)
    if isinstance(policy_or_actor, EpisodeActor):
        return policy_or_actor
    raise TypeError(f"{type(policy_or_actor).__name__} is not a Policy (wmrl.kernel.interfaces.Policy) nor an "
                    "episode actor (chunk_size, needs_images, begin, act)")


def _worker(make_actor, make_suite, queue, B, seed, out, videos_per_task, video_camera, video_size, fps,
            per_episode_sampling, device, position) -> list[dict]:
    torch.set_num_threads(1)
    actor = _as_actor(make_actor(), per_episode_sampling, device)
    rows = _run_queue(actor, make_suite(), queue, min(B, len(queue)), seed, out, videos_per_task, video_camera,
                      video_size, fps, True, desc=f"evaluate[{position}]", position=position)
    return list(rows.values())


def _run_parallel(make_actor, make_suite, queue, workers: int, B: int, seed: int, out: Path | None,
                  videos_per_task: int, video_camera: str, video_size, fps: int, per_episode_sampling: bool,
                  device) -> dict[tuple[str, int], dict]:
    """Deal the queue round-robin to ``workers`` spawned processes (one torch thread each); every
    episode is still fixed by its (task, j), so the rows equal a one-process run."""
    from wmrl.kernel.workers import worker_pool

    parts = [queue[k::workers] for k in range(workers)]
    rows: dict[tuple[str, int], dict] = {}
    with worker_pool(workers) as pool:       # the workers die with this process
        futs = [pool.submit(_worker, make_actor, make_suite, part, B, seed, out, videos_per_task, video_camera,
                            tuple(video_size), fps, per_episode_sampling, str(device), k + 1)
                for k, part in enumerate(parts) if part]
        for f in futs:
            for r in f.result():
                rows[(r["task"], r["episode"])] = r
    return rows


def evaluate_policy(policy_or_actor, suite, episodes_per_task: int = 50, batch_size: int = 10, seed: int = 0,
                    out_dir: str | Path | None = None, videos_per_task: int = 2, video_camera: str = "agentview",
                    video_size: tuple[int, int] = (128, 128), tasks: list[str] | None = None,
                    per_episode_sampling: bool = True, device: str = "cpu", fps: int = 20,
                    progress: bool = True, workers: int = 1, make_actor=None, make_suite=None) -> dict[str, Any]:
    """Evaluate on every task of ``suite``; returns the report dict (also written to ``out_dir``).

    Args:
        policy_or_actor: a ``Policy`` (wrapped in :class:`PolicyActor`) or an actor (e.g.
            ``suite.make_expert(noise)``).
        suite: the task suite (see module docstring).
        episodes_per_task: episodes per task; episode ``j`` uses eval init state ``j``.
        batch_size: parallel environments ``B`` (results do not depend on it).
        seed: base seed of the per-episode seeds.
        out_dir: where ``episodes.csv``, ``episodes.json`` and ``videos/<task>_ep<j>.mp4`` go
            (nothing is written when ``None``).
        videos_per_task: the first ``n`` episodes of each task are filmed from ``video_camera`` at
            ``video_size`` (``(Hi, Wi)``), every control step, ``fps`` frames/s.
        tasks: subset of the suite's tasks (default: all).
        workers: processes (spawned; one torch thread each) that share the episode queue; the
            results equal a one-process run. ``workers > 1`` needs ``make_actor`` and
            ``make_suite``: picklable zero-argument callables (e.g. ``functools.partial`` of a
            module-level function) that rebuild the actor / policy and the suite in a worker.

    Returns:
        ``{"tasks": {task: {success_rate, ci95: [lo, hi], successes, episodes, mean_length,
        mean_length_success}}, "overall": {...}, "episodes": [rows], "episodes_sha256", ...}``
        where a row is ``{task, episode, init_index, seed, success, length, reward}``.

    Raises:
        ValueError: ``episodes_per_task < 1``, ``batch_size < 1`` or a task not in the suite.
    """
    if episodes_per_task < 1:
        raise ValueError(f"episodes_per_task must be >= 1, got {episodes_per_task}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    task_names = list(tasks) if tasks else list(suite.task_names)
    for t in task_names:
        if t not in suite.task_names:
            raise ValueError(f"task {t!r} is not in the suite (tasks: {suite.task_names})")
    out = Path(out_dir) if out_dir is not None else None
    queue = [(t, j) for t in task_names for j in range(episodes_per_task)]
    workers = max(1, min(int(workers), len(queue)))
    if workers > 1:
        if make_actor is None or make_suite is None:
            raise ValueError("evaluate_policy(workers > 1) needs make_actor and make_suite: picklable "
                             "callables that rebuild the actor / suite in each worker process")
        rows = _run_parallel(make_actor, make_suite, queue, workers, int(batch_size), seed, out,
                             videos_per_task, video_camera, video_size, fps, per_episode_sampling, device)
        B = min(int(batch_size), len(queue))
    else:
        actor = _as_actor(policy_or_actor, per_episode_sampling, device)
        B = min(int(batch_size), len(queue))
        rows = _run_queue(actor, suite, queue, B, seed, out, videos_per_task, video_camera, video_size, fps,
                          progress)

    table = [rows[(t, j)] for t in task_names for j in range(episodes_per_task)]
    report = _report(table, task_names, suite, episodes_per_task, B, seed)
    if out is not None:
        _write_tables(out, table, report)
    for t, v in report["tasks"].items():
        log.info("%-22s success %.2f  (95%% CI %.2f-%.2f, n=%d)  mean length %.1f", t, v["success_rate"],
                 v["ci95"][0], v["ci95"][1], v["episodes"], v["mean_length"])
    return report


def _report(table: list[dict], task_names: list[str], suite, episodes_per_task: int, B: int, seed: int) -> dict:
    """The report of :func:`evaluate_policy` from its episode rows (in task, episode order)."""
    per_task = {}
    for t, outcomes in per_task_outcomes(table, task_names).items():
        r = [x for x in table if x["task"] == t]
        s = success_summary(outcomes)
        succ_len = [x["length"] for x in r if x["success"]]
        per_task[t] = {"success_rate": s["rate"], "ci95": s["ci95"], "successes": s["successes"], "episodes": s["n"],
                       "mean_length": float(np.mean([x["length"] for x in r])),
                       "mean_length_success": float(np.mean(succ_len)) if succ_len else None}
    s = success_summary([x["success"] for x in table])
    digest = hashlib.sha256(json.dumps(
        [[x["task"], x["episode"], x["init_index"], x["seed"], x["success"], x["length"]] for x in table]
    ).encode()).hexdigest()
    return {
        "tasks": per_task,
        "overall": {"success_rate": s["rate"], "ci95": s["ci95"], "successes": s["successes"],
                    "episodes": s["n"], "mean_task_success_rate": float(np.mean([v["success_rate"] for v in per_task.values()]))},
        "episodes_per_task": episodes_per_task, "batch_size": B, "seed": seed,
        "episodes_sha256": digest,
        "suite": suite.describe(),
        "episodes": table,
    }


def _write_tables(out: Path, table: list[dict], report: dict) -> None:
    """``episodes.csv`` and ``episodes.json`` in ``out``; the videos found there go into ``report``."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "episodes.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(table[0]))
        w.writeheader()
        w.writerows(table)
    (out / "episodes.json").write_text(json.dumps(table, indent=1))
    report["videos"] = sorted(str(p.relative_to(out)) for p in (out / "videos").glob("*.mp4")) \
        if (out / "videos").is_dir() else []


def format_report(report: dict) -> str:
    """A plain-text table of a report's per-task results."""
    lines = [f"{'task':<24}{'success':>8}  {'95% CI':>13}  {'n':>4}  {'mean len':>8}"]
    for t, v in report["tasks"].items():
        lines.append(f"{t:<24}{v['success_rate']:>8.2f}  {v['ci95'][0]:>6.2f}-{v['ci95'][1]:<6.2f}  "
                     f"{v['episodes']:>4}  {v['mean_length']:>8.1f}")
    o = report["overall"]
    lines.append(f"{'overall':<24}{o['success_rate']:>8.2f}  {o['ci95'][0]:>6.2f}-{o['ci95'][1]:<6.2f}  {o['episodes']:>4}")
    return "\n".join(lines)
