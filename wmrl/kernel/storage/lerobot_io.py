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
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from wmrl.kernel.leftovers import temp_sibling
from wmrl.kernel.types import ActionSpace, Episode

SUPPORTED_CODEBASE_VERSIONS = ("v3.0",)
VIDEO_TOLERANCE_FRAMES = 0.5  # a video frame matches frame index t within half a frame of t / fps
WMRL_META = "wmrl.json"
WMRL_META_FORMAT = "wmrl-lerobot"
WMRL_META_VERSION = 1
IMAGE_PREFIX = "observation.images."
PANDA_STATE_NAMES = ["eef_x", "eef_y", "eef_z", "eef_qw", "eef_qx", "eef_qy", "eef_qz", "finger_1", "finger_2"]
OSC_POSE_ACTION_NAMES = ["dx", "dy", "dz", "dax", "day", "daz", "gripper"]


class LeRobotFormatError(ValueError):
    """A LeRobot dataset folder cannot be read or written; the message names the folder and why."""

    def __init__(self, path: str | os.PathLike, reason: str):
        self.path = str(path)
        self.reason = reason
        super().__init__(f"LeRobot dataset {self.path}: {reason}")


def is_lerobot_folder(path: str | os.PathLike) -> bool:
    """True when ``path`` is a folder with ``meta/info.json`` (any LeRobot format version)."""
    return (Path(path) / "meta" / "info.json").is_file()


def _names(prefix: str, n: int, known: list[str]) -> list[str]:
    return list(known) if n == len(known) else [f"{prefix}_{i}" for i in range(n)]


def lerobot_features(store_meta: Mapping, sim_state_dim: int | None = None) -> dict:
    """The LeRobot ``features`` dict for a store's metadata (see the module table)."""
    feats: dict = {}
    for cam, (h, w) in store_meta["cameras"].items():
        feats[IMAGE_PREFIX + cam] = {"dtype": "image", "shape": (int(h), int(w), 3),
                                     "names": ["height", "width", "channels"]}
    ds, da = int(store_meta["state_dim"]), int(store_meta["action_dim"])
    feats["observation.state"] = {"dtype": "float32", "shape": (ds,), "names": _names("state", ds, PANDA_STATE_NAMES)}
    feats["action"] = {"dtype": "float32", "shape": (da,), "names": _names("action", da, OSC_POSE_ACTION_NAMES)}
    feats["next.reward"] = {"dtype": "float32", "shape": (1,), "names": None}
    feats["next.done"] = {"dtype": "bool", "shape": (1,), "names": None}
    feats["next.success"] = {"dtype": "bool", "shape": (1,), "names": None}
    if sim_state_dim:
        feats["observation.sim_state"] = {"dtype": "float64", "shape": (int(sim_state_dim),), "names": None}
    return feats


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
            or episodes that disagree on having ``sim_states``.
    """
    from lerobot.datasets.lerobot_dataset import LeRobotDataset
    from tqdm import tqdm

    out = Path(out)
    if out.exists() and not overwrite:
        raise LeRobotFormatError(out, "already exists; choose another `out` or pass overwrite=true")
    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise LeRobotFormatError(out, f"repo_id must look like 'user/name', got {repo_id!r}")
    idx = list(range(len(store))) if episodes is None else [int(i) for i in episodes]
    if not idx:
        raise LeRobotFormatError(out, "nothing to export: the store (or the selection) has no episodes")
    meta = store.meta
    first = store.episode(idx[0], images=False)
    sim_dim = None if first.sim_states is None else int(first.sim_states.shape[1])
    features = lerobot_features(meta, sim_dim)
    tmp = temp_sibling(out, "partial")
    lengths = store.lengths
    total = int(sum(int(lengths[i]) for i in idx))
    ep_meta = []
    fps = float(meta["fps"])
    if abs(fps - round(fps)) > 1e-9:
        raise LeRobotFormatError(out, f"the store's fps={fps} is not an integer; LeRobotDataset stores integer fps")
    try:
        ds = LeRobotDataset.create(repo_id=repo_id, fps=round(fps), features=features,
                                   root=tmp, robot_type=str(meta.get("embodiment") or "unknown"),
                                   use_videos=False, video_backend="pyav")
        bar = tqdm(total=total, desc="export frames", disable=not progress)
        for i in idx:
            ep = store.episode(i)
            if (ep.sim_states is None) != (sim_dim is None):
                raise LeRobotFormatError(out, f"store episode {i} {'lacks' if sim_dim else 'has'} sim_states "
                                              f"unlike episode {idx[0]}; export them separately")
            T = ep.length
            for t in range(T):
                frame = {IMAGE_PREFIX + c: np.ascontiguousarray(ep.images[c][t].transpose(1, 2, 0))
                         for c in meta["cameras"]}
                frame["observation.state"] = np.asarray(ep.proprio[t], np.float32)
                frame["action"] = np.asarray(ep.actions[t], np.float32)
                frame["next.reward"] = np.asarray([ep.rewards[t]], np.float32)
                frame["next.done"] = np.asarray([t == T - 1], bool)
                frame["next.success"] = np.asarray([bool(ep.success) and t == T - 1], bool)
                if sim_dim:
                    frame["observation.sim_state"] = np.asarray(ep.sim_states[t], np.float64)
                frame["task"] = ep.instruction
                ds.add_frame(frame)
                bar.update(1)
            ds.save_episode()
            ep_meta.append({"store_index": i, "length": T, "success": bool(ep.success),
                            "task_name": ep.task_name, "instruction": ep.instruction, "info": ep.info})
        bar.close()
        ds.finalize()
        (tmp / "meta" / WMRL_META).write_text(json.dumps({
            "format": WMRL_META_FORMAT, "version": WMRL_META_VERSION, "store_meta": meta,
            "episodes": ep_meta}, indent=1, default=str))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return {"episodes": len(idx), "frames": total, "lengths": [int(lengths[i]) for i in idx],
            "features": sorted(features), "path": str(out)}


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
