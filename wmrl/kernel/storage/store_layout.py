"""On-disk layout of an :class:`~wmrl.kernel.storage.EpisodeStore`: format constants, the store
metadata schema, the index file and the window index arithmetic.

Layout of a store folder ``PATH`` (format version :data:`FORMAT_VERSION`)::

    PATH/zarr.json                      root group; attribute "wmrl" = store metadata (see _store_meta)
    PATH/index.json                     committed episodes {"format_version", "episodes": [entry, ...]},
                                        entry = {name, length, success, task_name, instruction}
    PATH/.append.lock                   fcntl lock file of appenders
    PATH/episodes/ep_000000/...         one zarr group per episode (arrays listed in episode_store.py)

Errors: :class:`~wmrl.kernel.storage.errors.StoreError` (inconsistent metadata),
:class:`~wmrl.kernel.storage.errors.StoreFormatError` (missing or corrupt index, unknown version).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from wmrl.kernel.storage.errors import StoreError, StoreFormatError
from wmrl.kernel.types import ActionSpace

FORMAT_VERSION = 1
SUPPORTED_FORMAT_VERSIONS = (1,)
INDEX_FILE = "index.json"
LOCK_FILE = ".append.lock"
_META_ATTR = "wmrl"
_IMAGE_CHUNK_BYTES = 1 << 20
_REQUIRED_META = ("cameras", "state_dim", "action_dim", "fps", "action_space")


def _episode_name(i: int) -> str:
    """Group name of the ``i``-th appended episode: ``ep_000000``, ``ep_000001``, ..."""
    return f"ep_{i:06d}"


def _store_meta(cameras: Mapping[str, tuple[int, int]], state_dim: int, action_dim: int, fps: float,
                action_space: ActionSpace | Mapping, embodiment: str, source: str, info: Mapping | None) -> dict:
    """The metadata of a new store (see :class:`EpisodeStore`), checked; :class:`StoreError` names the
    first inconsistent argument."""
    if isinstance(action_space, Mapping):
        action_space = ActionSpace.from_dict(dict(action_space))
    if int(action_space.dim) != int(action_dim):
        raise StoreError(f"action_dim={action_dim} but action_space.dim={action_space.dim}; "
                         "make them equal")
    if int(state_dim) < 0 or int(action_dim) <= 0:
        raise StoreError(f"need state_dim >= 0 and action_dim > 0, got {state_dim}, {action_dim}")
    if not (math.isfinite(float(fps)) and float(fps) > 0):
        raise StoreError(f"fps must be a positive number, got {fps!r}")
    cams: dict[str, list[int]] = {}
    for name, hw in dict(cameras).items():
        hw = [int(v) for v in hw]
        if len(hw) != 2 or min(hw) <= 0 or "/" in name or not name:
            raise StoreError(f"camera {name!r}: expected a name without '/' and (Hi, Wi) > 0, got {hw}")
        cams[str(name)] = hw
    if info is not None:
        try:
            json.dumps(dict(info))
        except TypeError as e:
            raise StoreError(f"store info is not JSON-serialisable: {e}") from None
    return {
        "format_version": FORMAT_VERSION,
        "cameras": cams,
        "state_dim": int(state_dim),
        "action_dim": int(action_dim),
        "fps": float(fps),
        "action_space": action_space.to_dict(),
        "embodiment": str(embodiment),
        "source": str(source),
        "info": dict(info or {}),
    }



def _check_meta(path: Path, meta: object) -> dict:
    """The ``"wmrl"`` attribute of an opened store's ``zarr.json``, checked.

    Raises:
        StoreFormatError: not a dict (not an EpisodeStore), an unsupported ``format_version``, or a
            required key (cameras, state_dim, action_dim, fps, action_space) missing.
    """
    if not isinstance(meta, dict):
        raise StoreFormatError(f"{path} is a zarr group but not an EpisodeStore "
                               f"(no {_META_ATTR!r} attribute in zarr.json)")
    version = meta.get("format_version")
    if version not in SUPPORTED_FORMAT_VERSIONS:
        raise StoreFormatError(
            f"{path}: unknown EpisodeStore format_version {version!r}; this wmrl reads "
            f"versions {list(SUPPORTED_FORMAT_VERSIONS)}. Upgrade wmrl or re-import the data.")
    for key in _REQUIRED_META:
        if key not in meta:
            raise StoreFormatError(f"{path}: store metadata lacks {key!r} (corrupt zarr.json)")
    return meta


def window_indices(T: int, t: int, n_obs: int, horizon: int, n_future: int = 0):
    """Index arrays of one window in an episode of ``T`` steps at step ``t``.

    Returns ``(obs_idx, obs_pad, act_idx, act_pad, fut_idx, fut_pad)``: ``obs_idx int64 (n_obs,)``
    = ``t-n_obs+1 .. t`` clipped at 0 (padding repeats step 0, ``obs_pad`` True there);
    ``act_idx (horizon,)`` = ``t .. t+horizon-1`` clipped at ``T-1`` (padding repeats the last
    action, ``act_pad`` True there); ``fut_idx (n_future,)`` = ``t+1 .. t+n_future`` clipped at
    ``T-1`` (``fut_pad`` True past the episode's last observation).
    """
    if n_obs < 1 or horizon < 1 or n_future < 0:
        raise ValueError(f"need n_obs >= 1, horizon >= 1, n_future >= 0; got {n_obs}, {horizon}, {n_future}")
    o = t + np.arange(-n_obs + 1, 1, dtype=np.int64)
    a = t + np.arange(horizon, dtype=np.int64)
    f = t + np.arange(1, n_future + 1, dtype=np.int64)
    return (np.maximum(o, 0), o < 0, np.minimum(a, T - 1), a >= T, np.minimum(f, T - 1), f >= T)


# ---------------------------------------------------------------------- index file
def _read_index(path: Path) -> list[dict]:
    p = path / INDEX_FILE
    if not p.is_file():
        raise StoreFormatError(f"{path}: missing {INDEX_FILE}; not an EpisodeStore or a corrupt one")
    try:
        d = json.loads(p.read_text())
        if d.get("format_version") not in SUPPORTED_FORMAT_VERSIONS:
            raise StoreFormatError(f"{p}: unknown EpisodeStore format_version {d.get('format_version')!r}; "
                                   f"this wmrl reads versions {list(SUPPORTED_FORMAT_VERSIONS)}")
        eps = d["episodes"]
        for e in eps:
            e["name"], e["length"]  # noqa: B018 - presence check
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise StoreFormatError(f"{p} is corrupt ({type(e).__name__}: {e})") from None
    return eps
