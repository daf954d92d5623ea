"""Offscreen rendering of robosuite scenes with switchable render effects.

One OpenGL context per process (created lazily, on the first frame) and one ``mujoco.MjrContext``
per scene model. Robosuite has no switch for its render effects, and MuJoCo fixes the shadow map
size and the multisample count when the ``MjrContext`` is created, so both are set on the model
*before* the context is created (zero = off). Shadows, reflections, skybox and haze are scene
flags, set for every frame.

Backends: ``MUJOCO_GL`` when set (``egl``, ``osmesa``, ``glfw``, ``glx``); otherwise ``egl`` then
``osmesa`` (headless). With none usable, :func:`gl_context` raises ``RuntimeError`` naming
``MUJOCO_GL`` and every backend tried with its error.

Images come out ``uint8 (Hi, Wi, 3)`` **upright**: MuJoCo's offscreen buffer is bottom-up and is
flipped here, once.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import numpy as np

from sim import _backend

_GL_BACKENDS = ("egl", "osmesa", "glfw", "glx")
_MAX_GL_SIZE = 1024


@dataclass(frozen=True)
class RenderSettings:
    """Render effects (all off by default: 3-4x faster with software GL) and the robot's look.

    Attributes:
        shadows: shadow maps (``model.vis.quality.shadowsize`` 4096 when on, 0 when off).
        reflections: reflective materials (scene flag ``mjRND_REFLECTION``).
        antialiasing: multisample anti-aliasing (``model.vis.quality.offsamples`` 4 when on, 0 off).
        skybox: the skybox texture (scene flag ``mjRND_SKYBOX``).
        haze: the horizon haze (scene flag ``mjRND_HAZE``).
        flat_robot: draw the robot with its collision geoms in flat colours instead of its visual
            meshes (default: about 2x more control steps/s with two 64x64 cameras on software GL;
            at 64x64 the arm looks almost the same). Collect, train and evaluate with one setting.
    """

    shadows: bool = False
    reflections: bool = False
    antialiasing: bool = False
    skybox: bool = False
    haze: bool = False
    flat_robot: bool = True

    @classmethod
    def from_any(cls, x) -> "RenderSettings":
        if x is None:
            return cls()
        if isinstance(x, RenderSettings):
            return x
        d = dict(x)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown render setting(s) {sorted(unknown)}; known: {sorted(known)}")
        return cls(**{k: bool(v) for k, v in d.items()})


_GL: dict = {}


def _candidates() -> list[str]:
    req = _backend.requested_gl()
    if req is not None and req.strip() != "":
        return [req.strip().lower()]
    return ["egl", "osmesa"]


def gl_context():
    """The process-wide OpenGL context (made current). Created on first use.

    Raises:
        RuntimeError: no usable offscreen backend; the message names ``MUJOCO_GL`` and each backend
            tried with the error it gave.
    """
    if "ctx" in _GL:
        _GL["ctx"].make_current()
        return _GL["ctx"]
    _backend.mujoco()
    errors = []
    for name in _candidates():
        if name not in _GL_BACKENDS:
            errors.append(f"{name!r}: not a MuJoCo offscreen backend (valid: {', '.join(_GL_BACKENDS)})")
            continue
        try:
            if name in ("egl", "osmesa"):
                os.environ.setdefault("PYOPENGL_PLATFORM", name)
            if name == "egl":
                from mujoco.egl import GLContext
            elif name == "osmesa":
                from mujoco.osmesa import GLContext
            elif name == "glfw":
                from mujoco.glfw import GLContext
            else:
                from mujoco.glfw import GLContext  # glx goes through GLFW's X11 window
            ctx = GLContext(_MAX_GL_SIZE, _MAX_GL_SIZE)
            ctx.make_current()
        except Exception as e:  # noqa: BLE001 - every backend error is reported below
            errors.append(f"{name!r}: {type(e).__name__}: {e}")
            continue
        _GL["ctx"], _GL["backend"] = ctx, name
        return ctx
    req = _backend.requested_gl()
    raise RuntimeError(
        "No usable offscreen OpenGL backend for MuJoCo rendering "
        f"(MUJOCO_GL={req!r}). Backends tried: " + "; ".join(errors) + ". "
        "Set MUJOCO_GL to a working backend: 'egl' (GPU or Mesa EGL, headless) or 'osmesa' "
        "(software), e.g. `MUJOCO_GL=egl wmrl ...`, or run without cameras."
    )


def gl_backend() -> str | None:
    """Name of the backend in use, or ``None`` before the first frame."""
    return _GL.get("backend")


class SceneRenderer:
    """Renders cameras of one scene model (any ``MjData`` of that model) to upright RGB arrays.

    Args:
        model: the ``mujoco.MjModel`` of the scene (its render settings are edited in place
            before the ``MjrContext`` is created).
        settings: :class:`RenderSettings`.
        max_size: largest ``(Hi, Wi)`` that will be rendered.
        robot_prefixes: geom name prefixes of the robot (for ``flat_robot``).
    """

    def __init__(self, model, settings: RenderSettings, max_size: tuple[int, int],
                 robot_prefixes: tuple[str, ...] = ("robot0_", "gripper0_", "mount0_")):
        mj = _backend.mujoco()
        self._mj = mj
        self.settings = settings
        gl_context()
        self.model = model
        model.vis.global_.offheight = max(int(max_size[0]), 1)
        model.vis.global_.offwidth = max(int(max_size[1]), 1)
        model.vis.quality.shadowsize = 4096 if settings.shadows else 0
        model.vis.quality.offsamples = 4 if settings.antialiasing else 0
        self.vopt = mj.MjvOption()
        if settings.flat_robot:
            self._make_robot_flat(model, robot_prefixes)
            self.vopt.geomgroup[:] = 0
            self.vopt.geomgroup[1] = 1
            self.vopt.geomgroup[4] = 1
        else:
            self.vopt.geomgroup[:] = 0
            self.vopt.geomgroup[1] = 1
        self.scn = mj.MjvScene(model, maxgeom=2000)
        flags = mj.mjtRndFlag
        self.scn.flags[flags.mjRND_SHADOW] = int(settings.shadows)
        self.scn.flags[flags.mjRND_REFLECTION] = int(settings.reflections)
        self.scn.flags[flags.mjRND_SKYBOX] = int(settings.skybox)
        self.scn.flags[flags.mjRND_HAZE] = int(settings.haze)
        self.cam = mj.MjvCamera()
        self.cam.type = mj.mjtCamera.mjCAMERA_FIXED
        self.pert = mj.MjvPerturb()
        self.con = mj.MjrContext(model, mj.mjtFontScale.mjFONTSCALE_150)
        mj.mjr_setBuffer(mj.mjtFramebuffer.mjFB_OFFSCREEN, self.con)
        self._cam_ids: dict[str, int] = {}

    @staticmethod
    def _make_robot_flat(model, prefixes):
        """Hide the robot's visual meshes (group 1 -> 3) and show its collision geoms in group 4."""
        import mujoco as mj

        for g in range(model.ngeom):
            name = mj.mj_id2name(model, mj.mjtObj.mjOBJ_GEOM, g) or ""
            body = mj.mj_id2name(model, mj.mjtObj.mjOBJ_BODY, model.geom_bodyid[g]) or ""
            if not (name.startswith(prefixes) or body.startswith(prefixes)):
                continue
            if model.geom_group[g] == 1 and model.geom_contype[g] == 0 and model.geom_conaffinity[g] == 0:
                model.geom_group[g] = 3
            elif model.geom_group[g] == 0:
                model.geom_group[g] = 4
                model.geom_matid[g] = -1
                # fingers dark grey, links light grey
                dark = "finger" in name or "finger" in body or "hand" in body
                model.geom_rgba[g] = (0.25, 0.25, 0.28, 1.0) if dark else (0.85, 0.85, 0.88, 1.0)

    def camera_id(self, camera: str) -> int:
        if camera not in self._cam_ids:
            cid = self._mj.mj_name2id(self.model, self._mj.mjtObj.mjOBJ_CAMERA, camera)
            if cid < 0:
                raise ValueError(f"camera {camera!r} not in the scene model")
            self._cam_ids[camera] = cid
        return self._cam_ids[camera]

    def render(self, data, camera: str, size: tuple[int, int]) -> np.ndarray:
        """Render ``camera`` of ``data`` at ``size = (Hi, Wi)``; returns upright ``uint8 (Hi, Wi, 3)``."""
        mj = self._mj
        h, w = int(size[0]), int(size[1])
        if h > self.model.vis.global_.offheight or w > self.model.vis.global_.offwidth:
            raise ValueError(f"frame size {(h, w)} exceeds the renderer's max size "
                             f"{(self.model.vis.global_.offheight, self.model.vis.global_.offwidth)}")
        _GL["ctx"].make_current()
        # several scene contexts share the GL context: bind this one's offscreen framebuffer
        mj.mjr_setBuffer(mj.mjtFramebuffer.mjFB_OFFSCREEN, self.con)
        self.cam.fixedcamid = self.camera_id(camera)
        mj.mjv_updateScene(self.model, data, self.vopt, self.pert, self.cam, mj.mjtCatBit.mjCAT_ALL, self.scn)
        viewport = mj.MjrRect(0, 0, w, h)
        mj.mjr_render(viewport, self.scn, self.con)
        out = np.empty((h, w, 3), dtype=np.uint8)
        mj.mjr_readPixels(out, None, viewport, self.con)
        return out[::-1].copy()
