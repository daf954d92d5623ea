"""Inspection of robomimic / robosuite ``demo.hdf5`` files: file metadata, episode keys, per-episode
schema checks and scene names, without rendering anything (the file layout is described in
``robomimic.py``).

:func:`inspect_robomimic` validates every episode (``actions`` / ``states`` shapes ``(T, dim)`` and
finite values, the MJCF repairs and compiles, ``states`` width ``1 + nq + nv [+ na]``, the scene has
the end-effector site, robot base and finger joints, the controller is OSC_POSE / OSC_POSITION)
and returns a :class:`RobomimicInfo`. Errors are
:class:`~wmrl.kernel.storage.errors.DemoImportError` naming file, episode and reason.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from wmrl.kernel.storage.errors import DemoImportError
from wmrl.kernel.storage.robomimic_mjcf import MjcfRepair, compile_mjcf, repair_mjcf
from wmrl.kernel.types import ActionSpace

__all__ = ["BASE_BODIES", "EEF_SITES", "FINGER_JOINTS", "DemoInfo", "RobomimicInfo", "inspect_robomimic"]

# robosuite 1.4 names first, robosuite 1.5 names second
EEF_SITES = ("gripper0_grip_site", "gripper0_right_grip_site")
BASE_BODIES = ("robot0_base",)
FINGER_JOINTS = (("gripper0_finger_joint1", "gripper0_finger_joint2"),
                 ("gripper0_right_finger_joint1", "gripper0_right_finger_joint2"))


@dataclass
class DemoInfo:
    """One validated episode of a demo file (no images yet)."""

    key: str
    length: int
    xml: str
    nq: int
    nv: int
    repair: MjcfRepair


@dataclass
class RobomimicInfo:
    """A validated demo file: its episodes and file-level metadata."""

    path: Path
    env_name: str
    robosuite_version: str
    env_info: dict
    action_dim: int
    action_space: ActionSpace
    demos: list[DemoInfo]

    @property
    def lengths(self) -> list[int]:
        """Number of steps of each episode, in order."""
        return [d.length for d in self.demos]


def _demo_sort_key(k: str):
    """Sort ``demo_2`` before ``demo_10`` (keys without a trailing number last)."""
    m = re.search(r"(\d+)$", k)
    return (int(m.group(1)) if m else 1 << 30, k)


def _action_space(env_info: dict, action_dim: int, path, demo=None) -> ActionSpace:
    """The :class:`ActionSpace` of the recorded controller (``env_info["controller_configs"]``;
    robosuite 1.5 composite controllers: the right arm part); :class:`DemoImportError` for another
    controller than OSC_POSE / OSC_POSITION or an action dim that does not fit it (7 / 4)."""
    ctrl = env_info.get("controller_configs") or {}
    if "body_parts" in ctrl:  # robosuite >= 1.5 composite controller
        arm = (ctrl.get("body_parts") or {}).get("right") or {}
        ctrl = arm or ctrl
    ctype = ctrl.get("type", "unknown")
    delta = ctrl.get("control_delta", True)
    if ctype not in ("OSC_POSE", "OSC_POSITION"):
        raise DemoImportError(path, f"controller {ctype!r} is not supported (OSC_POSE or OSC_POSITION)", demo)
    expected = 7 if ctype == "OSC_POSE" else 4
    if action_dim != expected:
        raise DemoImportError(
            path, f"actions have {action_dim} dims, but a single-arm {ctype} controller with a gripper "
                  f"takes {expected} (xyz, {'axis-angle, ' if expected == 7 else ''}gripper)", demo)
    return ActionSpace(dim=action_dim, controller=ctype, mode="delta" if delta else "absolute",
                       frame="base", rotation="axis_angle", gripper_open=-1.0, gripper_close=1.0,
                       low=float(ctrl.get("input_min", -1.0)), high=float(ctrl.get("input_max", 1.0)))


def inspect_robomimic(path: str | os.PathLike, demos: Sequence[str] | None = None,
                      assets_root: Path | None = None) -> RobomimicInfo:
    """Open and fully validate a robomimic / robosuite ``demo.hdf5`` without rendering anything.

    Checks per episode: the MJCF is present, repairs and compiles; ``states`` has
    ``1 + nq + nv`` (or ``+ na``) columns for the compiled model; ``actions`` and ``states`` have the
    same number of steps (> 0) and are finite; the action dimension matches the controller.

    Args:
        path: the hdf5 file.
        demos: episode keys to take (``["demo_1", ...]``); default all, in numeric order.
        assets_root: installed robosuite assets folder (default: found automatically).

    Raises:
        DemoImportError: naming file, episode and reason, for the first problem found.
    """
    import h5py

    path = Path(path)
    if not path.is_file():
        raise DemoImportError(path, "no such file")
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise DemoImportError(path, f"not a readable HDF5 file ({e})") from None
    with f:
        if "data" not in f:
            raise DemoImportError(path, "no group 'data' (not a robomimic/robosuite demo file)")
        data = f["data"]
        version, env_name, env_info = _file_meta(dict(data.attrs))
        keys = _demo_keys(data, demos, path)
        out: list[DemoInfo] = []
        action_dim = None
        space = None
        for k in keys:
            demo, action_dim = _inspect_demo(data[k], path, k, action_dim, assets_root)
            if space is None:
                space = _action_space(env_info, action_dim, path, k)
            out.append(demo)
    return RobomimicInfo(path, env_name, version, env_info, int(action_dim), space, out)


def _file_meta(attrs: dict) -> tuple[str, str, dict]:
    """``(robosuite version, env name, env_info)`` from the attributes of ``data``; robomimic-converted
    files keep ``env_args`` (``env_name``, ``env_kwargs``) instead of ``env_info``."""
    version = str(attrs.get("repository_version", "unknown"))
    env_name = str(attrs.get("env", "unknown"))
    try:
        env_info = json.loads(attrs.get("env_info", "{}"))
    except (TypeError, ValueError):
        # robomimic-converted files keep env_args instead
        env_info = {}
    if not env_info and "env_args" in attrs:
        try:
            ea = json.loads(attrs["env_args"])
            env_name = ea.get("env_name", env_name)
            env_info = ea.get("env_kwargs", {})
        except (TypeError, ValueError):
            pass
    return version, env_name, env_info


def _demo_keys(data, demos: Sequence[str] | None, path: Path) -> list[str]:
    """Episode keys to inspect: ``demos`` (all must exist) or every ``demo*`` in numeric order;
    :class:`DemoImportError` for unknown keys or none at all."""
    keys = sorted([k for k in data if k.startswith("demo")], key=_demo_sort_key)
    if demos is not None:
        unknown = [d for d in demos if d not in keys]
        if unknown:
            raise DemoImportError(path, f"no episode(s) {unknown}; the file has {keys}")
        keys = list(demos)
    if not keys:
        raise DemoImportError(path, "no episodes (data/demo_*) in the file")
    return keys


def _inspect_demo(g, path: Path, k: str, action_dim: int | None, assets_root: Path | None) -> tuple[DemoInfo, int]:
    """Validate episode group ``g`` (key ``k``); return its :class:`DemoInfo` and action dim (which
    must equal ``action_dim`` of earlier episodes unless that is ``None``)."""
    for needed in ("actions", "states"):
        if needed not in g:
            raise DemoImportError(path, f"missing dataset '{needed}'", k)
    actions = g["actions"]
    states = g["states"]
    if actions.ndim != 2 or states.ndim != 2:
        raise DemoImportError(path, f"actions {actions.shape} / states {states.shape} must be 2-D (T, dim)", k)
    if actions.shape[0] != states.shape[0] or actions.shape[0] == 0:
        raise DemoImportError(path, f"actions have {actions.shape[0]} steps, states {states.shape[0]}; "
                                    "they must match and be > 0", k)
    a = np.asarray(actions, dtype=np.float64)
    s = np.asarray(states, dtype=np.float64)
    if not np.isfinite(a).all():
        bad = np.argwhere(~np.isfinite(a))[0]
        raise DemoImportError(path, f"actions hold NaN/inf (first at step {bad[0]}, dim {bad[1]})", k)
    if not np.isfinite(s).all():
        bad = np.argwhere(~np.isfinite(s))[0]
        raise DemoImportError(path, f"states hold NaN/inf (first at step {bad[0]}, column {bad[1]})", k)
    if action_dim is None:
        action_dim = a.shape[1]
    elif a.shape[1] != action_dim:
        raise DemoImportError(path, f"actions have {a.shape[1]} dims, earlier episodes {action_dim}", k)
    xml, rep, model = _scene(g, path, k, assets_root)
    widths = {1 + model.nq + model.nv, 1 + model.nq + model.nv + model.na}
    if s.shape[1] not in widths:
        raise DemoImportError(
            path, f"states have {s.shape[1]} columns but the scene has nq={model.nq}, nv={model.nv} "
                  f"(expected 1 + nq + nv = {1 + model.nq + model.nv}); the MJCF does not match the recording", k)
    _find_names(model, path, k)
    return DemoInfo(k, int(a.shape[0]), xml, model.nq, model.nv, rep), action_dim


def _scene(g, path: Path, k: str, assets_root: Path | None) -> tuple[str, MjcfRepair, object]:
    """``(repaired MJCF, repair record, mujoco.MjModel)`` of episode group ``g``: the MJCF is inline
    text (robosuite >= 1.2) or a file name in ``models/`` next to the hdf5 (robosuite 1.0/1.1)."""
    mf = g.attrs.get("model_file")
    if mf is None:
        raise DemoImportError(path, "no attrs['model_file'] (the scene MJCF); cannot replay", k)
    if isinstance(mf, bytes):
        mf = mf.decode()
    mf = str(mf)
    base_dir = path.parent
    if not mf.lstrip().startswith("<"):
        xml_path = path.parent / "models" / mf
        if not xml_path.is_file():
            raise DemoImportError(path, f"model_file names {mf!r} but {xml_path} does not exist", k)
        base_dir = xml_path.parent
        mf = xml_path.read_text()
    try:
        xml, rep = repair_mjcf(mf, assets_root, base_dir)
        model = compile_mjcf(xml)
    except ValueError as e:
        raise DemoImportError(path, str(e), k) from None
    return xml, rep, model


def _first_id(model, objtype, names):
    """``(id, name)`` of the first of ``names`` that exists in ``model`` as ``objtype``, else ``(-1, None)``."""
    import mujoco

    for n in names:
        i = mujoco.mj_name2id(model, objtype, n)
        if i >= 0:
            return i, n
    return -1, None


def _find_names(model, path=None, demo=None) -> dict:
    """Ids of the scene's end-effector site, robot base body and finger joint qpos addresses:
    ``{"site", "site_name", "base", "fingers"}``; :class:`DemoImportError` listing what is missing."""
    import mujoco

    site, site_name = _first_id(model, mujoco.mjtObj.mjOBJ_SITE, EEF_SITES)
    base, _ = _first_id(model, mujoco.mjtObj.mjOBJ_BODY, BASE_BODIES)
    fingers = None
    for pair in FINGER_JOINTS:
        ids = [mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_JOINT, n) for n in pair]
        if min(ids) >= 0:
            fingers = [int(model.jnt_qposadr[i]) for i in ids]
            break
    missing = []
    if site < 0:
        missing.append(f"end-effector site (one of {EEF_SITES})")
    if base < 0:
        missing.append(f"robot base body (one of {BASE_BODIES})")
    if fingers is None:
        missing.append(f"gripper finger joints (one of {FINGER_JOINTS})")
    if missing:
        raise DemoImportError(path or "MJCF", "the scene lacks " + ", ".join(missing) +
                              "; only single-arm robosuite scenes with a parallel gripper are supported", demo)
    return {"site": site, "site_name": site_name, "base": base, "fingers": fingers}
