"""Tabletop scenes for the Panda suite, built from robosuite parts (LIBERO builds its scenes the
same way): a ``TableArena``, robosuite primitive objects, the Panda with its default gripper and
robosuite's ``BASIC`` composite controller (``OSC_POSE``, base frame, 20 Hz; delta by default, the
arm control of ``sim.control`` decides).

A scene is only the world; tasks (``sim.tasks``) add an instruction, a success predicate and init
states. Robosuite does no rendering here (``has_offscreen_renderer=False``): ``sim.render`` draws
the cameras, and robosuite's observables are not built (the suite computes its own proprio).

Scenes:
* ``two_cubes``: a red cube (4 cm) and a green cube (5 cm) on the table.
* ``cube_target``: a red cube and a flat green target disc (12 cm across, on x/y slide joints so
  its place is part of the MuJoCo state; it has no contacts) on the table.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from sim import _backend

TABLE_OFFSET = np.array([0.0, 0.0, 0.8])
TABLE_SIZE = (0.8, 0.8, 0.05)
RED_HALF = 0.02
GREEN_HALF = 0.025
TARGET_RADIUS = 0.06
TARGET_HALF_HEIGHT = 0.001
TABLE_TOP = float(TABLE_OFFSET[2])

SCENES = ("two_cubes", "cube_target")


def _scene_class():
    """Build the robosuite ``ManipulationEnv`` subclass lazily (robosuite imports mujoco)."""
    if "cls" in _CLS:
        return _CLS["cls"]
    _backend.robosuite()
    from robosuite.environments.manipulation.manipulation_env import ManipulationEnv
    from robosuite.models.arenas import TableArena
    from robosuite.models.tasks import ManipulationTask

    class TabletopScene(ManipulationEnv):
        """A Panda at a table with the objects of ``scene`` (see module docstring).

        The robot starts at robosuite's default Panda joint configuration, without noise; object
        poses come from the task's stored init states (``sim.init_states``), never sampled here.
        """

        def __init__(self, scene: str, controller_configs: dict, control_freq: float = 20.0):
            if scene not in SCENES:
                raise ValueError(f"unknown scene {scene!r}; known: {SCENES}")
            self.scene = scene
            self.table_offset = TABLE_OFFSET.copy()
            super().__init__(
                robots="Panda",
                controller_configs=controller_configs,
                gripper_types="default",
                initialization_noise=None,
                use_camera_obs=False,
                has_renderer=False,
                has_offscreen_renderer=False,
                render_camera=None,
                control_freq=control_freq,
                lite_physics=True,
                horizon=10**9,
                ignore_done=True,
                hard_reset=False,
                renderer="mujoco",
            )

        def _load_model(self):
            super()._load_model()
            xpos = self.robots[0].robot_model.base_xpos_offset["table"](TABLE_SIZE[0])
            self.robots[0].robot_model.set_base_xpos(xpos)
            arena = TableArena(table_full_size=TABLE_SIZE, table_friction=(1.0, 5e-3, 1e-4),
                               table_offset=TABLE_OFFSET)
            arena.set_origin([0, 0, 0])
            self.objects = _scene_objects(self.scene)
            self.model = ManipulationTask(mujoco_arena=arena, mujoco_robots=[r.robot_model for r in self.robots],
                                          mujoco_objects=list(self.objects.values()))

        def _setup_references(self):
            super()._setup_references()
            self.body_ids = {k: self.sim.model.body_name2id(o.root_body) for k, o in self.objects.items()}
            if "target" in self.objects:  # the target is drawn, never touched
                for g in self.objects["target"].contact_geoms:
                    gid = self.sim.model.geom_name2id(g)
                    self.sim.model.geom_contype[gid] = 0
                    self.sim.model.geom_conaffinity[gid] = 0

        def _setup_observables(self):
            return OrderedDict()  # the suite computes its own observations

        def reward(self, action=None):
            return 0.0  # the task owns reward and success

    _CLS["cls"] = TabletopScene
    return TabletopScene


_CLS: dict = {}


def _scene_objects(scene: str) -> OrderedDict:
    """The robosuite objects of ``scene`` by name (``red``, then ``green`` or ``target``)."""
    from robosuite.models.objects import BoxObject, CylinderObject

    objects = OrderedDict()
    objects["red"] = BoxObject(name="red_cube", size=[RED_HALF] * 3, rgba=[0.85, 0.1, 0.1, 1], density=500.0)
    if scene == "two_cubes":
        objects["green"] = BoxObject(name="green_cube", size=[GREEN_HALF] * 3, rgba=[0.1, 0.7, 0.15, 1],
                                     density=500.0)
    else:
        slide = dict(type="slide", damping="1", limited="false")
        objects["target"] = CylinderObject(
            name="target", size=[TARGET_RADIUS, TARGET_HALF_HEIGHT], rgba=[0.1, 0.7, 0.15, 1],
            obj_type="all", density=100.0,
            joints=[dict(slide, name="tx", axis="1 0 0"), dict(slide, name="ty", axis="0 1 0")],
        )
        # the slide joints move it in x/y from the origin; its height is fixed on the table top
        objects["target"].get_obj().set("pos", f"0 0 {TABLE_TOP + TARGET_HALF_HEIGHT + 0.0005}")
    return objects


def default_controller_config() -> dict:
    """Robosuite's default composite controller config of the Panda (``BASIC`` with ``OSC_POSE``
    delta in the base frame, output scaled to 5 cm / 0.5 rad per control step)."""
    _backend.robosuite()
    from robosuite.controllers import load_composite_controller_config

    cfg = load_composite_controller_config(controller=None, robot="Panda")
    arm = cfg["body_parts"]["right"]
    if arm["type"] != "OSC_POSE" or arm["input_type"] != "delta" or arm["input_ref_frame"] != "base":
        raise RuntimeError(f"robosuite's default Panda controller changed: {arm}")
    return cfg


def make_scene(scene: str, control_freq: float = 20.0, controller_configs: dict | None = None):
    """A fresh ``TabletopScene`` (a robosuite ``ManipulationEnv``), already reset once, running
    ``controller_configs`` (default: :func:`default_controller_config`; see ``sim.control``)."""
    cfg = default_controller_config() if controller_configs is None else controller_configs
    env = _scene_class()(scene, controller_configs=cfg, control_freq=control_freq)
    env.reset()
    return env
