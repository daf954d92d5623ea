"""``wmrl import``: robomimic/robosuite ``demo.hdf5`` or a LeRobotDataset v3 folder -> EpisodeStore.

    wmrl import source=demo.hdf5 out=stores/lift [cameras=[agentview]] [image_size=128]
    wmrl import source=exports/lift_lerobot out=stores/lift_back

The format is detected from ``source`` (``format=auto``): a file ending in ``.hdf5``/``.h5`` is a
robomimic/robosuite demo file (rendered by replaying its MuJoCo states, see
:mod:`wmrl.kernel.storage.robomimic`), a folder with ``meta/info.json`` a LeRobotDataset (see
:mod:`wmrl.kernel.storage.lerobot_io`). Everything is validated before the first frame is written; the
store is built in a temporary sibling folder and renamed to ``out`` once complete, so a failed
import leaves no store (and never touches an existing one unless ``overwrite=true`` and the new
one is finished); the temporary folder of an import killed with SIGKILL is removed by the next
import to the same ``out``. Errors are ``ValueError`` subclasses naming the file and the reason;
the CLI prints them as one line and exits with status 1.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from wmrl.run.common import RunContext, run_main

log = logging.getLogger("wmrl.import")


class ImportFormatError(ValueError):
    """The source is neither a robomimic/robosuite hdf5 file nor a LeRobotDataset folder."""


def detect_format(source: Path, fmt: str = "auto") -> str:
    """``"robomimic"`` or ``"lerobot"`` for ``source``; :class:`ImportFormatError` if unknown."""
    from wmrl.kernel.storage.lerobot_io import is_lerobot_folder

    if fmt not in ("auto", "robomimic", "lerobot"):
        raise ImportFormatError(f"format={fmt!r}: use auto, robomimic or lerobot")
    if not source.exists():
        raise ImportFormatError(f"source {source} does not exist")
    if fmt != "auto":
        return fmt
    if source.is_file() and source.suffix.lower() in (".hdf5", ".h5", ".hdf"):
        return "robomimic"
    if source.is_dir() and is_lerobot_folder(source):
        return "lerobot"
    if source.is_dir() and (source / "meta").is_dir():
        raise ImportFormatError(f"{source} has a meta/ folder but no meta/info.json: not a LeRobotDataset "
                                "of a known version (v3.0)")
    raise ImportFormatError(
        f"cannot tell the format of {source}: expected a robomimic/robosuite .hdf5 file or a LeRobotDataset "
        "v3 folder (with meta/info.json); set format=robomimic|lerobot if the name misleads")


def _image_size(v) -> tuple[int, int] | None:
    if v is None:
        return None
    if isinstance(v, int):
        return (v, v)
    v = list(v)
    if len(v) == 1:
        return (int(v[0]), int(v[0]))
    if len(v) != 2:
        raise ValueError(f"image_size must be an int or [Hi, Wi], got {v}")
    return (int(v[0]), int(v[1]))


def write_store(out: Path, episodes, store_kwargs: dict, overwrite: bool) -> tuple[list[int], float]:
    """Append ``episodes`` (an iterable of :class:`wmrl.kernel.types.Episode`) to a new store at ``out``.

    Built in ``.<name>.partial-<pid>-<thread>`` next to ``out`` and renamed into place when all episodes are
    in; on any error the partial folder is removed and ``out`` is untouched. Partial folders of
    imports to ``out`` whose process is gone (killed with SIGKILL) are removed first. Returns
    (lengths, seconds spent appending).

    Raises:
        FileExistsError: ``out`` appeared while we worked and ``overwrite`` is false.
        StoreError, EpisodeValidationError: from the store (bad metadata, an episode that does not fit).
    """
    from wmrl.kernel.storage import EpisodeStore
    from wmrl.kernel.storage.store_writer import building_folder

    lengths, t_write = [], 0.0
    with building_folder(out, "partial") as tmp:
        store = EpisodeStore.create(tmp, **store_kwargs)
        for ep in episodes:
            t0 = time.time()
            store.append(ep)
            t_write += time.time() - t0
            lengths.append(ep.length)
        if out.exists():
            if not overwrite:  # appeared while we worked
                raise FileExistsError(f"{out} appeared during the import; nothing was written to it")
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        os.replace(tmp, out)
    return lengths, t_write


def run(cfg: DictConfig, ctx: RunContext) -> dict:
    """Import ``cfg.source`` into a new EpisodeStore at ``cfg.out``; return the report dict
    (format, episodes, lengths, steps, cameras, timings in seconds, provenance).

    Raises:
        ImportFormatError: unknown format or missing source; FileExistsError: ``out`` exists without
        ``overwrite``; ValueError (DemoImportError, LeRobotFormatError, StoreError, ...): bad input.
    """
    os.environ.setdefault("MUJOCO_GL", "egl")
    os.environ.setdefault("PYOPENGL_PLATFORM", os.environ["MUJOCO_GL"])
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    t_start = time.time()
    source, out = ctx.path(cfg.source), ctx.path(cfg.out)
    fmt = detect_format(source, str(cfg.get("format", "auto")))
    if out.exists() and not cfg.get("overwrite", False):
        raise FileExistsError(f"out={out} already exists; choose another path or pass overwrite=true")
    cameras = list(cfg.cameras) if cfg.get("cameras") is not None else None
    size = cfg.get("image_size")
    size = _image_size(OmegaConf.to_object(size) if OmegaConf.is_config(size) else size)
    progress = bool(cfg.get("progress", True))
    report: dict = {"format": fmt, "source": str(source), "out": str(out)}
    read = _read_robomimic if fmt == "robomimic" else _read_lerobot
    episodes, store_kwargs = read(cfg, source, cameras, size, progress, report)

    t0 = time.time()
    lengths, t_write = write_store(out, episodes, store_kwargs, bool(cfg.get("overwrite", False)))
    t_all = time.time() - t0
    report.update({
        "episodes": len(lengths), "lengths": lengths, "steps": int(sum(lengths)),
        "cameras": {c: list(hw) for c, hw in store_kwargs["cameras"].items()},
        "read_render_s": round(t_all - t_write, 3), "write_s": round(t_write, 3),
        "import_wall_s": round(time.time() - t_start, 3),
    })
    log.info("imported %d episodes %s into %s in %.1f s", len(lengths), lengths, out, report["import_wall_s"])
    return report


def _read_robomimic(cfg: DictConfig, source: Path, cameras: list[str] | None, size: tuple[int, int] | None,
                    progress: bool, report: dict):
    """Validate a robomimic/robosuite hdf5 file; return (lazy iterator of rendered episodes, store
    kwargs) and add validation time and provenance to ``report``."""
    from wmrl.kernel.storage.robomimic import (
        DEFAULT_CAMERAS,
        DEFAULT_INSTRUCTIONS,
        inspect_robomimic,
        read_robomimic,
        robosuite_version,
    )

    t0 = time.time()
    demos = list(cfg.demos) if cfg.get("demos") is not None else None
    info = inspect_robomimic(source, demos=demos)
    report["validate_s"] = round(time.time() - t0, 3)
    cameras = cameras or list(DEFAULT_CAMERAS)
    size = size or (128, 128)
    instruction = cfg.get("instruction") or DEFAULT_INSTRUCTIONS.get(info.env_name, info.env_name.lower())
    log.info("%s: %d episodes %s, env %s, recorded with robosuite %s; rendering %s at %s",
             source, len(info.demos), info.lengths, info.env_name, info.robosuite_version, cameras, size)
    robots = info.env_info.get("robots", "panda")
    robots = robots[0] if isinstance(robots, (list, tuple)) and robots else robots
    store_kwargs = {
        # robosuite's control_freq defaults to 20 Hz; its demo files record it only when changed
        "cameras": {c: size for c in cameras}, "state_dim": 9, "action_dim": info.action_dim,
        "fps": float(info.env_info.get("control_freq", 20.0)),
        "action_space": info.action_space, "embodiment": str(robots).lower(),
        "source": f"robomimic:{source} (robosuite {info.robosuite_version})",
        "info": {"format": "robomimic/robosuite demo.hdf5", "file": str(source), "env": info.env_name,
                 "robosuite_version_recorded": info.robosuite_version,
                 "robosuite_version_replayed": robosuite_version(), "env_info": info.env_info,
                 "proprio": "eef pos (m) + quat_wxyz of site gripper0_grip_site in robot0_base frame, "
                            "2 finger qpos (m)",
                 "success": "robomimic/robosuite demos are kept only when successful: success=True, "
                            "reward 1 at the last step"},
    }
    episodes = read_robomimic(info, cameras=cameras, image_size=size, instruction=instruction,
                              task_name=cfg.get("task_name"), progress=progress,
                              render_effects=bool(cfg.get("render_effects", True)))
    report.update({"robosuite_version_recorded": info.robosuite_version,
                   "robosuite_version_replayed": robosuite_version(), "env": info.env_name,
                   "instruction": instruction,
                   "assets_found_by_name": sorted({p for d in info.demos for p in d.repair.by_name})})
    return episodes, store_kwargs


def _read_lerobot(cfg: DictConfig, source: Path, cameras: list[str] | None, size: tuple[int, int] | None,
                  progress: bool, report: dict):
    """Validate a LeRobotDataset v3 folder; return (lazy iterator of episodes restricted to the chosen
    cameras, store kwargs) and add validation time and provenance to ``report``. ValueError for
    cameras the folder lacks or an ``image_size`` other than the stored one (no resizing)."""
    from wmrl.kernel.storage.lerobot_io import inspect_lerobot, read_lerobot

    t0 = time.time()
    asp = cfg.get("action_space")
    asp = OmegaConf.to_container(asp, resolve=True) if asp is not None else None
    src = inspect_lerobot(source, repo_id=cfg.get("repo_id"), action_space=asp)
    report["validate_s"] = round(time.time() - t0, 3)
    store_kwargs = dict(src.store_kwargs)
    if cameras is not None:
        missing = [c for c in cameras if c not in src.cameras]
        if missing:
            raise ValueError(f"cameras {missing} are not in {source}; it has {sorted(src.cameras)}")
        store_kwargs["cameras"] = {c: src.cameras[c] for c in cameras}
    if size is not None:
        wrong = {c: hw for c, hw in store_kwargs["cameras"].items() if tuple(hw) != tuple(size)}
        if wrong:
            raise ValueError(f"image_size={list(size)} but {source} stores {wrong}; import does not resize "
                             "LeRobot images, leave image_size unset")
    sel = list(store_kwargs["cameras"])
    episodes = _select_cameras(read_lerobot(src, progress=progress), sel)
    report.update({"codebase_version": src.codebase_version, "repo_id": src.repo_id})
    return episodes, store_kwargs


def _select_cameras(episodes, cameras: list[str]):
    """Yield ``episodes`` with only the images of ``cameras``."""
    for ep in episodes:
        ep.images = {c: ep.images[c] for c in cameras}
        yield ep


@hydra.main(version_base="1.3", config_path="pkg://configs", config_name="import")
def main(cfg: DictConfig) -> None:
    run_main(cfg, run, "import", errors=(ValueError, FileExistsError))


if __name__ == "__main__":
    main()
