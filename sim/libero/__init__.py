"""The original LIBERO suites (issue #22), run in their own environment (``.venv-libero``, made by
``scripts/setup_libero.sh``: hf-libero 0.1.4 on robosuite 1.4.0 and mujoco 3.2.7, which cannot share
the main environment's robosuite 1.5).

* ``sim.libero.init_states``: the official init states read with an allow-list unpickler (pure
  Python, also in the main environment);
* ``sim.libero.setup_env``: LIBERO's offline config and asset link (``python -m sim.libero.setup_env``);
* ``sim.libero.env``: ``LiberoEnv`` (one task from its BDDL file, official init states by index,
  LIBERO's settle steps and step limits, agentview + wrist frames) and ``LiberoChunkEnv`` (the
  ``ChunkEnv`` over it that ``robot_bridge.arm.ChunkEnvArm`` drives as a simulated robot).

Importing this package imports neither LIBERO nor MuJoCo.
"""


def parse_range(spec: str) -> list[int]:
    """Indices from a command-line list such as ``"0-9"``, ``"0,49"`` or ``"3,5-7"`` (ranges inclusive)."""
    out: list[int] = []
    for part in spec.split(","):
        if "-" in part:
            a, b = part.split("-")
            out.extend(range(int(a), int(b) + 1))
        elif part:
            out.append(int(part))
    return out
