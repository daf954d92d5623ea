"""Export of an :class:`~wmrl.kernel.storage.EpisodeStore` as a LeRobotDataset v3 folder, through
``lerobot`` itself (``LeRobotDataset.create`` / ``add_frame`` / ``save_episode`` / ``finalize``).

The feature mapping and ``meta/wmrl.json`` are described in ``lerobot_io.py`` (which re-exports
:func:`export_lerobot`). Errors are :class:`~wmrl.kernel.storage.errors.LeRobotFormatError`.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from wmrl.kernel.storage.lerobot_schema import (
    IMAGE_PREFIX,
    WMRL_META,
    WMRL_META_FORMAT,
    WMRL_META_VERSION,
    LeRobotFormatError,
    lerobot_features,
)
from wmrl.kernel.storage.store_writer import building_folder
from wmrl.kernel.types import Episode

__all__ = ["export_lerobot"]


def export_lerobot(store, out: str | os.PathLike, repo_id: str = "local/wmrl", overwrite: bool = False,
                   episodes: Sequence[int] | None = None, progress: bool = True) -> dict:
    """Write an EpisodeStore as a LeRobotDataset v3 folder.

    The dataset is built in a temporary sibling folder (``.<name>.partial-<pid>-<thread>``) and renamed into
    place when complete, so ``out`` is never left half-written (and an existing ``out`` is only
    replaced, with ``overwrite=True``, once the new one is finished). Partial folders of exports to
    ``out`` whose process is gone (killed with SIGKILL) are removed first.

    Args:
        store: an open :class:`wmrl.kernel.storage.EpisodeStore`.
        out: folder to write (must not exist unless ``overwrite``).
        repo_id: LeRobot repo id recorded in the dataset (``"<user>/<name>"``; nothing is uploaded).
        episodes: store indices to export (default all).
        progress: tqdm bar over frames.

    Returns:
        ``{"episodes", "frames", "lengths", "features", "path"}``.

    Raises:
        LeRobotFormatError: ``out`` exists (without ``overwrite``), an empty selection, a bad repo id,
            a non-integer store fps, or episodes that disagree on having ``sim_states``.
    """
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    out = Path(out)
    idx = _selection(store, out, repo_id, overwrite, episodes)
    meta = store.meta
    first = store.episode(idx[0], images=False)
    sim_dim = None if first.sim_states is None else int(first.sim_states.shape[1])
    features = lerobot_features(meta, sim_dim)
    with building_folder(out, "partial") as tmp:
        lengths = store.lengths
        total = int(sum(int(lengths[i]) for i in idx))
        fps = float(meta["fps"])
        if abs(fps - round(fps)) > 1e-9:
            raise LeRobotFormatError(out, f"the store's fps={fps} is not an integer; LeRobotDataset stores "
                                          "integer fps")
        ds = LeRobotDataset.create(repo_id=repo_id, fps=round(fps), features=features,
                                   root=tmp, robot_type=str(meta.get("embodiment") or "unknown"),
                                   use_videos=False, video_backend="pyav")
        ep_meta = _add_episodes(ds, store, idx, list(meta["cameras"]), sim_dim, out, total, progress)
        ds.finalize()
        (tmp / "meta" / WMRL_META).write_text(json.dumps({
            "format": WMRL_META_FORMAT, "version": WMRL_META_VERSION, "store_meta": meta,
            "episodes": ep_meta}, indent=1, default=str))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    return {"episodes": len(idx), "frames": total, "lengths": [int(lengths[i]) for i in idx],
            "features": sorted(features), "path": str(out)}


def _selection(store, out: Path, repo_id: str, overwrite: bool, episodes: Sequence[int] | None) -> list[int]:
    """Store indices to export, after checking ``out`` and ``repo_id``; :class:`LeRobotFormatError`
    for an existing ``out`` (without ``overwrite``), a bad repo id or an empty selection."""
    if out.exists() and not overwrite:
        raise LeRobotFormatError(out, "already exists; choose another `out` or pass overwrite=true")
    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise LeRobotFormatError(out, f"repo_id must look like 'user/name', got {repo_id!r}")
    idx = list(range(len(store))) if episodes is None else [int(i) for i in episodes]
    if not idx:
        raise LeRobotFormatError(out, "nothing to export: the store (or the selection) has no episodes")
    return idx


def _add_episodes(ds, store, idx: list[int], cameras: list[str], sim_dim: int | None, out: Path,
                  total: int, progress: bool) -> list[dict]:
    """Add the frames of store episodes ``idx`` to the lerobot dataset ``ds`` (``save_episode`` after
    each); return their ``meta/wmrl.json`` entries. :class:`LeRobotFormatError` for an episode whose
    ``sim_states`` presence differs from the first one's."""
    from tqdm import tqdm

    ep_meta = []
    bar = tqdm(total=total, desc="export frames", disable=not progress)
    for i in idx:
        ep = store.episode(i)
        if (ep.sim_states is None) != (sim_dim is None):
            raise LeRobotFormatError(out, f"store episode {i} {'lacks' if sim_dim else 'has'} sim_states "
                                          f"unlike episode {idx[0]}; export them separately")
        T = ep.length
        for t in range(T):
            ds.add_frame(_frame(ep, t, cameras, sim_dim))
            bar.update(1)
        ds.save_episode()
        ep_meta.append({"store_index": i, "length": T, "success": bool(ep.success),
                        "task_name": ep.task_name, "instruction": ep.instruction, "info": ep.info})
    bar.close()
    return ep_meta


def _frame(ep: Episode, t: int, cameras: list[str], sim_dim: int | None) -> dict:
    """Frame ``t`` of ``ep`` as lerobot features: images ``uint8 (Hi, Wi, 3)``, state/action
    ``float32``, ``next.*`` of shape ``(1,)``, ``observation.sim_state`` ``float64`` (with ``sim_dim``),
    ``task`` = the instruction."""
    T = ep.length
    frame = {IMAGE_PREFIX + c: np.ascontiguousarray(ep.images[c][t].transpose(1, 2, 0)) for c in cameras}
    frame["observation.state"] = np.asarray(ep.proprio[t], np.float32)
    frame["action"] = np.asarray(ep.actions[t], np.float32)
    frame["next.reward"] = np.asarray([ep.rewards[t]], np.float32)
    frame["next.done"] = np.asarray([t == T - 1], bool)
    frame["next.success"] = np.asarray([bool(ep.success) and t == T - 1], bool)
    if sim_dim:
        frame["observation.sim_state"] = np.asarray(ep.sim_states[t], np.float64)
    frame["task"] = ep.instruction
    return frame
