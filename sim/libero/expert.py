"""A scripted expert for the libero_object tasks ("pick up the X and place it in the basket"),
on privileged state (run in ``.venv-libero``).

It reads the raw LIBERO observation dict (robosuite 1.4 observables, world frame, m): the end
effector ``robot0_eef_pos`` ``(3,)``, the grasped object's ``<obj>_pos`` and the basket's
``basket_1_pos``, the object and basket being the task's ``obj_of_interest`` (from its BDDL file).
Phases: above the object (``hover`` m), down to its centre (``grasp_dz`` m above the body origin),
close for ``close_steps``, lift to ``carry_z``, over the basket, down to ``release_dz`` above the
basket origin, open. Each step's command is LIBERO's 7-D ``OSC_POSE`` delta: xyz =
``clip(gain * (target - eef) / 0.05, -1, 1)`` (robosuite's OSC_POSE scales a unit command to
0.05 m), rotation 0 (the gripper keeps pointing down), gripper ``-1`` open / ``+1`` closed.
"""

from __future__ import annotations

import numpy as np

POS_SCALE = 0.05  # m per unit of an OSC_POSE delta command (robosuite 1.4 output_max)


class ObjectPlaceExpert:
    """Pick ``obj`` and place it into ``basket`` (names as in the raw observation keys)."""

    def __init__(self, obj: str, basket: str = "basket_1", hover: float = 0.10, grasp_dz: float = 0.0,
                 carry_z: float = 0.30, release_dz: float = 0.16, gain: float = 1.0, close_steps: int = 12,
                 open_steps: int = 15, tol: float = 0.01, stall_m: float = 0.002):
        self.obj, self.basket = obj, basket
        self.hover, self.grasp_dz, self.carry_z, self.release_dz = hover, grasp_dz, carry_z, release_dz
        self.gain, self.close_steps, self.open_steps, self.tol = gain, close_steps, open_steps, tol
        self.stall_m = stall_m
        self.reset()

    def reset(self) -> None:
        self.phase, self.count, self._trail = "hover", 0, []

    def _move(self, eef: np.ndarray, target: np.ndarray, grip: float) -> tuple[np.ndarray, bool]:
        err = target - eef
        a = np.zeros(7)
        a[:3] = np.clip(self.gain * err / POS_SCALE, -1.0, 1.0)
        a[6] = grip
        return a, bool(np.linalg.norm(err) < self.tol)

    def act(self, raw: dict) -> np.ndarray:
        """``float64 (7,)`` command for the raw observation ``raw``."""
        eef = np.asarray(raw["robot0_eef_pos"], np.float64)
        obj = np.asarray(raw[f"{self.obj}_pos"], np.float64)
        bas = np.asarray(raw[f"{self.basket}_pos"], np.float64)
        grasp = obj + np.array([0.0, 0.0, self.grasp_dz])
        if self.phase == "hover":
            a, ok = self._move(eef, grasp + np.array([0.0, 0.0, self.hover]), -1.0)
            if ok:
                self.phase, self.count, self._trail = "descend", 0, []
        elif self.phase == "descend":
            a, ok = self._move(eef, grasp, -1.0)
            self.count += 1
            self._trail.append(eef.copy())
            stalled = len(self._trail) > 6 and np.linalg.norm(self._trail[-1] - self._trail[-6]) < self.stall_m
            if ok or stalled or self.count > 60:  # reached, or the fingers rest on the object / table
                self.phase, self.count = "close", 0
        elif self.phase == "close":
            a, _ = self._move(eef, grasp, 1.0)
            self.count += 1
            if self.count >= self.close_steps:
                self.phase = "lift"
        elif self.phase == "lift":
            a, ok = self._move(eef, np.array([eef[0], eef[1], self.carry_z]), 1.0)
            if ok or eef[2] > self.carry_z - 0.02:
                self.phase = "carry"
        elif self.phase == "carry":
            target = np.array([bas[0], bas[1], self.carry_z])
            a, ok = self._move(eef, target, 1.0)
            if np.linalg.norm((target - eef)[:2]) < 0.015:
                self.phase = "lower"
        elif self.phase == "lower":
            a, ok = self._move(eef, bas + np.array([0.0, 0.0, self.release_dz]), 1.0)
            if ok:
                self.phase, self.count = "release", 0
        else:  # release, then hold still
            a, _ = self._move(eef, eef, -1.0)
            self.count += 1
        return a
