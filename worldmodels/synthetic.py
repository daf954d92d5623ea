"""A tiny deterministic 2-D "lift" toy with two cameras, for tests and smoke runs of world models
and critics without a simulator.

A gripper square moves by the xy of an ``OSC_POSE``-like delta action; closing the gripper
(``action[6] > 0``) next to the red block grasps it; success when the block is carried to the top
band of the image. ``agentview`` shows the whole scene, ``robot0_eye_in_hand`` a gripper-centred
crop. Proprio ``D_s = 9`` (xyz, quat_wxyz, 2 finger positions), actions ``D_a = 7``.
"""

from __future__ import annotations

import numpy as np

from wmrl.kernel.types import Episode

_SPEED = 0.04  # normalised units per step at |action| = 1


def _draw(g: np.ndarray, o: np.ndarray, closed: bool, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Render both cameras: ``uint8 (3, size, size)`` each. Positions in [0, 1]^2 (y down)."""
    big = size * 2
    canvas = np.full((3, big, big), 40, dtype=np.uint8)
    canvas[:, big // 2:, :] = 90  # table

    def box(c, p, half, colour):
        x, y = int(p[0] * (big - 1)), int(p[1] * (big - 1))
        c[:, max(0, y - half): y + half, max(0, x - half): x + half] = np.array(colour, np.uint8)[:, None, None]

    box(canvas, o, big // 16, (220, 30, 30))
    box(canvas, g, big // 20, (230, 230, 60) if closed else (60, 200, 230))
    agent = canvas[:, ::2, ::2].copy()
    # wrist camera: crop of `size` pixels around the gripper (padded)
    pad = np.pad(canvas, ((0, 0), (size // 2, size // 2), (size // 2, size // 2)), constant_values=0)
    x, y = int(g[0] * (big - 1)), int(g[1] * (big - 1))
    wrist = pad[:, y: y + size, x: x + size].copy()
    return agent, wrist


def make_episode(seed: int, length: int = 40, size: int = 32, expert: bool = True) -> Episode:
    """One toy episode. ``expert=True`` reaches, grasps and lifts (usually succeeds); ``False`` acts
    randomly (usually fails). Deterministic given ``seed``."""
    rng = np.random.default_rng(seed)
    g = np.array([rng.uniform(0.2, 0.8), rng.uniform(0.2, 0.4)])
    o = np.array([rng.uniform(0.2, 0.8), rng.uniform(0.7, 0.85)])
    grasped, closed, success = False, False, False
    imgs_a, imgs_w, prop, acts, rews = [], [], [], [], []
    for _ in range(length):
        a_img, w_img = _draw(g, o, closed, size)
        imgs_a.append(a_img)
        imgs_w.append(w_img)
        fingers = [0.0, 0.0] if closed else [0.04, -0.04]
        prop.append([g[0], g[1], 0.0, 1.0, 0.0, 0.0, 0.0, *fingers])
        a = np.zeros(7, dtype=np.float32)
        if expert:
            d = o - g if not grasped else np.array([0.0, 0.1 - g[1]])
            a[:2] = np.clip(d / _SPEED, -1, 1) + rng.normal(0, 0.2, 2)
            a[6] = 1.0 if (np.abs(o - g).max() < 0.04 or grasped) else -1.0
        else:
            a[:2] = rng.uniform(-1, 1, 2)
            a[6] = rng.choice([-1.0, 1.0])
        a[2] = rng.normal(0, 0.1)
        a = np.clip(a, -1, 1)
        acts.append(a)
        closed = a[6] > 0
        if closed and np.abs(o - g).max() < 0.05:
            grasped = True
        if not closed:
            grasped = False
        g = np.clip(g + _SPEED * a[:2], 0.05, 0.95)
        if grasped:
            o = g.copy()
        elif o[1] < 0.75:  # dropped blocks fall back onto the table
            o = np.array([o[0], min(0.8, o[1] + 0.1)])
        success = success or o[1] < 0.25
        rews.append(1.0 if o[1] < 0.25 else 0.0)
    return Episode(
        images={"agentview": np.stack(imgs_a), "robot0_eye_in_hand": np.stack(imgs_w)},
        proprio=np.asarray(prop, dtype=np.float32),
        actions=np.asarray(acts, dtype=np.float32),
        rewards=np.asarray(rews, dtype=np.float32),
        success=bool(success),
        instruction="lift the red block",
        task_name="toy_lift",
        info={"seed": seed, "expert": expert},
    )


def make_episodes(n: int, length: int = 40, size: int = 32, fail_every: int = 3, seed: int = 0) -> list[Episode]:
    """``n`` toy episodes; every ``fail_every``-th one acts randomly."""
    return [make_episode(seed * 100_003 + i, length, size, expert=(i % fail_every != fail_every - 1))
            for i in range(n)]
