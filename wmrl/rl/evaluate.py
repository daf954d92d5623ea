"""Success evaluation: the one Wilson interval, the one per-task success summary, and the chunk-env
evaluator :func:`evaluate_success` (the suite benchmark runner, with per-episode seeds and videos,
is :func:`wmrl.evaluation.evaluate_policy`; both summarise with :func:`success_summary`).

Confidence intervals: Wilson score interval (Wilson 1927; Brown, Cai & DasGupta 2001 recommend it
over the normal approximation for small ``n``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from wmrl.kernel.interfaces import ChunkEnv, Policy
from wmrl.kernel.types import Start
from wmrl.rl.rollout import collect_groups, rollout_returns


def wilson_interval(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (95 % by default).

    Returns ``(low, high)`` in [0, 1]: exactly ``0.0`` low when ``successes == 0``, exactly ``1.0``
    high when ``successes == n``; ``(0.0, 1.0)`` when ``n == 0``.

    Raises:
        ValueError: ``successes`` outside ``[0, n]``.
    """
    if n < 0 or not 0 <= successes <= max(n, 0):
        raise ValueError(f"need 0 <= successes <= n, got successes={successes}, n={n}")
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    lo = 0.0 if successes == 0 else max(0.0, centre - half)
    hi = 1.0 if successes == n else min(1.0, centre + half)
    return lo, hi


def success_summary(outcomes: Sequence[bool]) -> dict:
    """``{"rate": k / n, "ci95": [lo, hi], "successes": k, "n": n}`` of binary outcomes (``n >= 1``)."""
    k, n = int(sum(bool(x) for x in outcomes)), len(outcomes)
    return {"rate": k / n, "ci95": list(wilson_interval(k, n)), "successes": k, "n": n}


def per_task_outcomes(rows: Sequence[dict], tasks: Sequence[str] | None = None) -> dict[str, list[bool]]:
    """``{task: [success, ...]}`` of episode rows ``{"task", "success", ...}`` (tasks in first-seen
    order unless given)."""
    names = list(tasks) if tasks is not None else list(dict.fromkeys(r["task"] for r in rows))
    return {t: [bool(r["success"]) for r in rows if r["task"] == t] for t in names}


@torch.no_grad()
def evaluate_success(env: ChunkEnv, policy: Policy, starts: Sequence[Start], max_chunks: int, seed: int = 0,
                     progress: bool = False) -> dict:
    """Success of ``policy`` on ``env`` from every start once (batches of ``env.num_envs``; results do
    not depend on the batch size for a deterministic policy and env).

    Returns ``{"success": mean, "n": M, "ci95": [lo, hi], "per_task": {task: {"success", "n",
    "ci95"}}, "episodes": [{"task", "init_index", "success"}]}``."""
    gen = torch.Generator().manual_seed(seed)
    ros = collect_groups(env, policy, starts, 1, max_chunks, generator=gen, progress=progress)
    _, succ, gids = rollout_returns(ros, "success")
    rows = [{"task": starts[int(g)].task_name, "init_index": starts[int(g)].init_index, "success": bool(s)}
            for g, s in zip(gids, succ)]
    per_task = {}
    for t, k in per_task_outcomes(rows).items():
        s = success_summary(k)
        per_task[t] = {"success": s["rate"], "n": s["n"], "ci95": s["ci95"]}
    s = success_summary([r["success"] for r in rows])
    return {"success": s["rate"], "n": s["n"], "ci95": s["ci95"], "per_task": per_task, "episodes": rows}
