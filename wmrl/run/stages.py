"""The pipeline's stage plumbing (a non-entry module of the composition roots): composing a stage's
entry-point config, the preset, checking ``stages.<stage>`` overrides against each stage's own config,
and :class:`Stages`, which runs each stage once, in order, and reuses a finished stage on resume only
when it ran with the same settings.

Used by ``wmrl pipeline`` (``wmrl.run.pipeline``), ``wmrl doctor``, ``wmrl bench grpo`` and the
pipeline's time estimate (``wmrl.run.machine``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from wmrl.run.common import RunContext

log = logging.getLogger("wmrl.pipeline")


def compose_stage_config(config_name: str, overrides: dict | DictConfig | None = None,
                         groups: list[str] | None = None) -> DictConfig:
    """Compose ``configs/<config_name>.yaml`` with Hydra (``groups``: group selections such as
    ``"env=imagination"``), then merge ``overrides`` (a nested dict) on top; a top-level override that
    changes a key's kind (a dict of ``name -> instruction`` for a list of task names) replaces it."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    groups = list(groups or [])
    if GlobalHydra.instance().is_initialized():
        cfg = compose(config_name, overrides=groups)
    else:
        with initialize_config_module("configs", version_base="1.3"):
            cfg = compose(config_name, overrides=groups)
    OmegaConf.set_struct(cfg, False)
    if overrides:
        over = OmegaConf.create(to_container(overrides))
        for k, v in over.items():  # OmegaConf cannot merge a dict onto a list (or back): replace the key
            if k in cfg and OmegaConf.is_config(cfg[k]) and OmegaConf.is_config(v) \
                    and OmegaConf.is_list(cfg[k]) != OmegaConf.is_list(v):
                cfg[k] = None
        cfg = OmegaConf.merge(cfg, over)
    return cfg


def to_container(x):
    return OmegaConf.to_container(x, resolve=True) if OmegaConf.is_config(x) else x


def stage_config(cfg: DictConfig, stage: str, overrides: dict | DictConfig | None = None) -> DictConfig:
    """Pipeline stage ``stage``'s config as the pipeline ``cfg`` composes it: its entry point's config
    (``STAGE_CONFIGS``) with the groups it always gets, ``cfg.stage_groups.<stage>``, and
    ``overrides`` merged on top."""
    name, always = STAGE_CONFIGS[stage]
    groups = cfg.get("stage_groups") or {}
    return compose_stage_config(name, overrides, groups=always + [str(x) for x in (groups.get(stage) or [])])


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
    errors: list[str] = []
    checked = 0
    for stage, over in stages.items():
        if over is None:
            continue
        if stage == "bc_rollouts":
            base, where = compose_stage_config("pipeline").stages.bc_rollouts, "configs/pipeline.yaml stages.bc_rollouts"
        elif stage in STAGE_CONFIGS:
            base, where = stage_config(cfg, stage), f"configs/{STAGE_CONFIGS[stage][0]}.yaml"
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


def module_run(module: str):
    import importlib

    try:
        mod = importlib.import_module(f"wmrl.run.{module}")
    except ModuleNotFoundError as e:
        if e.name == f"wmrl.run.{module}":
            raise RuntimeError(f"pipeline stage needs wmrl.run.{module}, which is not in this version") from None
        raise
    return mod.run



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

