"""Validation of episodes before they are written to an :class:`~wmrl.kernel.storage.EpisodeStore`.

:func:`_coerce_episode` turns torch tensors into numpy arrays and ``info`` into plain JSON types;
:func:`_validate_episode` checks every field against the store metadata (dtypes, shapes ``(T, ...)``,
finite values, camera names and sizes, JSON ``info``) and raises
:class:`~wmrl.kernel.storage.errors.EpisodeValidationError` naming episode, key and first bad step.
Nothing here writes to disk.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from wmrl.kernel.storage.errors import EpisodeValidationError
from wmrl.kernel.types import Episode


def _first_bad_step(x: np.ndarray) -> int:
    """Index along axis 0 of the first non-finite entry of ``x`` (which must hold one)."""
    bad = ~np.isfinite(x)
    return int(np.argwhere(bad)[0][0])


def _plain(x: Any) -> Any:
    """numpy / torch scalars and arrays inside ``info`` -> plain JSON types (others unchanged)."""
    if isinstance(x, Mapping):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().tolist()
    return x


def _coerce_episode(ep: Episode) -> Episode:
    """A shallow copy of ``ep`` with torch tensors as numpy arrays and ``info`` as plain JSON types
    (dtypes and shapes are left for :func:`_validate_episode` to judge)."""
    if not isinstance(ep, Episode):
        return ep

    def arr(x):
        return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else x

    return dataclasses.replace(
        ep,
        images={k: arr(v) for k, v in (ep.images or {}).items()},
        proprio=arr(ep.proprio), actions=arr(ep.actions), rewards=arr(ep.rewards),
        sim_states=arr(ep.sim_states), extras={k: arr(v) for k, v in (ep.extras or {}).items()},
        success=bool(ep.success.item()) if isinstance(ep.success, (torch.Tensor, np.ndarray))
        and ep.success.dtype in (torch.bool, np.bool_) and ep.success.ndim == 0 else ep.success,
        info=_plain(ep.info or {}),
    )


def _validate_episode(ep: Episode, meta: dict, index: int | None) -> None:
    """Raise :class:`EpisodeValidationError` at the first field of ``ep`` that does not fit ``meta``."""
    def err(msg: str, key: str | None = None, step: int | None = None):
        return EpisodeValidationError(msg, episode=index, key=key, step=step)

    if not isinstance(ep, Episode):
        raise err(f"expected a wmrl.kernel.types.Episode, got {type(ep).__name__}")
    D_s, D_a = int(meta["state_dim"]), int(meta["action_dim"])

    def as_float(key: str, x, shape: tuple) -> np.ndarray:
        try:
            a = np.asarray(x)
        except Exception as e:  # noqa: BLE001 - anything that is not array-like
            raise err(f"not array-like ({e})", key) from None
        if a.dtype.kind not in "fiub":
            raise err(f"must hold numbers, got dtype {a.dtype}", key)
        if a.shape != shape:
            raise err(f"expected shape {shape}, got {a.shape}", key)
        if a.size and not np.isfinite(a).all():
            s = _first_bad_step(a)
            bad = a[s][~np.isfinite(a[s])] if a.ndim > 1 else a[s]
            raise err(f"holds non-finite values ({np.ravel(bad)[:3].tolist()}); remove or fix that step", key, s)
        return a

    acts = np.asarray(ep.actions)
    if acts.ndim != 2:
        raise err(f"expected shape (T, D_a={D_a}), got {acts.shape}", "actions")
    T = int(acts.shape[0])
    if T < 1:
        raise err("episode has no steps (T=0)", "actions")
    if acts.shape[1] != D_a:
        raise err(f"action dim {acts.shape[1]} does not match the store's action_dim={D_a} "
                  f"(actions must be (T, {D_a}))", "actions")
    as_float("actions", acts, (T, D_a))
    prop = np.asarray(ep.proprio)
    if prop.ndim == 2 and prop.shape[0] == T and prop.shape[1] != D_s:
        raise err(f"state dim {prop.shape[1]} does not match the store's state_dim={D_s}", "proprio")
    as_float("proprio", prop, (T, D_s))
    as_float("rewards", ep.rewards, (T,))
    if ep.sim_states is not None:
        s = np.asarray(ep.sim_states)
        if s.ndim != 2:
            raise err(f"expected (T={T}, S), got {s.shape}", "sim_states")
        as_float("sim_states", s, (T, s.shape[1]))
    cams = meta["cameras"]
    got = set((ep.images or {}).keys())
    if got != set(cams):
        missing, extra = sorted(set(cams) - got), sorted(got - set(cams))
        raise err(f"cameras do not match the store's {sorted(cams)}: missing {missing}, unexpected {extra}",
                  "images")
    for cam, (h, w) in cams.items():
        img = ep.images[cam]
        key = f"images/{cam}"
        if not isinstance(img, np.ndarray):
            raise err(f"must be a numpy array, got {type(img).__name__}", key)
        if img.dtype != np.uint8:
            raise err(f"must be uint8 RGB, got dtype {img.dtype} (convert with (x*255).round().astype(np.uint8))",
                      key)
        if img.shape != (T, 3, h, w):
            hint = " (channel-last? transpose to (T, 3, Hi, Wi))" if img.shape == (T, h, w, 3) else ""
            raise err(f"expected shape {(T, 3, h, w)}, got {img.shape}{hint}", key)
    for k, v in (ep.extras or {}).items():
        if not isinstance(k, str) or not k or "/" in k:
            raise err(f"extras keys must be non-empty strings without '/', got {k!r}", "extras")
        a = np.asarray(v)
        if a.ndim < 1 or a.shape[0] != T:
            raise err(f"must have leading dim T={T}, got shape {a.shape}", f"extras/{k}")
        if a.dtype.kind not in "fiub":
            raise err(f"must hold numbers or bools, got dtype {a.dtype}", f"extras/{k}")
    if not isinstance(ep.success, (bool, np.bool_)) and ep.success not in (0, 1):
        raise err(f"must be a bool, got {ep.success!r}", "success")
    for name, val in (("instruction", ep.instruction), ("task_name", ep.task_name)):
        if not isinstance(val, str):
            raise err(f"must be a str, got {type(val).__name__}", name)
    try:
        json.dumps(ep.info or {})
    except (TypeError, ValueError) as e:
        raise err(f"is not JSON-serialisable ({e}); use plain str/int/float/list/dict", "info") from None
