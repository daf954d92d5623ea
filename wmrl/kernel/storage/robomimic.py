"""Import robomimic / robosuite ``demo.hdf5`` files by replaying the recorded MuJoCo states.

A robosuite demonstration file holds, per episode ``data/demo_N``:

* ``actions``: ``float64 (T, D_a)`` what the controller took (``env_info`` in ``data.attrs`` names
  the controller; robosuite's demos use ``OSC_POSE`` in delta mode, gripper ``-1 = open, +1 = close``),
* ``states``: ``float64 (T, 1 + nq + nv)`` flattened MuJoCo states ``[time, qpos, qvel]``,
* ``attrs["model_file"]``: the scene MJCF as recorded (robosuite >= 1.2), or the name of an XML
  file in ``models/`` next to the hdf5 (robosuite 1.0/1.1),

and no images. Following robomimic's ``dataset_states_to_obs.py`` (Mandlekar et al., "What Matters
in Learning from Offline Human Demonstrations for Robot Manipulation", CoRL 2021), we rebuild the
scene and render the cameras at every recorded state. Unlike robomimic we do not construct a
robosuite environment: the recorded MJCF is compiled directly with MuJoCo after its asset paths
(absolute paths of the recording machine) are rewritten to the installed robosuite's assets, and each
state is set with ``qpos``/``qvel`` + ``mj_forward`` (no simulation steps, so the frames show exactly
the recorded states).

Conventions of the produced :class:`wmrl.kernel.types.Episode`:

* images: ``uint8 (T, 3, Hi, Wi)`` upright RGB from ``mujoco.Renderer`` (which already flips
  OpenGL's bottom-up buffer; checked against the reference render in
  ``shared/data/derived`` by ``tests/test_import_robomimic.py``),
* proprio ``float32 (T, 9)``: position (m) and orientation ``quat_wxyz`` of the site
  ``gripper0_grip_site`` (robosuite's end-effector site; ``gripper0_right_grip_site`` in robosuite
  1.5 scenes) in the frame of body ``robot0_base`` (robosuite's own ``robot0_eef_pos`` is in the
  world frame), then the two finger joint positions (m) of ``gripper0_finger_joint1/2``; the
  quaternion sign has ``w >= 0`` at the first step and is then kept continuous over the episode,
* rewards and success: robosuite demo files carry no rewards, and recomputing them would need the
  task code of the recording version. The demos are successful human demonstrations (robosuite's
  ``collect_human_demonstrations.py`` keeps an episode only when the task succeeded), so every
  episode gets ``success=True`` and the sparse task reward: ``0`` at every step except ``1`` at the
  last one,
* ``sim_states``: the recorded ``float64 (T, 1 + nq + nv)`` states, unchanged.

Every episode is fully validated (MJCF repair and compile, dims, finite values) by
:func:`inspect_robomimic` before anything is rendered or written, so a bad file never leaves
partial data in a store. Errors are :class:`DemoImportError` (a ``ValueError``) naming the file,
the demo key and the reason.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from wmrl.kernel.types import AGENTVIEW, EYE_IN_HAND, ActionSpace, Episode

ASSETS_MARKER = "robosuite/models/assets/"
DEFAULT_CAMERAS = (AGENTVIEW, EYE_IN_HAND)
# robosuite 1.4 names first, robosuite 1.5 names second
EEF_SITES = ("gripper0_grip_site", "gripper0_right_grip_site")
BASE_BODIES = ("robot0_base",)
FINGER_JOINTS = (("gripper0_finger_joint1", "gripper0_finger_joint2"),
                 ("gripper0_right_finger_joint1", "gripper0_right_finger_joint2"))
DEFAULT_INSTRUCTIONS = {
    "Lift": "lift the cube",
    "Stack": "stack the red cube on the green cube",
    "Door": "open the door",
    "Wipe": "wipe the table",
    "PickPlaceCan": "pick up the can and place it in its bin",
    "NutAssemblySquare": "fit the square nut onto the square peg",
}


class DemoImportError(ValueError):
    """A demonstration file (or one episode of it) cannot be imported.

    The message names the file, the episode key (``data/demo_N``) when the problem is specific to
    one episode, the reason, and what to change.
    """

    def __init__(self, path: str | os.PathLike, reason: str, demo: str | None = None):
        self.path = str(path)
        self.demo = demo
        self.reason = reason
        where = f"{self.path} [data/{demo}]" if demo else self.path
        super().__init__(f"cannot import {where}: {reason}")


# ----------------------------------------------------------------------------- MJCF repair

def installed_robosuite_assets() -> Path:
    """Folder ``robosuite/models/assets`` of the installed robosuite (found without importing it,
    which would print warnings and be slow). Raises ``DemoImportError`` if robosuite is absent."""
    spec = importlib.util.find_spec("robosuite")
    if spec is None or not spec.submodule_search_locations:
        raise DemoImportError("robosuite", "robosuite is not installed; `pip install robosuite==1.5.1`")
    return Path(next(iter(spec.submodule_search_locations))) / "models" / "assets"


def robosuite_version() -> str:
    try:
        return importlib.metadata.version("robosuite")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover
        return "not installed"


@dataclass
class MjcfRepair:
    """What :func:`repair_mjcf` did: ``rewritten`` maps recorded path -> installed path (those
    found by file name only are also listed in ``by_name``); ``missing`` lists recorded paths with
    no installed counterpart."""

    rewritten: dict[str, str] = field(default_factory=dict)
    by_name: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)


class _AssetIndex:
    """Index of the installed robosuite assets: relative path set + file name -> relative paths."""

    def __init__(self, root: Path):
        self.root = root
        self.rel: set[str] = set()
        self.by_name: dict[str, list[str]] = {}
        for p in root.rglob("*"):
            if p.is_file():
                r = p.relative_to(root).as_posix()
                self.rel.add(r)
                self.by_name.setdefault(p.name, []).append(r)

    def locate(self, recorded: str) -> tuple[str | None, bool]:
        """Installed absolute path for a recorded asset path, and whether it was found by name only."""
        norm = recorded.replace("\\", "/")
        if ASSETS_MARKER in norm:
            suffix = os.path.normpath(norm.split(ASSETS_MARKER, 1)[1]).replace("\\", "/")
            if suffix in self.rel:
                return str(self.root / suffix), False
            rec_parts = suffix.split("/")
        else:
            rec_parts = os.path.normpath(norm).replace("\\", "/").split("/")
        cands = self.by_name.get(rec_parts[-1], [])
        if not cands:
            return None, False

        def common_suffix(c: str) -> int:
            cp, n = c.split("/"), 0
            while n < min(len(cp), len(rec_parts)) and cp[-1 - n] == rec_parts[-1 - n]:
                n += 1
            return n

        scores = [common_suffix(c) for c in cands]
        best = max(scores)
        winners = [c for c, s in zip(cands, scores) if s == best]
        if len(winners) > 1:  # ambiguous: same file name in several places, same shared suffix
            # prefer the one sharing the most leading folders (e.g. "robots/panda/...")
            def common_prefix(c: str) -> int:
                cp, n = c.split("/"), 0
                while n < min(len(cp), len(rec_parts)) and cp[n] == rec_parts[n]:
                    n += 1
                return n
            pre = [common_prefix(c) for c in winners]
            if pre.count(max(pre)) > 1:
                return None, False
            winners = [winners[pre.index(max(pre))]]
        return str(self.root / winners[0]), True


_INDEX_CACHE: dict[Path, _AssetIndex] = {}


def _asset_index(root: Path) -> _AssetIndex:
    if root not in _INDEX_CACHE:
        _INDEX_CACHE[root] = _AssetIndex(root)
    return _INDEX_CACHE[root]


_NUMERIC_ATTRS = {"pos", "quat", "size", "rgba", "axis", "range", "euler", "axisangle", "xyaxes",
                  "zaxis", "fromto", "friction", "solref", "solimp", "margin", "gap", "mass",
                  "diaginertia", "fullinertia", "scale", "ctrlrange", "forcerange", "gear", "damping",
                  "stiffness", "armature", "frictionloss", "springref", "ref", "density", "fovy"}
_BAD_NUMBER = re.compile(r"[\[\](),]")


def repair_mjcf(xml: str, assets_root: Path | None = None, base_dir: Path | None = None
                ) -> tuple[str, MjcfRepair]:
    """Rewrite the asset ``file=`` paths of a recorded MJCF to the installed robosuite's assets.

    Each recorded path is located by its suffix after ``robosuite/models/assets/``; when that file
    does not exist in the installed robosuite (robosuite 1.5 moved e.g. the robot mount meshes from
    ``mounts/`` to ``bases/``), by its file name, picking the installed file sharing the longest
    path suffix (and then prefix); a relative path that exists under ``base_dir`` is kept.

    Args:
        xml: MJCF text.
        assets_root: installed ``robosuite/models/assets`` (default: found automatically).
        base_dir: folder relative paths are taken from (the XML's folder).

    Returns:
        (repaired MJCF text, :class:`MjcfRepair`). The text is unchanged when nothing was missing.

    Raises:
        ValueError: the text is not XML, a numeric attribute holds a non-number (e.g. a Python
            list ``"[0, 0, 0.005]"``), or some referenced files have no installed counterpart
            (all of them are listed).
    """
    assets_root = assets_root or installed_robosuite_assets()
    try:
        root = ET.fromstring(xml)
    except ET.ParseError as e:
        raise ValueError(f"the MJCF is not valid XML ({e})") from None
    if root.tag != "mujoco":
        raise ValueError(f"the MJCF root element is <{root.tag}>, expected <mujoco>")
    bad = []
    for el in root.iter():
        for k, v in el.attrib.items():
            if k in _NUMERIC_ATTRS and _BAD_NUMBER.search(v):
                bad.append(f"<{el.tag} name={el.get('name')!r}> {k}={v!r}")
    if bad:
        more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
        raise ValueError(
            "the MJCF holds non-numeric values in numeric attributes (a Python list printed into the "
            f"XML by the recording robosuite version): {'; '.join(bad[:3])}{more}. MuJoCo expects "
            "space-separated numbers; re-record the demo or fix the attributes")
    index = _asset_index(assets_root)
    rep = MjcfRepair()
    for el in root.iter():
        f = el.get("file")
        if f is None:
            continue
        if not os.path.isabs(f) and base_dir is not None and (base_dir / f).is_file():
            new = str((base_dir / f).resolve())
            by_name = False
        else:
            new, by_name = index.locate(f)
        if new is None:
            rep.missing.append(f)
            continue
        if new != f:
            rep.rewritten[f] = new
            if by_name:
                rep.by_name.append(f)
        el.set("file", new)
    if rep.missing:
        names = sorted({m.split(ASSETS_MARKER)[-1] for m in rep.missing})
        more = f" (and {len(names) - 5} more)" if len(names) > 5 else ""
        raise ValueError(
            f"the MJCF references {len(rep.missing)} asset file(s) that the installed robosuite "
            f"{robosuite_version()} does not ship: {', '.join(names[:5])}{more}. This recording needs the "
            "robosuite release it was made with (its assets), or a hand-repaired MJCF")
    return ET.tostring(root, encoding="unicode"), rep


def compile_mjcf(xml: str):
    """Compile MJCF text with MuJoCo; ``ValueError`` with MuJoCo's own message on failure."""
    import mujoco

    try:
        return mujoco.MjModel.from_xml_string(xml)
    except Exception as e:  # noqa: BLE001 - any MuJoCo parser/compiler failure becomes one clear ValueError
        msg = " ".join(str(e).split())
        raise ValueError(f"MuJoCo cannot compile the repaired MJCF: {msg}") from None


# ----------------------------------------------------------------------------- inspection

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
        return [d.length for d in self.demos]


def _demo_sort_key(k: str):
    m = re.search(r"(\d+)$", k)
    return (int(m.group(1)) if m else 1 << 30, k)


def _action_space(env_info: dict, action_dim: int, path, demo=None) -> ActionSpace:
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
        attrs = dict(data.attrs)
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
        keys = sorted([k for k in data if k.startswith("demo")], key=_demo_sort_key)
        if demos is not None:
            unknown = [d for d in demos if d not in keys]
            if unknown:
                raise DemoImportError(path, f"no episode(s) {unknown}; the file has {keys}")
            keys = list(demos)
        if not keys:
            raise DemoImportError(path, "no episodes (data/demo_*) in the file")
        out: list[DemoInfo] = []
        action_dim = None
        space = None
        for k in keys:
            g = data[k]
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
            # MJCF: inline text (robosuite >= 1.2) or a file name in models/ (robosuite 1.0/1.1)
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
            widths = {1 + model.nq + model.nv, 1 + model.nq + model.nv + model.na}
            if s.shape[1] not in widths:
                raise DemoImportError(
                    path, f"states have {s.shape[1]} columns but the scene has nq={model.nq}, nv={model.nv} "
                          f"(expected 1 + nq + nv = {1 + model.nq + model.nv}); the MJCF does not match the recording", k)
            _find_names(model, path, k)
            if space is None:
                space = _action_space(env_info, action_dim, path, k)
            out.append(DemoInfo(k, int(a.shape[0]), xml, model.nq, model.nv, rep))
    return RobomimicInfo(path, env_name, version, env_info, int(action_dim), space, out)


# ----------------------------------------------------------------------------- replay

def _first_id(model, objtype, names):
    import mujoco

    for n in names:
        i = mujoco.mj_name2id(model, objtype, n)
        if i >= 0:
            return i, n
    return -1, None


def _find_names(model, path=None, demo=None) -> dict:
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


def _mat_to_quat_wxyz(mat: np.ndarray) -> np.ndarray:
    import mujoco

    q = np.zeros(4)
    mujoco.mju_mat2Quat(q, np.ascontiguousarray(mat, dtype=np.float64).reshape(9))
    if q[0] < 0:  # one hemisphere, so that the proprio is continuous
        q = -q
    return q


def _continuous_quat(q: np.ndarray) -> None:
    """In place on ``(T, 4)``: flip signs so consecutive quaternions have a positive dot product
    (``q`` and ``-q`` are the same rotation; a sign jump would look like a large motion)."""
    for t in range(1, q.shape[0]):
        if float(np.dot(q[t], q[t - 1])) < 0:
            q[t] = -q[t]


class StateReplayRenderer:
    """Set recorded MuJoCo states in a compiled scene and read camera frames and proprio.

    Args:
        model: ``mujoco.MjModel`` of the recorded scene.
        cameras: camera names to render.
        image_size: ``(Hi, Wi)``.
        render_effects: keep ``mujoco.Renderer``'s default shadows and reflections (``False``: both
            off, about 2x faster on software GL, different pixels).

    ``render(state) -> {cam: uint8 (3, Hi, Wi)}`` upright RGB; ``proprio() -> float32 (9,)`` for the
    state last set. Needs an OpenGL backend (``MUJOCO_GL=egl`` headless). Close with ``close()``
    (or use as a context manager).
    """

    def __init__(self, model, cameras: Sequence[str], image_size: tuple[int, int], render_effects: bool = True):
        import mujoco

        self.model = model
        self.data = mujoco.MjData(model)
        h, w = int(image_size[0]), int(image_size[1])
        missing = [c for c in cameras if mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_CAMERA, c) < 0]
        if missing:
            have = [model.camera(i).name for i in range(model.ncam)]
            raise ValueError(f"camera(s) {missing} not in the scene; it has {have}")
        # the offscreen buffer must hold the requested size
        model.vis.global_.offwidth = max(int(model.vis.global_.offwidth), w)
        model.vis.global_.offheight = max(int(model.vis.global_.offheight), h)
        self.cameras = list(cameras)
        self.names = _find_names(model)
        try:
            self.renderer = mujoco.Renderer(model, height=h, width=w) if self.cameras else None
        except Exception as e:  # noqa: BLE001 - no GL context: say how to get one
            raise RuntimeError(
                f"cannot create an offscreen OpenGL context for MuJoCo (MUJOCO_GL={os.environ.get('MUJOCO_GL')!r}): "
                f"{e}. Headless machines need MUJOCO_GL=egl (or osmesa) set before mujoco is imported") from None
        if self.renderer is not None and not render_effects:
            self.renderer.scene.flags[mujoco.mjtRndFlag.mjRND_SHADOW] = 0
            self.renderer.scene.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = 0

    def set_state(self, state: np.ndarray) -> None:
        """``state``: ``float64 (1 + nq + nv [+ na],)`` = ``[time, qpos, qvel, (act)]``."""
        import mujoco

        m, d = self.model, self.data
        d.time = float(state[0])
        d.qpos[:] = state[1:1 + m.nq]
        d.qvel[:] = state[1 + m.nq:1 + m.nq + m.nv]
        if m.na and state.shape[0] == 1 + m.nq + m.nv + m.na:
            d.act[:] = state[1 + m.nq + m.nv:]
        mujoco.mj_forward(m, d)

    def render(self, state: np.ndarray | None = None) -> dict[str, np.ndarray]:
        if state is not None:
            self.set_state(state)
        out = {}
        for cam in self.cameras:
            self.renderer.update_scene(self.data, camera=cam)
            img = self.renderer.render()  # (Hi, Wi, 3) uint8, rows top-first (mujoco flips GL's buffer)
            out[cam] = np.ascontiguousarray(img.transpose(2, 0, 1))
        return out

    def proprio(self) -> np.ndarray:
        """``float32 (9,)``: eef pos (m, base frame), eef quat_wxyz (base frame), 2 finger qpos (m)."""
        d, n = self.data, self.names
        r_base = d.xmat[n["base"]].reshape(3, 3)
        p_base = d.xpos[n["base"]]
        p = r_base.T @ (d.site_xpos[n["site"]] - p_base)
        r = r_base.T @ d.site_xmat[n["site"]].reshape(3, 3)
        q = _mat_to_quat_wxyz(r)
        f = d.qpos[n["fingers"]]
        return np.concatenate([p, q, f]).astype(np.float32)

    def close(self) -> None:
        if self.renderer is not None:
            self.renderer.close()
            self.renderer = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_robomimic(info: RobomimicInfo, cameras: Sequence[str] = DEFAULT_CAMERAS,
                   image_size: tuple[int, int] = (128, 128), instruction: str | None = None,
                   task_name: str | None = None, progress: bool = True,
                   render_effects: bool = True) -> Iterator[Episode]:
    """Render the episodes of a file validated by :func:`inspect_robomimic`, one at a time.

    Args:
        info: from :func:`inspect_robomimic`.
        cameras: camera names (robosuite's ``agentview``, ``robot0_eye_in_hand``, ...).
        image_size: ``(Hi, Wi)`` in pixels.
        instruction: language instruction; default from the env name (``Lift`` -> "lift the cube").
        task_name: default: the env name lower-cased (``"lift"``).
        progress: tqdm bar over steps.
        render_effects: see :class:`StateReplayRenderer`.

    Yields:
        :class:`wmrl.kernel.types.Episode` per demo, in order (see the module docstring for conventions).
    """
    import h5py
    from tqdm import tqdm

    instruction = instruction or DEFAULT_INSTRUCTIONS.get(info.env_name, info.env_name.lower())
    task_name = task_name if task_name is not None else info.env_name.lower()
    with h5py.File(info.path, "r") as f:
        for demo in info.demos:
            g = f["data"][demo.key]
            states = np.asarray(g["states"], dtype=np.float64)
            actions = np.asarray(g["actions"], dtype=np.float32)
            model = compile_mjcf(demo.xml)
            try:
                rr = StateReplayRenderer(model, cameras, image_size, render_effects)
            except ValueError as e:
                raise DemoImportError(info.path, str(e), demo.key) from None
            T = demo.length
            images = {c: np.empty((T, 3, int(image_size[0]), int(image_size[1])), np.uint8) for c in cameras}
            proprio = np.empty((T, 9), np.float32)
            with rr:
                for t in tqdm(range(T), desc=f"render {demo.key}", disable=not progress, leave=False):
                    frames = rr.render(states[t])
                    for c in cameras:
                        images[c][t] = frames[c]
                    proprio[t] = rr.proprio()
            _continuous_quat(proprio[:, 3:7])
            rewards = np.zeros(T, np.float32)
            rewards[-1] = 1.0
            yield Episode(
                images=images, proprio=proprio, actions=actions, rewards=rewards, success=True,
                instruction=instruction, task_name=task_name, sim_states=states,
                info={"source": str(info.path), "demo": demo.key, "robosuite_version": info.robosuite_version,
                      "env": info.env_name, "eef_site": rr.names["site_name"],
                      "assets_found_by_name": list(demo.repair.by_name)},
            )
