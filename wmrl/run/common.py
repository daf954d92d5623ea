"""Shared plumbing of every entry point: run directory, resolved config, report, threads, seeds.

Usage inside a Hydra main::

    @hydra.main(version_base="1.3", config_path="pkg://configs", config_name="import")
    def main(cfg):
        run = RunContext(cfg)               # saves config.yaml, sets threads and seeds
        src = run.path(cfg.source)          # launch-relative paths resolve against the launch dir
        ...
        run.finish({"episodes": 3})         # writes report.json (with wall time)
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("wmrl")


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, Path):
        return str(x)
    try:
        import torch

        if isinstance(x, torch.Tensor):
            return x.detach().cpu().tolist()
    except ImportError:  # pragma: no cover
        pass
    return x


def set_threads(n: int | None) -> None:
    """Set torch intra-op threads (``None`` or ``<= 0``: all cores). Oversubscription on small
    machines is the commonest 10x slowdown, so every entry point calls this once."""
    import torch

    if not n or n <= 0:
        n = os.cpu_count() or 1
    torch.set_num_threads(int(n))


def seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def run_main(cfg: DictConfig, run_fn, name: str,
             errors: tuple[type[BaseException], ...] = (ValueError,)) -> dict[str, Any]:
    """Body of every ``main()``: build the RunContext, call ``run_fn(cfg, ctx)``, write report.json.

    Bad input (an exception of ``errors``, ``ValueError`` by default, which every wmrl input check
    raises) ends the command with one clear line, ``wmrl <name>: <message>``, not a traceback.
    """
    ctx = RunContext(cfg)
    try:
        report = run_fn(cfg, ctx)
    except errors as e:
        log.error("%s", e)
        raise SystemExit(f"wmrl {name}: {e}") from None
    ctx.finish(report)
    return report


class RunContext:
    """Run directory bookkeeping for one Hydra entry point.

    Attributes:
        out_dir: the Hydra run directory (``hydra.run.dir``); outputs go here.
        launch_dir: where the user launched the command; relative input paths resolve against it.
    """

    def __init__(self, cfg: DictConfig, out_dir: str | os.PathLike | None = None,
                 launch_dir: str | os.PathLike | None = None):
        from hydra.core.hydra_config import HydraConfig

        self.cfg = cfg
        self.t0 = time.time()
        if out_dir is not None:  # explicit (tests, or a pipeline stage)
            self.out_dir = Path(out_dir).resolve()
            self.launch_dir = Path(launch_dir).resolve() if launch_dir else Path.cwd()
        else:
            try:
                hc = HydraConfig.get()
                self.out_dir = Path(hc.runtime.output_dir)
                self.launch_dir = Path(hc.runtime.cwd)
            except ValueError:  # not under Hydra
                self.out_dir = Path.cwd() / "runs" / time.strftime("%Y-%m-%d/%H-%M-%S")
                self.launch_dir = Path.cwd()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        prev = self.out_dir / "config.yaml"
        # a resumed run's config, put back by restore_config() when the resume is refused
        self.previous_config: str | None = prev.read_text() if prev.is_file() else None
        prev.write_text(OmegaConf.to_yaml(cfg, resolve=True))
        set_threads(cfg.get("num_threads", None))
        if "seed" in cfg:
            seed_everything(int(cfg.seed))
        log.info("run directory: %s", self.out_dir)

    def restore_config(self) -> None:
        """Put back the ``config.yaml`` this run directory had before this command (if any): for a
        command that refused to resume, so the directory's config still describes its results."""
        if self.previous_config is not None:
            (self.out_dir / "config.yaml").write_text(self.previous_config)

    def child(self, name: str, cfg: DictConfig) -> "RunContext":
        """A sub-run (pipeline stage) in ``out_dir/name`` with its own config.yaml / report.json."""
        return RunContext(cfg, out_dir=self.out_dir / name, launch_dir=self.launch_dir)

    def path(self, p: str | os.PathLike | None) -> Path | None:
        """Resolve a user-given path: absolute stays, relative is taken from the launch directory."""
        if p is None:
            return None
        p = Path(os.path.expanduser(str(p)))
        return p if p.is_absolute() else (self.launch_dir / p).resolve()

    def finish(self, report: dict[str, Any], name: str = "report.json") -> Path:
        report = dict(report)
        report.setdefault("wall_time_s", round(time.time() - self.t0, 3))
        out = self.out_dir / name
        out.write_text(json.dumps(_jsonable(report), indent=2))
        log.info("report: %s", out)
        return out
