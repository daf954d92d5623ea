"""The kernel: contracts every component stands on and nothing else.

Containers (``types``), role protocols (``interfaces``), checkpoints (``checkpoint``, ``rng``),
storage (``storage``), numeric precision (``precision``) and process helpers (``workers``,
``leftovers``). The kernel imports no component (``worldmodels``, ``policies``, ``sim``,
``robot_bridge``) and no entry point (``wmrl.run``); ``tests/test_layering.py`` enforces it.
"""
