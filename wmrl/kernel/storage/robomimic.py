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

This module holds the conversion (state replay and rendering); the MJCF repair is in
``robomimic_mjcf.py`` and the inspection / schema checks in ``robomimic_inspect.py``, whose public
names are re-exported here.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

import numpy as np

from wmrl.kernel.storage.errors import DemoImportError
from wmrl.kernel.storage.robomimic_inspect import (
    BASE_BODIES,
    EEF_SITES,
    FINGER_JOINTS,
    DemoInfo,
    RobomimicInfo,
    _find_names,
    inspect_robomimic,
)
from wmrl.kernel.storage.robomimic_mjcf import (
    ASSETS_MARKER,
    MjcfRepair,
    compile_mjcf,
    installed_robosuite_assets,
    repair_mjcf,
    robosuite_version,
)
from wmrl.kernel.types import AGENTVIEW, EYE_IN_HAND, Episode

__all__ = [
    "ASSETS_MARKER", "BASE_BODIES", "DEFAULT_CAMERAS", "DEFAULT_INSTRUCTIONS", "EEF_SITES", "FINGER_JOINTS",
    "DemoImportError", "DemoInfo", "MjcfRepair", "RobomimicInfo", "StateReplayRenderer", "compile_mjcf",
    "inspect_robomimic", "installed_robosuite_assets", "read_robomimic", "repair_mjcf", "robosuite_version",
]

DEFAULT_CAMERAS = (AGENTVIEW, EYE_IN_HAND)
DEFAULT_INSTRUCTIONS = {
    "Lift": "lift the cube",
    "Stack": "stack the red cube on the green cube",
    "Door": "open the door",
    "Wipe": "wipe the table",
    "PickPlaceCan": "pick up the can and place it in its bin",
    "NutAssemblySquare": "fit the square nut onto the square peg",
}


# ----------------------------------------------------------------------------- replay

def _mat_to_quat_wxyz(mat: np.ndarray) -> np.ndarray:
    """``float64 (4,)`` quaternion ``wxyz`` (``w >= 0``) of a ``(3, 3)`` rotation matrix."""
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
        """``{cam: uint8 (3, Hi, Wi)}`` at ``state`` (set first when given) or the state last set."""
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
