"""``wmrl pipeline``: the main job, from demonstrations to a policy improved in imagination, with the
evidence.

Stages (each in its own sub-directory of the run, with its own ``config.yaml`` and ``report.json``;
each is a ``run(cfg, ctx)`` of its entry-point module, called in process):

1. ``collect``      noisy scripted demos of the suite tasks -> EpisodeStore (``wmrl collect``)
2. ``bc``           behaviour cloning of the flow-matching VLA policy (``wmrl train-policy``)
3. ``bc_rollouts``  real-sim rollouts of the BC policy from train init states -> EpisodeStore
4. ``worldmodel`` / ``critic``  trained on demos + BC rollouts (``wmrl train-worldmodel`` / ``train-critic``;
   the critic also on frames of this world model, ``stages.critic.imagined``)
5. ``imagination_check``  the BC policy's imagined rollouts (GRPO's groups, sampler and horizon)
   replayed open loop in the sim: does imagination reward actions that work? (``wmrl.fidelity``;
   ``imagination_check.starts_per_task=0`` skips it)
6. ``eval_before``  real-sim success of the BC policy on the held-out (eval) init states
7. ``grpo``         GRPO in imagination (``wmrl post-train env=imagination``)
8. ``eval_after``   real-sim success of the post-trained policy on the same held-out init states
9. ``report.json`` (wall time per stage, success per task before/after with Wilson 95 % CIs, the world
   model's held-out PSNR gain and end-effector position error per horizon), plots
   (``success_before_after.png``, ``imagined_vs_real.png``) and videos (``videos/*.mp4``).

``preset=debug`` shrinks every stage so that the whole loop runs in about a minute (tests).
Every ``stages.<stage>`` key is checked against that stage's own config before anything runs (an
unknown key or a value of the wrong type is an error, not a setting silently ignored 20 minutes later).
With ``resume=true`` (default) a stage whose ``report.json`` exists is not run again, provided it was run
with the same settings (``stage_inputs.json``); otherwise the pipeline stops and says which stage
directories to remove (it never overwrites results).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import hydra
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from wmrl.kernel.types import Start
from wmrl.refresh import store_like
from wmrl.rl.rollout import record_episodes
from wmrl.run import machine
from wmrl.run.builders import compose_stage_config
from wmrl.run.builders import container as _container
from wmrl.run.common import RunContext, run_main

log = logging.getLogger("wmrl.pipeline")


# ------------------------------------------------------------------------------------------
# Stage plumbing
# ------------------------------------------------------------------------------------------


# stage -> (its entry point: config and wmrl.run module of that name, Hydra group selections it always gets);
# bc_rollouts is the pipeline's own
STAGE_CONFIGS: dict[str, tuple[str, list[str]]] = {
    "collect": ("collect", []), "bc": ("train_policy", []), "worldmodel": ("train_worldmodel", []),
    "critic": ("train_critic", []), "grpo": ("post_train", ["env=imagination"])}
STAGE_ORDER = ("collect", "bc", "bc_rollouts", "worldmodel", "critic", "imagination_check", "eval_before", "grpo",
               "eval_after")
# settings that do not change a stage's results: a resumed run may change them
RESULT_NEUTRAL_KEYS = frozenset({"num_threads", "workers", "progress", "tensorboard", "resume"})


def _leaves(d: dict, prefix: str = ""):
    for k, v in d.items():
        if isinstance(v, dict) and v:
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def _type_ok(value, default) -> bool:
    if value is None or default is None or (isinstance(value, str) and value.startswith("${")):
        return True
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, int):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return True


class SettingsRefused(ValueError):
    """The pipeline refused its settings before running anything (unknown preset, bad stage settings,
    a resume that would mix results of other settings)."""


def check_stage_overrides(cfg: DictConfig) -> int:
    """Check every key under ``cfg.stages.<stage>`` against the stage's own composed config (its entry
    point's, with ``cfg.stage_groups``; for ``bc_rollouts`` the pipeline config's defaults): the key must
    exist there (below a node with ``_target_`` or a ``null`` default anything goes) and a value must have
    the default's type (bool, int, float; ``null`` always allowed). Stage configs are merged onto the
    entry points' configs without Hydra's struct mode, so without this check a misspelt key
    (``+stages.grpo.iteratons=3``) would be ignored and a wrong type fail only when its stage starts.

    Returns the number of keys checked. Raises :class:`SettingsRefused` (a ``ValueError``) naming every bad
    key and what to change."""
    import difflib

    stages = OmegaConf.to_container(cfg.get("stages") or {}, resolve=False)
    groups = cfg.get("stage_groups") or {}
    errors: list[str] = []
    checked = 0
    for stage, over in stages.items():
        if over is None:
            continue
        if stage == "bc_rollouts":
            base, where = compose_stage_config("pipeline").stages.bc_rollouts, "configs/pipeline.yaml stages.bc_rollouts"
        elif stage in STAGE_CONFIGS:
            name, g = STAGE_CONFIGS[stage]
            base = compose_stage_config(name, groups=g + [str(x) for x in (groups.get(stage) or [])])
            where = f"configs/{name}.yaml"
        else:
            errors.append(f"stages.{stage}: no such configurable stage (stages: bc_rollouts, {', '.join(STAGE_CONFIGS)})")
            continue
        base = OmegaConf.to_container(base, resolve=False)
        for key, value in _leaves(over):
            checked += 1
            node, parts = base, key.split(".")
            for i, part in enumerate(parts):
                if not isinstance(node, dict) or "_target_" in node:
                    break                   # a free-form value or an instantiable object's kwargs
                if part not in node:
                    near = difflib.get_close_matches(part, [str(k) for k in node], n=3)
                    hint = f"; did you mean {', '.join(near)}?" if near else f"; keys there: {', '.join(map(str, node))}"
                    errors.append(f"stages.{stage}.{'.'.join(parts[:i + 1])}: no such key in the {stage} stage's "
                                  f"config ({where}){hint}")
                    break
                node = node[part]
                if i == len(parts) - 1 and not _type_ok(value, node):
                    kind = {"bool": "true or false", "int": "an integer", "float": "a number"}[type(node).__name__]
                    errors.append(f"stages.{stage}.{key}={value!r}: expected {kind}, like the {stage} stage's "
                                  f"default ({node!r}, {where})")
    if errors:
        raise SettingsRefused("bad stage settings (nothing was run):\n  " + "\n  ".join(errors))
    return checked


def _stage_inputs(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """A stage's resolved config as dotted keys, paths inside the run directory written relative to it
    (``<run_dir>/...``) and result-neutral settings left out: what a resumed stage is compared on."""
    root = str(run_dir)

    def norm(v):
        if isinstance(v, str):
            return v.replace(root, "<run_dir>")
        if isinstance(v, list):
            return [norm(x) for x in v]
        return v

    flat = dict(_leaves(OmegaConf.to_container(cfg, resolve=True)))
    return {k: norm(v) for k, v in flat.items() if k.split(".")[-1] not in RESULT_NEUTRAL_KEYS}


class ResumeRefused(SettingsRefused):
    """A resumed pipeline would mix results of other settings; raised before any stage runs."""


class Stages:
    """Runs named stages in ``ctx.child(name)``, timing them and skipping finished ones on resume.

    A finished stage (``<stage>/report.json``) is reused only when it was run with the same settings: its
    ``stage_inputs.json`` (written when it finished) must equal this run's (:func:`_stage_inputs`).

    ``order``: the stages in run order, for the up-front check and the directories an error names.

    Raises :class:`ResumeRefused` (a ``ValueError``; before anything runs): a stage to reuse was run with
    other settings, or a stage that will run has finished stages after it (their results came from the
    old one). Every stage before the one refused is reused, so nothing new has run at that point."""

    INPUTS_FILE = "stage_inputs.json"

    def __init__(self, ctx: RunContext, resume: bool, order: Sequence[str] = ()):
        self.ctx, self.resume, self.order = ctx, resume, list(order)
        self.wall: dict[str, float] = {}
        self.reports: dict[str, dict] = {}
        if resume:
            self._check_order()

    def _done(self, name: str) -> bool:
        return (self.ctx.out_dir / name / "report.json").is_file()

    def _finished_after(self, name: str) -> list[str]:
        """Stages after ``name`` in ``order`` that have results."""
        i = self.order.index(name) if name in self.order else len(self.order)
        return [m for m in self.order[i + 1:] if self._done(m)]

    def _check_order(self) -> None:
        for name in self.order:
            if not self._done(name):
                later = self._finished_after(name)
                if later:
                    d = self.ctx.out_dir
                    raise ResumeRefused(
                        f"stage {name} has no results in {d} but the later stage(s) {', '.join(later)} do: they came "
                        f"from an earlier {name}. Remove them to rerun from {name} "
                        f"(rm -r {' '.join(str(d / m) for m in later)}), or start a new run directory "
                        f"(hydra.run.dir=...)")
                return

    def _check_same_inputs(self, name: str, cfg: DictConfig) -> None:
        f = self.ctx.out_dir / name / self.INPUTS_FILE
        if not f.is_file():
            log.warning("stage %s: no %s (run by an older wmrl): reusing it without comparing its settings", name,
                        self.INPUTS_FILE)
            return
        old = json.loads(f.read_text())
        new = json.loads(json.dumps(_stage_inputs(cfg, self.ctx.out_dir)))
        diff = [f"{k}: {old.get(k, '<unset>')!r} -> {new.get(k, '<unset>')!r}" for k in sorted(set(old) | set(new))
                if old.get(k, "<unset>") != new.get(k, "<unset>")]
        if diff:
            d = self.ctx.out_dir
            again = [name] + self._finished_after(name)
            shown = "; ".join(diff[:8]) + (f"; ... ({len(diff)} in all)" if len(diff) > 8 else "")
            raise ResumeRefused(
                f"stage {name} in {d} was run with other settings ({shown}); it is not rerun over its results. "
                f"To rerun it with these settings remove it and the stages after it "
                f"(rm -r {' '.join(str(d / m) for m in again)}), or start a new run directory (hydra.run.dir=...), "
                f"or rerun every stage here (resume=false)")

    def run(self, name: str, cfg: DictConfig, fn) -> dict:
        rp = self.ctx.out_dir / name / "report.json"
        if self.resume and rp.is_file():
            self._check_same_inputs(name, cfg)
            rep = json.loads(rp.read_text())
            log.info("stage %s: done before, reusing %s", name, rp)
            self.wall[name] = float(rep.get("wall_time_s", 0.0))
        else:
            t0 = time.time()
            log.info("stage %s ...", name)
            sub = self.ctx.child(name, cfg)
            rep = fn(cfg, sub)
            rep = dict(rep)
            rep["wall_time_s"] = round(time.time() - t0, 3)
            sub.finish(rep)
            (sub.out_dir / self.INPUTS_FILE).write_text(json.dumps(_stage_inputs(cfg, self.ctx.out_dir), indent=1))
            rep = json.loads(rp.read_text())
            self.wall[name] = rep["wall_time_s"]
            log.info("stage %s: %.1f s", name, self.wall[name])
        self.reports[name] = rep
        return rep


def _module_run(module: str):
    import importlib

    try:
        mod = importlib.import_module(f"wmrl.run.{module}")
    except ModuleNotFoundError as e:
        if e.name == f"wmrl.run.{module}":
            raise RuntimeError(f"pipeline stage needs wmrl.run.{module}, which is not in this version") from None
        raise
    return mod.run


# ------------------------------------------------------------------------------------------
# Stores (BC rollouts are recorded by wmrl.refresh.record_episodes)
# ------------------------------------------------------------------------------------------


def merge_stores(sources: list[Path], dest: Path, source: str = "pipeline") -> dict:
    """Copy every episode of ``sources`` (EpisodeStores with the same cameras/dims) into a new store."""
    from wmrl.kernel.storage import EpisodeStore

    out = store_like(EpisodeStore.open(sources[0], "r"), dest, source)
    n = 0
    for p in sources:
        st = EpisodeStore.open(p, "r")
        for i in range(len(st)):
            out.append(st.episode(i))
            n += 1
    return {"episodes": n, "path": str(dest)}


# ------------------------------------------------------------------------------------------
# Plots and videos
# ------------------------------------------------------------------------------------------


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


def command_line_overrides() -> tuple[list[str], set[str]]:
    """The running Hydra app's command-line overrides (``key=value`` strings, ``hydra.*`` excluded) and
    the names of its config groups; ``([], set())`` outside a Hydra app (tests, ``compose``)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return [], set()
    hc = HydraConfig.get()
    return list(hc.overrides.task), set(hc.runtime.choices.keys())


def apply_preset(cfg: DictConfig, overrides: Sequence[str] = (), groups: Collection[str] = ()) -> DictConfig:
    """Merge ``cfg.presets[cfg.preset]`` onto ``cfg`` (no-op for ``preset=null``), then re-apply the
    command line's value overrides so that they win over the preset, as over any config value:
    ``wmrl pipeline preset=steering stages.grpo.iterations=60`` runs 60 iterations, not the preset's 40.

    Args:
        overrides: Hydra override strings (``key=value``, ``+key=value``, ``++key=value``), e.g.
            :func:`command_line_overrides`; deletions (``~key``) and config group selections are
            skipped (the groups were chosen when the config was composed).
        groups: config group names (``suite``, ...), whose overrides are selections, not values.

    Raises: :class:`SettingsRefused` (a ``ValueError``) for an unknown preset name."""
    name = cfg.get("preset")
    if not name:
        return cfg
    presets = cfg.get("presets") or {}
    if name not in presets:
        raise SettingsRefused(f"unknown pipeline preset {name!r}; known: {sorted(presets)}")
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))  # not struct: presets may add keys
    merged = OmegaConf.merge(cfg, presets[name])
    if overrides:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        for o in OverridesParser.create().parse_overrides(list(overrides)):
            key = o.key_or_group
            if o.is_delete() or key in groups or key == "preset" or key.startswith("hydra."):
                continue
            OmegaConf.update(merged, key, o.value(), merge=True, force_add=True)  # as Hydra applies it
    with open_dict(merged):
        merged.preset = name
    return merged


def _eval_policy(policy_path: Path, cfg: DictConfig, tasks: dict, suite, out_dir: Path | None, videos: int) -> dict:
    from functools import partial

    from wmrl.run.builders import build_actor, build_suite, evaluate_real

    suite_cfg = _container(cfg.suite)
    sampler_cfg = _container(cfg.eval_sampler) if cfg.get("eval_sampler") else None
    make_actor = partial(build_actor, str(policy_path), 0.0, suite_cfg, str(cfg.device), sampler_cfg)
    r = evaluate_real(make_actor(), tasks, int(cfg.evaluation.episodes_per_task), int(cfg.evaluation.num_envs),
                      int(cfg.seed), suite=suite, out_dir=out_dir, videos_per_task=videos, progress=True,
                      workers=int(cfg.evaluation.get("workers") or 1), make_actor=make_actor,
                      make_suite=partial(build_suite, suite_cfg))
    r["policy"] = str(policy_path)
    return r


def _imagination_check(c: DictConfig, gcfg: DictConfig, bc_ckpt: Path, tasks: dict, suite) -> dict:
    """Before GRPO: does this run's imagination rank the BC policy's rollouts (GRPO's RL sampler or
    its latent-noise steering, group size and horizon, GRPO's first train init states) like the sim? See
    :func:`wmrl.fidelity.replay_check`."""
    from wmrl.fidelity import replay_check
    from wmrl.rl.starts import ContextStarts, InitStateStarts
    from wmrl.run.builders import (
        load_policy,
        make_imagination_env,
        make_sim_env,
        rl_policy,
        train_n_init,
    )

    policy, policy_cfg = load_policy(bc_ckpt, str(c.device))
    policy, _, rl_sampler = rl_policy(policy, policy_cfg, gcfg, str(c.device))
    policy.eval()
    if rl_sampler is not None:
        policy.sampler = rl_sampler
    g = int(gcfg.grpo.group_size)
    starts = InitStateStarts(tasks, n_init=train_n_init(gcfg.starts, suite, tasks), per_task=int(c.starts_per_task),
                             split="train", seed=int(c.seed))(0)
    sim_env = make_sim_env(int(c.num_envs), suite=suite)        # renders the context frames, then replays
    starts = ContextStarts(None, sim_env).contextualize(starts)
    kw = _container(gcfg.env.get("imagination")) or {}
    imag = make_imagination_env(str(gcfg.env.world_model), str(gcfg.env.critic), len(starts) * g, seed=int(c.seed),
                                device=str(c.device), **kw)
    r = replay_check(imag, sim_env, policy, starts, g, int(gcfg.grpo.max_chunks),
                     generator=torch.Generator().manual_seed(int(c.seed)), progress=True)
    r["sampler"] = repr(policy.sampler)  # the RL sampler, or the latent-noise steering's
    acc_s = "n/a (no group with both outcomes in the sim)" if r["pair_accuracy"] is None else f"{r['pair_accuracy']:.2f} (0.5 = chance)"
    log.info("imagination check: imagined success %.3f, the same actions replayed in the sim %.3f; within-group "
             "pair accuracy %s, %d/%d groups mixed in imagination, %d in the sim",
             r["imagined_success"], r["replayed_success"], acc_s, r["mixed_groups_imagined"],
             r["groups"], r["mixed_groups_real"])
    acc, prec = r["pair_accuracy"], r["precision"]
    if (acc is not None and acc < 0.6) or (prec is not None and prec < 0.5):
        log.warning("imagination check: the world model and critic reward actions that fail in the sim (pair "
                    "accuracy %s, precision of imagined successes %s); GRPO in imagination is unlikely to improve "
                    "real success. Train the world model longer or on more episodes (stages.worldmodel), or "
                    "compare with env=sim (wmrl bench grpo)", acc, prec)
    return r


def run(cfg: DictConfig, ctx: RunContext) -> dict:
    """The main job (see module docstring). Returns the report: ``stages`` (wall time per stage),
    ``before`` / ``after`` (success per task with CIs), ``success_gain``, paths of plots, videos and
    checkpoints.

    Raises:
        SettingsRefused: an unknown preset, bad stage settings, or a resume that would mix results of
            other settings (:class:`ResumeRefused`). Nothing has run; a run directory that had a
            ``config.yaml`` gets it back (it describes the results there).
        ValueError: bad input data.
    """
    try:
        cfg = apply_preset(cfg, *command_line_overrides())
        check_stage_overrides(cfg)
        return _run(cfg, ctx)
    except SettingsRefused:
        ctx.restore_config()
        raise


def _run(cfg: DictConfig, ctx: RunContext) -> dict:
    """:func:`run` with the preset applied and the stage settings checked."""
    saved = OmegaConf.to_container(cfg, resolve=True)
    saved.pop("presets", None)           # the applied one is merged in (and named by `preset`)
    (ctx.out_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(saved)))
    from wmrl.run.builders import make_sim_env

    suite_cfg = _container(cfg.suite)
    suite_cfg["tasks"] = list(cfg.tasks)
    suite = hydra.utils.instantiate(suite_cfg)
    tasks = {t: suite.instruction(t) for t in suite.task_names}
    estimate = machine.announce_estimate(cfg, suite) if cfg.get("estimate", True) else None
    check_fidelity = int((cfg.get("imagination_check") or {}).get("starts_per_task", 0) or 0) > 0
    stages = Stages(ctx, resume=bool(cfg.resume),
                    order=[n for n in STAGE_ORDER if n != "imagination_check" or check_fidelity])
    out = ctx.out_dir
    task_list = list(tasks)
    seed = int(cfg.seed)
    # threads chosen once, at the start (wmrl.run.common.resolve_threads), for every stage: a stage that
    # chose again could see the previous stage's workers still exiting and change the thread count
    common = {"seed": seed, "num_threads": int(getattr(ctx, "num_threads", 0) or 0), "device": cfg.device}
    S = cfg.stages
    G = cfg.get("stage_groups") or {}

    def stage_config(stage: str, overrides: dict) -> DictConfig:   # the stage's entry-point config + overrides
        name, always = STAGE_CONFIGS[stage]
        return compose_stage_config(name, overrides, groups=always + [str(x) for x in (G.get(stage) or [])])

    def entry(stage: str):   # the run() of the entry point whose config stage_config composed
        return _module_run(STAGE_CONFIGS[stage][0])

    # 1. noisy scripted demos
    demos = out / "collect" / "demos.zarr"
    c = stage_config("collect", {**common, **_container(S.collect), "suite": suite_cfg, "tasks": task_list,
                                 "out": str(demos)})
    stages.run("collect", c, entry("collect"))

    # 2. behaviour cloning
    c = stage_config("bc", {**common, **_container(S.bc), "store": str(demos)})
    stages.run("bc", c, entry("bc"))
    bc_ckpt = out / "bc" / "checkpoints" / "last"

    # 3. real-sim rollouts of the BC policy from train init states
    rollouts = out / "bc_rollouts" / "rollouts.zarr"
    mixed = out / "bc_rollouts" / "demos_and_rollouts.zarr"

    def _bc_rollouts(scfg, sctx):
        from wmrl.kernel.storage import EpisodeStore
        from wmrl.run.builders import load_policy, using_sampler

        policy, _ = load_policy(bc_ckpt, cfg.device)
        policy.eval()
        env = make_sim_env(int(scfg.num_envs), suite=suite)
        n = int(scfg.episodes_per_task)
        rng = np.random.default_rng([seed, 3])
        starts = [Start(task_name=t, instruction=tasks[t], init_index=int(k), split="train")
                  for t in task_list for k in rng.choice(int(scfg.n_init), size=n, replace=False)]
        sampler = hydra.utils.instantiate(scfg.sampler) if scfg.get("sampler") else None
        with using_sampler(policy, sampler):
            eps = record_episodes(env, policy, starts, int(scfg.max_steps),
                                  generator=torch.Generator().manual_seed(seed + 5), source="bc_rollout", progress=True)
        st = store_like(EpisodeStore.open(demos, "r"), rollouts, "bc_rollout")
        for e in eps:
            st.append(e)
        merge_stores([demos, rollouts], mixed)
        succ = {t: float(np.mean([e.success for e in eps if e.task_name == t])) for t in task_list}
        return {"episodes": len(eps), "success_per_task": succ, "store": str(rollouts), "mixed_store": str(mixed)}

    stages.run("bc_rollouts", OmegaConf.create({**common, **_container(S.bc_rollouts)}), _bc_rollouts)

    # 4. world model + critic on demos + rollouts
    c = stage_config("worldmodel", {**common, **_container(S.worldmodel), "store": str(mixed)})
    wm_rep = stages.run("worldmodel", c, entry("worldmodel"))
    wm_ckpt = out / "worldmodel" / "checkpoints" / "last"
    critic_over = _container(S.critic) or {}
    critic_over["imagined"] = {**(critic_over.get("imagined") or {}), "world_model": str(wm_ckpt)}
    c = stage_config("critic", {**common, **critic_over, "store": str(mixed)})
    stages.run("critic", c, entry("critic"))
    critic_ckpt = out / "critic" / "checkpoints" / "last"

    # 5-8. imagination check, real-sim evaluation before, GRPO in imagination, evaluation after
    gcfg = stage_config(
        "grpo",
        {**common, **_container(S.grpo), "checkpoint": str(bc_ckpt), "tasks": task_list, "suite": suite_cfg,
         "starts": {**(_container(S.grpo.get("starts", {})) or {}), "store": str(mixed)},   # keyframes: demos + rollouts
         "refresh": {**(_container(S.grpo.get("refresh", {})) or {}), "store": str(mixed)},  # replay: the world model's data
         "env": {**_container(S.grpo.get("env", {}) or {}), "world_model": str(wm_ckpt), "critic": str(critic_ckpt)}})
    fid = None
    if check_fidelity:   # its config also holds what it takes from GRPO's (compared when the stage is reused)
        used = {"rl_sampler": gcfg.get("rl_sampler"), "steer": gcfg.get("steer"), "group_size": gcfg.grpo.group_size,
                "max_chunks": gcfg.grpo.max_chunks, "n_init": gcfg.starts.get("n_init"),
                "env": {k: gcfg.env.get(k) for k in ("world_model", "critic", "imagination")}}
        fid = stages.run("imagination_check",
                         OmegaConf.create({**common, **_container(cfg.imagination_check), "grpo": _container(used)}),
                         lambda c_, x_: _imagination_check(c_, gcfg, bc_ckpt, tasks, suite))
    nv = int(cfg.videos.per_task)
    ev = {**common, "suite": suite_cfg, "tasks": task_list, "evaluation": _container(cfg.evaluation),
          "eval_sampler": _container(cfg.get("eval_sampler")), "videos_per_task": nv}
    before = stages.run("eval_before", OmegaConf.create({**ev, "checkpoint": str(bc_ckpt)}),
                        lambda c_, x_: _eval_policy(bc_ckpt, cfg, tasks, suite, x_.out_dir, nv))
    grep = stages.run("grpo", gcfg, entry("grpo"))
    grpo_ckpt = out / "grpo" / "checkpoints" / "last"
    after = stages.run("eval_after", OmegaConf.create({**ev, "checkpoint": str(grpo_ckpt)}),
                       lambda c_, x_: _eval_policy(grpo_ckpt, cfg, tasks, suite, x_.out_dir, nv))

    # 8. plots, videos, report
    plots = {"success_before_after": str(plot_before_after(before, after, out / "success_before_after.png")),
             "imagined_vs_real": str(plot_imagined_vs_real(grep.get("history", []), real_curve(grep, before, after),
                                                            out / "imagined_vs_real.png"))}
    videos = [str(out / "eval_before" / v) for v in before.get("videos", [])] + \
        [str(out / "eval_after" / v) for v in after.get("videos", [])]
    per_task = {t: {"before": before["per_task"][t]["success"], "before_ci95": before["per_task"][t]["ci95"],
                    "after": after["per_task"][t]["success"], "after_ci95": after["per_task"][t]["ci95"],
                    "gain": after["per_task"][t]["success"] - before["per_task"][t]["success"]} for t in task_list}
    report: dict[str, Any] = {
        "preset": cfg.get("preset"),
        "seed": seed,
        "tasks": task_list,
        "episodes_per_task": int(cfg.evaluation.episodes_per_task),
        "stages": {k: {"wall_time_s": v} for k, v in stages.wall.items()},
        # the pipeline's time: all stages, also those reused on resume (this command's own time is
        # `wall_time_s`, added when the report is written)
        "total_wall_time_s": round(sum(stages.wall.values()), 3),
        "before": {"success": before["success"], "ci95": before["ci95"]},
        "after": {"success": after["success"], "ci95": after["ci95"]},
        "success_gain": after["success"] - before["success"],
        "per_task": per_task,
        "grpo": {"iterations": grep.get("iterations"), "mitigations": grep.get("mitigations"),
                 "refresh": grep.get("refresh"), "steer": grep.get("steer"),
                 "imagined_success_first": (grep.get("history") or [{}])[0].get("success_rate"),
                 "imagined_success_last": (grep.get("history") or [{}])[-1].get("success_rate")},
        "imagination_check": fid,
        "worldmodel_horizons": wm_rep.get("heldout_horizons"),   # held-out fidelity 1..N chunks ahead (true actions)
        "checkpoints": {"bc": str(bc_ckpt), "worldmodel": str(wm_ckpt), "critic": str(critic_ckpt),
                        "grpo": str(grpo_ckpt)},
        "plots": plots,
        "videos": videos,
    }
    report.update(machine.budget_summary(stages.reports))
    report["precision"] = {n: stages.reports.get(n, {}).get("precision") for n in ("bc", "worldmodel", "critic", "grpo")}
    report["threads"] = {"num_threads": common["num_threads"], "reason": getattr(ctx, "threads_reason", None)}
    report["estimate"] = machine.compare_estimate(estimate, report["total_wall_time_s"])
    if not report["comparable_with_reference"]:
        log.warning("NOT COMPARABLE with the reference figures: %s", "; ".join(report["not_comparable_because"]))
    log.info("success before %.3f -> after %.3f (gain %+.3f)", before["success"], after["success"], report["success_gain"])
    return report


@hydra.main(version_base="1.3", config_path="pkg://configs", config_name="pipeline")
def main(cfg: DictConfig) -> None:
    run_main(cfg, run, "pipeline")


if __name__ == "__main__":
    main()
