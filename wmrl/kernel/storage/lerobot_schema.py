"""LeRobotDataset v3 schema shared by export and import: the format constants, the feature mapping
of a store (:func:`lerobot_features`, table in ``lerobot_io.py``) and :func:`is_lerobot_folder`.

Errors are :class:`~wmrl.kernel.storage.errors.LeRobotFormatError` (a ``ValueError``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from wmrl.kernel.storage.errors import LeRobotFormatError

__all__ = ["LeRobotFormatError", "is_lerobot_folder", "lerobot_features"]

SUPPORTED_CODEBASE_VERSIONS = ("v3.0",)
WMRL_META = "wmrl.json"
WMRL_META_FORMAT = "wmrl-lerobot"
WMRL_META_VERSION = 1
IMAGE_PREFIX = "observation.images."
PANDA_STATE_NAMES = ["eef_x", "eef_y", "eef_z", "eef_qw", "eef_qx", "eef_qy", "eef_qz", "finger_1", "finger_2"]
OSC_POSE_ACTION_NAMES = ["dx", "dy", "dz", "dax", "day", "daz", "gripper"]


def is_lerobot_folder(path: str | os.PathLike) -> bool:
    """True when ``path`` is a folder with ``meta/info.json`` (any LeRobot format version)."""
    return (Path(path) / "meta" / "info.json").is_file()


def _names(prefix: str, n: int, known: list[str]) -> list[str]:
    """``known`` when it has ``n`` entries, else ``<prefix>_0 .. <prefix>_<n-1>``."""
    return list(known) if n == len(known) else [f"{prefix}_{i}" for i in range(n)]


def lerobot_features(store_meta: Mapping, sim_state_dim: int | None = None) -> dict:
    """The LeRobot ``features`` dict for a store's metadata (see the table in ``lerobot_io.py``):
    feature name -> ``{"dtype", "shape", "names"}``; ``observation.sim_state`` only with ``sim_state_dim``."""
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

