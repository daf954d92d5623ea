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


def available_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup v2 CPU quota (containers)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        n = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            n = min(n, max(1, int(-(-int(quota) // int(period)))))
    except (OSError, ValueError):
        pass
    return max(1, n)


def _cpu_jiffies(cpus: set[int]) -> tuple[float, float]:
    """(busy, total) jiffies summed over ``cpus`` from /proc/stat."""
    busy = total = 0.0
    for line in Path("/proc/stat").read_text().splitlines():
        if not line.startswith("cpu") or line.startswith("cpu "):
            continue
        name, *vals = line.split()
        if int(name[3:]) not in cpus:
            continue
        v = [float(x) for x in vals[:8]]
        total += sum(v)
        busy += sum(v) - v[3] - v[4]          # minus idle and iowait
    return busy, total


def _own_jiffies() -> float:
    f = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    return float(f[11]) + float(f[12])         # utime + stime of all threads


def busy_cores_elsewhere(seconds: float = 0.25) -> float:
    """Cores (of this process's affinity) kept busy by *other* processes over the next ``seconds``,
    from /proc/stat less this process's own time; 0.0 where /proc is missing."""
    try:
        cpus = os.sched_getaffinity(0)
        b0, t0 = _cpu_jiffies(cpus)
        o0 = _own_jiffies()
        time.sleep(seconds)
        b1, t1 = _cpu_jiffies(cpus)
        o1 = _own_jiffies()
    except (AttributeError, OSError, ValueError, IndexError):
        return 0.0
    if t1 <= t0:
        return 0.0
    per_cpu_total = (t1 - t0) / len(cpus)     # jiffies one core had in the interval
    return max(0.0, ((b1 - b0) - (o1 - o0)) / per_cpu_total)


def resolve_threads(n: Any, busy: float | None = None) -> tuple[int, str]:
    """Torch intra-op threads for a setting, and why.

    ``"auto"`` (the default): the cores available to this process (:func:`available_cores`) less those
    another process keeps busy right now (:func:`busy_cores_elsewhere`, a core counts from 60 % use), at
    least 1. Torch's OpenMP threads wait for each other at every operation, so a thread on a core shared
    with a CPU-bound neighbour slows every step down (a BC step measured 2.6-4x slower with 2 threads and
    one busy core, but as fast as alone with 1 thread on the free core). ``0`` or ``None``: all available
    cores. ``N > 0``: exactly ``N``. Results are bitwise reproducible for the same thread count (a
    different count changes the order of float sums); every report records it.

    ``busy``: the busy cores if already measured (otherwise ``auto`` measures them).

    Raises:
        ValueError: a setting that is not ``auto`` or an integer.
    """
    avail = available_cores()
    if n is None or (isinstance(n, str) and n.strip().lower() == "auto"):
        busy = busy_cores_elsewhere() if busy is None else busy
        k = max(1, avail - int(busy + 0.4))
        why = f"num_threads=auto: {avail} core(s) available"
        if k < avail:
            why += f", {busy:.1f} kept busy by other processes at start"
        return k, why
    try:
        k = int(n)
    except (TypeError, ValueError):
        raise ValueError(f"num_threads must be auto, 0 (all cores) or a positive integer, got {n!r}") from None
    if k <= 0:
        return avail, f"num_threads={n}: all {avail} available core(s)"
    if k > avail:
        log.warning("num_threads=%d is more than the %d core(s) available: expect a large slowdown "
                    "(threads wait for each other); num_threads=auto picks for the cores", k, avail)
    return k, f"num_threads={k}"


def set_threads(n: Any) -> tuple[int, str]:
    """Set torch intra-op threads from a setting (:func:`resolve_threads`; oversubscription on small
    machines is the commonest 10x slowdown, so every entry point calls this once). Returns
    ``(threads, why)``."""
    import torch

    k, why = resolve_threads(n)
    torch.set_num_threads(k)
    return k, why


def runtime_info(threads_reason: str | None = None) -> dict[str, Any]:
    """What a report records about how this process computes: torch threads and why, cores, the
    OpenMP wait policy."""
    import torch

    return {"num_threads": torch.get_num_threads(), "threads_reason": threads_reason,
            "cores_available": available_cores(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset")}


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
        self.num_threads, self.threads_reason = set_threads(cfg.get("num_threads", None))
        from wmrl.kernel.distributed import is_main

        self.main = is_main()              # rank 0 under torchrun, else True
        if out_dir is None:
            self._join_torchrun()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        prev = self.out_dir / "config.yaml"
        # a resumed run's config, put back by restore_config() when the resume is refused
        self.previous_config: str | None = prev.read_text() if prev.is_file() else None
        if self.main:
            prev.write_text(OmegaConf.to_yaml(cfg, resolve=True))
        rc = cfg.get("ray", None)
        if rc is not None:                 # where workers > 1 run (wmrl.kernel.workers)
            from wmrl.kernel.workers import configure

            configure(rc.get("address"), rc.get("num_cpus"))
        if "seed" in cfg:
            seed_everything(int(cfg.seed))
        log.info("run directory: %s", self.out_dir)

    def _join_torchrun(self) -> None:
        """Under torchrun (``WORLD_SIZE > 1``): join the process group and take rank 0's run directory
        (Hydra's timestamped one may differ by a second between ranks; a stray one that only holds
        Hydra's own files is removed). Only rank 0 writes ``config.yaml`` and ``report.json`` and logs
        at INFO; the other ranks log warnings and errors."""
        from wmrl.kernel import distributed

        if not distributed.init_from_env():
            return
        own = self.out_dir
        self.out_dir = Path(distributed.broadcast_object(str(self.out_dir)))
        self.main = distributed.is_main()
        if not self.main:                  # rank 0 tells the story; the other ranks only warn
            logging.getLogger("wmrl").setLevel(logging.WARNING)
        if own != self.out_dir and own.is_dir() and all(p.name == ".hydra" or p.suffix == ".log" for p in own.iterdir()):
            import shutil

            shutil.rmtree(own, ignore_errors=True)

    def restore_config(self) -> None:
        """Put back the ``config.yaml`` this run directory had before this command (if any): for a
        command that refused to resume, so the directory's config still describes its results."""
        if self.previous_config is not None and self.main:
            (self.out_dir / "config.yaml").write_text(self.previous_config)

    def child(self, name: str, cfg: DictConfig) -> RunContext:
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
        report.setdefault("runtime", runtime_info(self.threads_reason))
        out = self.out_dir / name
        if self.main:
            out.write_text(json.dumps(_jsonable(report), indent=2))
            log.info("report: %s", out)
        return out
