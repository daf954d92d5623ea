"""The pipeline's figures (a non-entry module of the composition roots): success before / after per
task with Wilson 95 % intervals, and imagined vs real success over GRPO iterations."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def plot_before_after(before: dict, after: dict, path: Path, title: str = "") -> Path:
    """Grouped bars of per-task success before / after with Wilson 95 % CI error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(before["per_task"])
    x = np.arange(len(tasks) + 1)
    fig, ax = plt.subplots(figsize=(1.8 * len(x) + 2, 3.6))
    for off, (lab, r, col) in zip((-0.2, 0.2), (("before (BC)", before, "#999999"), ("after GRPO in imagination", after, "#2a7ab9"))):
        vals = [r["per_task"][t]["success"] for t in tasks] + [r["success"]]
        cis = [r["per_task"][t]["ci95"] for t in tasks] + [r["ci95"]]
        err = np.array([[v - c[0] for v, c in zip(vals, cis)], [c[1] - v for v, c in zip(vals, cis)]])
        ax.bar(x + off, vals, 0.4, yerr=np.clip(err, 0, None), capsize=3, label=lab, color=col)
    ax.set_xticks(x, tasks + ["mean"], rotation=15)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("real-sim success (held-out init states)")
    ax.set_title(title or "success before / after, 95 % Wilson CI")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_imagined_vs_real(history: list[dict], evals: list[dict], path: Path) -> Path:
    """Imagined success per GRPO iteration against periodic real-sim success (and, with a world model
    in the loop, the real success of each refresh's rollouts)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    if history:
        ax.plot([h["iteration"] for h in history], [h["success_rate"] for h in history], "-o", ms=3,
                label="imagined success (training rollouts)")
    if evals:
        it = [e["iteration"] for e in evals]
        s = [e["success"] for e in evals]
        lo = [e["success"] - e["ci95"][0] for e in evals]
        hi = [e["ci95"][1] - e["success"] for e in evals]
        ax.errorbar(it, s, yerr=[lo, hi], fmt="-s", capsize=3, label="real-sim success (held-out)")
    refresh = [h for h in history if "refresh/real_success" in h]
    if refresh:
        ax.plot([h["iteration"] for h in refresh], [h["refresh/real_success"] for h in refresh], "^", ms=6,
                label="real-sim success of the refresh rollouts (train init states, RL sampler)")
    ax.set_xlabel("GRPO iteration")
    ax.set_ylabel("success")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------
# run
# ------------------------------------------------------------------------------------------


def real_curve(grpo_report: dict, before: dict, after: dict) -> list[dict]:
    """Real-sim success over GRPO iterations: the pipeline's before / after evaluations (held-out,
    ``episodes_per_task`` each) at iteration 0 and the last, plus GRPO's own periodic evaluations."""
    n = int(grpo_report.get("iterations") or 0)
    pts = {0: {"iteration": 0, "success": before["success"], "ci95": before["ci95"]},
           n: {"iteration": n, "success": after["success"], "ci95": after["ci95"]}}
    for e in grpo_report.get("evals", []):
        pts.setdefault(int(e["iteration"]), {k: e[k] for k in ("iteration", "success", "ci95")})
    return [pts[k] for k in sorted(pts)]

