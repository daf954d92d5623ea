"""LeRobotDataset v3 export and import, through ``lerobot`` itself (local folders, never the hub).

Export (:func:`export_lerobot`) writes an :class:`~wmrl.kernel.storage.EpisodeStore` with
``LeRobotDataset.create`` / ``add_frame`` / ``save_episode`` / ``finalize`` (lerobot 0.6,
``codebase_version`` ``v3.0``). Feature mapping, per frame ``t`` of an episode:

==================================  =====================  =====================================
LeRobot feature                     dtype, shape           from the store
==================================  =====================  =====================================
``observation.images.<camera>``     ``image (Hi, Wi, 3)``  ``images[camera][t]`` (PNG, lossless)
``observation.state``               ``float32 (D_s,)``     ``proprio[t]``
``action``                          ``float32 (D_a,)``     ``actions[t]``
``next.reward``                     ``float32 (1,)``       ``rewards[t]``
``next.done``                       ``bool (1,)``          ``t == T - 1``
``next.success``                    ``bool (1,)``          ``success and t == T - 1``
``observation.sim_state``           ``float64 (S,)``       ``sim_states[t]`` (only if every episode has them)
``task`` (lerobot's task string)    ``str``                ``instruction``
==================================  =====================  =====================================

Images are stored as lerobot *image* features (PNG inside the parquet files), not videos, so the
round trip is bit-exact (a video codec would not be). What lerobot has no field for (action space:
delta/absolute, frame, gripper sign; embodiment; source; per-episode ``task_name``, ``success`` and
``info``) goes into ``meta/wmrl.json`` next to lerobot's ``meta/info.json``; lerobot ignores it.
``extras`` of episodes are not exported.

Import (:func:`read_lerobot`) loads the folder with
``LeRobotDataset(repo_id, root=folder)`` (offline: set ``HF_HUB_OFFLINE=1``), maps the features
back (any ``observation.images.*`` image or video feature becomes a camera; float frames from
lerobot are turned back into ``uint8`` by ``round(255 x)``, exact for PNG-backed images) and takes
the metadata from ``meta/wmrl.json`` when present. A dataset not written by wmrl has no declared
action space: the caller must pass one (``action_space=``), we never guess delta vs absolute.
Frames are read by index, never by the ``timestamp`` column: rows ``dataset_from_index ..
dataset_to_index`` of the data files, and for video features the frame nearest
``from_timestamp + t / fps`` within half a frame (lerobot's own 0.1 ms ``tolerance_s`` against the
recorded timestamps would reject a last frame 0.5 ms late, as real clocks produce).

Errors are :class:`LeRobotFormatError` (a ``ValueError``) naming the folder and what is wrong:
missing ``meta/info.json``, a ``codebase_version`` other than ``v3.0``, missing ``action`` /
``observation.state`` features, an undeclared action space.

This module holds the import side; the schema (constants, :func:`lerobot_features`,
:func:`is_lerobot_folder`) is in ``lerobot_schema.py`` and :func:`export_lerobot` in
``lerobot_export.py``, both re-exported here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from wmrl.kernel.storage.lerobot_export import export_lerobot
from wmrl.kernel.storage.lerobot_schema import (
    IMAGE_PREFIX,
    OSC_POSE_ACTION_NAMES,
    PANDA_STATE_NAMES,
    SUPPORTED_CODEBASE_VERSIONS,
    WMRL_META,
    WMRL_META_FORMAT,
    WMRL_META_VERSION,
    LeRobotFormatError,
    is_lerobot_folder,
    lerobot_features,
)
from wmrl.kernel.types import ActionSpace, Episode

__all__ = [
    "IMAGE_PREFIX", "OSC_POSE_ACTION_NAMES", "PANDA_STATE_NAMES", "SUPPORTED_CODEBASE_VERSIONS",
    "VIDEO_DECODE_CHUNK", "VIDEO_TOLERANCE_FRAMES", "WMRL_META", "WMRL_META_FORMAT", "WMRL_META_VERSION",
    "LeRobotFormatError", "LeRobotSource", "export_lerobot", "inspect_lerobot", "is_lerobot_folder",
    "lerobot_features", "read_lerobot",
]

VIDEO_TOLERANCE_FRAMES = 0.5  # a video frame matches frame index t within half a frame of t / fps


@dataclass
class LeRobotSource:
    """A validated LeRobot folder, ready to be read with :func:`read_lerobot`.

    ``store_kwargs`` are the keyword arguments for ``EpisodeStore.create`` (cameras, dims, fps,
    action space, embodiment, source, info)."""

    path: Path
    repo_id: str
    codebase_version: str
    cameras: dict[str, tuple[int, int]]
    total_episodes: int
    total_frames: int
    has_sim_state: bool
    wmrl_meta: dict | None
    store_kwargs: dict


def inspect_lerobot(path: str | os.PathLike, repo_id: str | None = None,
                    action_space: ActionSpace | Mapping | None = None) -> LeRobotSource:
    """Check a LeRobot folder's format version and features without reading frames.

    Args:
        path: dataset root (holds ``meta/info.json``).
        repo_id: LeRobot repo id (default ``local/<folder name>``; only recorded, nothing downloaded).
        action_space: how the ``action`` column is read; required unless ``meta/wmrl.json`` declares it.

    Raises:
        LeRobotFormatError: see the module docstring.
    """
    path = Path(path)
    info_path = path / "meta" / "info.json"
    if not info_path.is_file():
        raise LeRobotFormatError(path, "no meta/info.json; not a LeRobotDataset folder")
    try:
        info = json.loads(info_path.read_text())
    except ValueError as e:
        raise LeRobotFormatError(path, f"meta/info.json is not valid JSON ({e})") from None
    version = str(info.get("codebase_version", "missing"))
    if version not in SUPPORTED_CODEBASE_VERSIONS:
        raise LeRobotFormatError(
            path, f"unknown LeRobotDataset format version {version!r} (meta/info.json codebase_version); "
                  f"wmrl reads {list(SUPPORTED_CODEBASE_VERSIONS)}. Convert older datasets with lerobot's "
                  "convert_dataset_v21_to_v30 script")
    feats = info.get("features") or {}
    for need in ("action", "observation.state"):
        if need not in feats:
            raise LeRobotFormatError(path, f"no {need!r} feature (has {sorted(feats)})")
    cameras = {}
    for k, f in feats.items():
        if k.startswith(IMAGE_PREFIX) and f.get("dtype") in ("image", "video"):
            shape, names = list(f["shape"]), f.get("names") or []
            if names and list(names)[:1] == ["channels"]:
                h, w = shape[1], shape[2]
            else:
                h, w = shape[0], shape[1]
            cameras[k[len(IMAGE_PREFIX):]] = (int(h), int(w))
    state_dim = int(feats["observation.state"]["shape"][0])
    action_dim = int(feats["action"]["shape"][0])
    wmeta = None
    wpath = path / "meta" / WMRL_META
    if wpath.is_file():
        wmeta = json.loads(wpath.read_text())
        if wmeta.get("format") != WMRL_META_FORMAT or wmeta.get("version") != WMRL_META_VERSION:
            raise LeRobotFormatError(path, f"meta/{WMRL_META} has format {wmeta.get('format')!r} version "
                                           f"{wmeta.get('version')!r}; this wmrl reads {WMRL_META_FORMAT!r} "
                                           f"version {WMRL_META_VERSION}")
    if action_space is None and wmeta is not None:
        action_space = wmeta["store_meta"]["action_space"]
    if action_space is None:
        raise LeRobotFormatError(
            path, "the dataset does not declare how its actions are read (delta or absolute, frame, gripper "
                  "sign) and no action_space was given; pass e.g. action_space={controller: OSC_POSE, "
                  f"mode: delta, dim: {action_dim}}}")
    if isinstance(action_space, Mapping):
        action_space = ActionSpace.from_dict(dict(action_space))
    if int(action_space.dim) != action_dim:
        raise LeRobotFormatError(path, f"the 'action' feature has {action_dim} dims but the action space "
                                       f"declares dim={action_space.dim}")
    sm = (wmeta or {}).get("store_meta", {})
    store_kwargs = {
        "cameras": cameras, "state_dim": state_dim, "action_dim": action_dim, "fps": float(info["fps"]),
        "action_space": action_space, "embodiment": sm.get("embodiment") or str(info.get("robot_type") or ""),
        "source": sm.get("source") or f"lerobot:{path}",
        "info": {"imported_from": str(path), "format": f"LeRobotDataset {version}",
                 "store_info": sm.get("info", {})},
    }
    return LeRobotSource(path, repo_id or f"local/{path.name}", version, cameras,
                         int(info.get("total_episodes", 0)), int(info.get("total_frames", 0)),
                         "observation.sim_state" in feats, wmeta, store_kwargs)


def _to_uint8(x, hw: tuple[int, int]) -> np.ndarray:
    """lerobot image (float [0, 1] or uint8; ``(3, H, W)`` or ``(H, W, 3)``) -> ``uint8 (3, H, W)``."""
    a = x.numpy() if hasattr(x, "numpy") else np.asarray(x)
    if a.dtype != np.uint8:
        a = np.clip(np.rint(a.astype(np.float64) * 255.0), 0, 255).astype(np.uint8)
    if a.shape == (hw[0], hw[1], 3):
        a = a.transpose(2, 0, 1)
    if a.shape != (3, hw[0], hw[1]):
        raise ValueError(f"image of shape {a.shape}, expected (3, {hw[0]}, {hw[1]}) or ({hw[0]}, {hw[1]}, 3)")
    return np.ascontiguousarray(a)


def _col(col, T: int) -> np.ndarray:
    """pyarrow column of scalars or fixed-size lists -> numpy ``(T,)`` or ``(T, n)``, dtype kept."""
    import pyarrow as pa

    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if pa.types.is_fixed_size_list(col.type) or pa.types.is_list(col.type):
        flat = col.flatten().to_numpy(zero_copy_only=False)
        return flat.reshape(T, -1)
    return col.to_numpy(zero_copy_only=False)


def _decode_image(x) -> np.ndarray:
    """A parquet image cell (``{"bytes", "path"}``) -> ``uint8 (H, W, 3)``."""
    import io

    from PIL import Image

    if isinstance(x, dict):
        data = x.get("bytes")
        img = Image.open(io.BytesIO(data)) if data is not None else Image.open(x["path"])
    else:
        img = x
    return np.asarray(img.convert("RGB"))


VIDEO_DECODE_CHUNK = 256


def _video_frames(ds, path: Path, k: int, key: str, T: int, hw: tuple[int, int]) -> list[np.ndarray]:
    """Frames ``0 .. T-1`` of episode ``k``'s video ``key``, chosen by frame index, as ``uint8 (3, H, W)``.

    Frame ``t`` is the video frame at ``from_timestamp + t / fps`` (``from_timestamp`` of the episode
    in ``meta/episodes``), matched by lerobot's ``decode_video_frames`` with a tolerance of half a
    frame (``VIDEO_TOLERANCE_FRAMES / fps``): the nearest frame is then the only candidate. The
    ``timestamp`` column of the data files is not consulted, so real-clock jitter there (a last
    frame a fraction of a frame late) changes nothing; a video missing a frame still fails. Decoded
    in chunks of ``VIDEO_DECODE_CHUNK`` frames to bound memory on long episodes.

    Raises:
        LeRobotFormatError: the video has no frame within half a frame of an index's time.
    """
    from lerobot.datasets.video_utils import FrameTimestampError, decode_video_frames

    fps = float(ds.meta.fps)
    start = float(ds.meta.episodes[k][f"videos/{key}/from_timestamp"])
    video = ds.root / ds.meta.get_video_file_path(k, key)
    frames: list[np.ndarray] = []
    for lo in range(0, T, VIDEO_DECODE_CHUNK):
        times = [start + t / fps for t in range(lo, min(T, lo + VIDEO_DECODE_CHUNK))]
        try:
            got = decode_video_frames(video, times, VIDEO_TOLERANCE_FRAMES / fps, backend="pyav", return_uint8=True)
        except FrameTimestampError as e:
            raise LeRobotFormatError(path, f"episode {k}, {key}: {video.name} has no frame within half a frame "
                                           f"of frames {lo}..{lo + len(times) - 1} (dropped frames?): "
                                           f"{str(e).splitlines()[0]}") from None
        frames += [_to_uint8(f, hw) for f in got]
    return frames


def read_lerobot(src: LeRobotSource, progress: bool = True) -> Iterator[Episode]:
    """Yield the episodes of a folder checked by :func:`inspect_lerobot`, in episode order.

    Loads with ``lerobot.datasets.lerobot_dataset.LeRobotDataset(src.repo_id, root=src.path)``;
    set ``HF_HUB_OFFLINE=1`` so that nothing is fetched. Frames are read by index (see
    :func:`_video_frames` for videos), so jitter in the recorded timestamps does not matter.
    Success per episode: ``meta/wmrl.json`` if present, else ``any(next.success)`` if that column
    exists, else ``False``; rewards: ``next.reward`` or zeros.

    Raises:
        LeRobotFormatError: lerobot cannot load the folder, ``meta/wmrl.json`` disagrees with it,
            rows of an episode belong to another, or a video lacks a frame.
    """
    from lerobot.datasets.lerobot_dataset import LeRobotDataset
    from tqdm import tqdm

    try:
        ds = LeRobotDataset(src.repo_id, root=src.path, video_backend="pyav")
    except Exception as e:  # noqa: BLE001 - lerobot raises many kinds for unreadable folders
        raise LeRobotFormatError(src.path, f"lerobot cannot load it: {type(e).__name__}: {e}") from None
    feats = ds.meta.features
    wmeta_eps = (src.wmrl_meta or {}).get("episodes")
    n_eps = ds.meta.total_episodes
    if wmeta_eps is not None and len(wmeta_eps) != n_eps:
        raise LeRobotFormatError(src.path, f"meta/{WMRL_META} lists {len(wmeta_eps)} episodes but the dataset "
                                           f"has {n_eps}")
    eps = ds.meta.episodes
    video_keys = [IMAGE_PREFIX + c for c in src.cameras if feats[IMAGE_PREFIX + c]["dtype"] == "video"]
    columns = [k for k in ("observation.state", "action", "next.reward", "next.success", "observation.sim_state",
                           "episode_index", "task_index") if k in feats]
    columns += [IMAGE_PREFIX + c for c in src.cameras if IMAGE_PREFIX + c not in video_keys]
    # arrow view of the parquet rows: exact dtypes (lerobot's torch transform and the datasets numpy
    # formatter both turn float64 into float32)
    table = ds.hf_dataset.with_format("arrow", columns=columns)
    bar = tqdm(total=ds.meta.total_frames, desc="import frames", disable=not progress)
    for k in range(n_eps):
        a, b = int(eps[k]["dataset_from_index"]), int(eps[k]["dataset_to_index"])
        T = b - a
        rows = {name: table[a:b].column(name) for name in columns}
        ep_idx = _col(rows["episode_index"], T).reshape(-1)
        if ep_idx.shape[0] != T or (ep_idx != k).any():
            raise LeRobotFormatError(src.path, f"rows {a}..{b} do not all belong to episode {k} "
                                               "(inconsistent episode index)")
        images = {}
        for c, (h, w) in src.cameras.items():
            key = IMAGE_PREFIX + c
            if key in video_keys:  # lossy codec; not produced by export_lerobot
                frames = _video_frames(ds, src.path, k, key, T, (h, w))
            else:
                frames = [_to_uint8(_decode_image(x), (h, w)) for x in rows[key].to_pylist()]
            images[c] = np.stack(frames) if len(frames) else np.empty((0, 3, h, w), np.uint8)
        proprio = _col(rows["observation.state"], T).astype(np.float32)
        actions = _col(rows["action"], T).astype(np.float32)
        rewards = (_col(rows["next.reward"], T).astype(np.float32).reshape(T) if "next.reward" in rows
                   else np.zeros(T, np.float32))
        succ = _col(rows["next.success"], T).astype(bool).reshape(T) if "next.success" in rows else np.zeros(T, bool)
        sim = _col(rows["observation.sim_state"], T).astype(np.float64) if "observation.sim_state" in rows else None
        task = str(ds.meta.tasks.iloc[int(_col(rows["task_index"], T).reshape(-1)[0])].name) if T else ""
        bar.update(T)
        wm = wmeta_eps[k] if wmeta_eps is not None else {}
        info = dict(wm.get("info") or {})
        info.update({"lerobot_episode_index": k, "lerobot_root": str(src.path)})
        yield Episode(images=images, proprio=proprio, actions=actions, rewards=rewards,
                      success=bool(wm["success"]) if "success" in wm else bool(succ.any()),
                      instruction=str(wm.get("instruction", task)), task_name=str(wm.get("task_name", "")),
                      sim_states=sim, info=info)
    bar.close()
