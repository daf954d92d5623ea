"""Normalisation statistics that stay finite for zero-variance dimensions, in both directions.

Two modes, as in LeRobot's ``NormalizationMode`` (``MEAN_STD``) and Diffusion Policy / pi0's
quantile normalisation (``q01..q99 -> -1..1``):

* ``"mean_std"``: ``y = (x - mean) / std``;
* ``"quantile"``: ``y = (x - c) / r`` with ``c = (q01 + q99) / 2`` and ``r = (q99 - q01) / 2``, so
  ``q01 -> -1`` and ``q99 -> +1`` (values outside the 1..99 % range map outside [-1, 1]; nothing is
  clipped).

A dimension whose scale (``std`` or ``r``) is below ``eps = 1e-4`` (e.g. rotation dims 3 and 4 of the
robosuite lift demos, exactly 0 in every step) uses scale 1: it maps ``x -> x - centre`` (0 for the
constant value) and back to the constant, never NaN or inf.

:class:`NormStats` is plain data (numpy; JSON via ``to_dict`` / ``from_dict``; flat tensors via
``to_tensors`` / ``from_tensors`` for safetensors). :class:`Normalizer` is an ``nn.Module`` holding
the same statistics as buffers, so they travel inside a model's checkpoint; it raises
:class:`MissingStatsError` when used before statistics were set (no silent identity).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from torch import nn

from wmrl.kernel.storage.errors import MissingStatsError

STAT_NAMES = ("mean", "std", "min", "max", "q01", "q99")
Mode = Literal["mean_std", "quantile"]
EPS = 1e-4  # Diffusion Policy's range_eps (normalizer.py): scales below it count as constant


def _scale_centre(s: Mapping[str, np.ndarray], mode: str, eps: float) -> tuple[np.ndarray, np.ndarray]:
    if mode == "mean_std":
        centre, scale = s["mean"], s["std"]
    elif mode == "quantile":
        centre, scale = (s["q01"] + s["q99"]) / 2.0, (s["q99"] - s["q01"]) / 2.0
    else:
        raise ValueError(f"unknown normalisation mode {mode!r}; use 'mean_std' or 'quantile'")
    scale = np.where(np.abs(scale) < eps, 1.0, scale)
    return centre.astype(np.float32), scale.astype(np.float32)


def _apply(x, centre: np.ndarray, scale: np.ndarray, inverse: bool):
    if isinstance(x, torch.Tensor):
        c = torch.as_tensor(centre, device=x.device, dtype=x.dtype if x.is_floating_point() else torch.float32)
        s = torch.as_tensor(scale, device=x.device, dtype=c.dtype)
        return x * s + c if inverse else (x - c) / s
    x = np.asarray(x)
    dt = x.dtype if x.dtype.kind == "f" else np.float32
    c, s = centre.astype(dt), scale.astype(dt)
    return x * s + c if inverse else (x - c) / s


@dataclass
class NormStats:
    """Per-key, per-dimension statistics ``mean, std, min, max, q01, q99`` (each ``float32 (D,)``).

    Attributes:
        stats: key (e.g. ``"proprio"``, ``"actions"``) -> stat name -> ``float32 (D,)``.
        count: key -> number of samples the statistics were computed from.
    """

    stats: dict[str, dict[str, np.ndarray]]
    count: dict[str, int] = field(default_factory=dict)

    def __post_init__(self):
        for key, s in self.stats.items():
            missing = [n for n in STAT_NAMES if n not in s]
            if missing:
                raise MissingStatsError(f"NormStats[{key!r}] lacks {missing}")
            dims = {np.asarray(s[n]).shape for n in STAT_NAMES}
            if len(dims) != 1 or len(next(iter(dims))) != 1:
                raise ValueError(f"NormStats[{key!r}] stats must all be 1-D of one length, got {dims}")
            self.stats[key] = {n: np.asarray(s[n], dtype=np.float32) for n in STAT_NAMES}
            for n in STAT_NAMES:
                if not np.isfinite(self.stats[key][n]).all():
                    raise ValueError(f"NormStats[{key!r}][{n!r}] holds non-finite values: {self.stats[key][n]}")

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_data(cls, data: Mapping[str, np.ndarray]) -> "NormStats":
        """Compute statistics from arrays ``(N, D)`` (any leading dims are flattened)."""
        stats, count = {}, {}
        for key, x in data.items():
            x = np.asarray(x, dtype=np.float64)
            x = x.reshape(-1, x.shape[-1])
            if x.shape[0] == 0:
                raise ValueError(f"cannot compute NormStats[{key!r}] from zero samples")
            if not np.isfinite(x).all():
                row = int(np.argwhere(~np.isfinite(x))[0][0])
                raise ValueError(f"NormStats[{key!r}]: non-finite value in sample {row}")
            q01, q99 = np.quantile(x, [0.01, 0.99], axis=0)
            stats[key] = {"mean": x.mean(0), "std": x.std(0), "min": x.min(0), "max": x.max(0),
                          "q01": q01, "q99": q99}
            count[key] = int(x.shape[0])
        return cls(stats, count)

    @property
    def keys(self) -> list[str]:
        return list(self.stats)

    def dim(self, key: str) -> int:
        return int(self._get(key)["mean"].shape[0])

    def _get(self, key: str) -> dict[str, np.ndarray]:
        if key not in self.stats:
            raise MissingStatsError(f"no normalisation statistics for {key!r}; have {list(self.stats)}. "
                                    "Compute them with EpisodeStore.stats() and pass them in.")
        return self.stats[key]

    # ------------------------------------------------------------------ transforms
    def normalize(self, key: str, x, mode: Mode = "mean_std", eps: float = EPS):
        """Normalise ``x`` (numpy or torch, ``(..., D)``); same type and device back, float."""
        s = self._get(key)
        _check_dim(key, x, s["mean"].shape[0])
        return _apply(x, *_scale_centre(s, mode, eps), inverse=False)

    def unnormalize(self, key: str, y, mode: Mode = "mean_std", eps: float = EPS):
        """Inverse of :meth:`normalize` (exact up to float rounding, also for zero-variance dims)."""
        s = self._get(key)
        _check_dim(key, y, s["mean"].shape[0])
        return _apply(y, *_scale_centre(s, mode, eps), inverse=True)

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict:
        """JSON-ready dict ``{key: {stat: [floats]}, "_count": {key: n}}``."""
        d = {k: {n: v.astype(float).tolist() for n, v in s.items()} for k, s in self.stats.items()}
        d["_count"] = dict(self.count)
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> "NormStats":
        d = dict(d)
        count = {k: int(v) for k, v in dict(d.pop("_count", {}) or {}).items()}
        return cls({k: {n: np.asarray(x, dtype=np.float32) for n, x in dict(v).items()} for k, v in d.items()},
                   count)

    def to_tensors(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """Flat ``{f"{prefix}{key}.{stat}": float32 tensor (D,)}`` (safetensors-ready)."""
        return {f"{prefix}{k}.{n}": torch.from_numpy(v.copy()) for k, s in self.stats.items() for n, v in s.items()}

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], prefix: str = "") -> "NormStats":
        stats: dict[str, dict[str, np.ndarray]] = {}
        for name, t in tensors.items():
            if not name.startswith(prefix):
                continue
            key, _, stat = name[len(prefix):].rpartition(".")
            if stat in STAT_NAMES and key:
                stats.setdefault(key, {})[stat] = t.detach().cpu().numpy().astype(np.float32)
        if not stats:
            raise MissingStatsError(f"no normalisation tensors with prefix {prefix!r} in {list(tensors)[:8]}")
        return cls(stats)


def _check_dim(key: str, x, d: int) -> None:
    if tuple(x.shape)[-1:] != (d,):
        raise ValueError(f"{key!r}: last dim of input {tuple(x.shape)} does not match the statistics' dim {d}")


class Normalizer(nn.Module):
    """Normalisation statistics as module buffers, so they are saved in ``model.safetensors``.

    Args:
        dims: key -> ``D`` (e.g. ``{"proprio": 9, "actions": 7}``); buffers start unset.
        mode: ``"mean_std"`` or ``"quantile"`` (see the module docstring).
        stats: optional :class:`NormStats` to set at once.

    ``normalize(key, x)`` / ``unnormalize(key, x)`` take torch tensors ``(..., D)`` and raise
    :class:`MissingStatsError` until :meth:`set_stats` was called or a state dict with statistics was
    loaded.
    """

    def __init__(self, dims: Mapping[str, int], mode: Mode = "mean_std", stats: NormStats | None = None,
                 eps: float = EPS):
        super().__init__()
        if mode not in ("mean_std", "quantile"):
            raise ValueError(f"unknown normalisation mode {mode!r}; use 'mean_std' or 'quantile'")
        self.dims = {str(k): int(v) for k, v in dims.items()}
        self.mode = mode
        self.eps = float(eps)
        for k, d in self.dims.items():
            self.register_buffer(self._b(k, "centre"), torch.zeros(d))
            self.register_buffer(self._b(k, "scale"), torch.ones(d))
        self.register_buffer("has_stats", torch.zeros((), dtype=torch.bool))
        if stats is not None:
            self.set_stats(stats)

    @staticmethod
    def _b(key: str, what: str) -> str:
        return f"{key.replace('.', '_')}_{what}"

    def set_stats(self, stats: NormStats) -> "Normalizer":
        for k, d in self.dims.items():
            if stats.dim(k) != d:
                raise ValueError(f"statistics for {k!r} have dim {stats.dim(k)}, the normalizer expects {d}")
            c, s = _scale_centre(stats.stats[k], self.mode, self.eps)
            getattr(self, self._b(k, "centre")).copy_(torch.from_numpy(c))
            getattr(self, self._b(k, "scale")).copy_(torch.from_numpy(s))
        self.has_stats.fill_(True)
        return self

    def _cs(self, key: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not bool(self.has_stats):
            raise MissingStatsError(
                "this model needs normalisation statistics but none were set; call "
                "set_stats(store.stats()) before training, or load a checkpoint that has them")
        if key not in self.dims:
            raise MissingStatsError(f"no normalisation statistics for {key!r}; have {list(self.dims)}")
        if x.shape[-1] != self.dims[key]:
            raise ValueError(f"{key!r}: last dim of input {tuple(x.shape)} does not match {self.dims[key]}")
        return getattr(self, self._b(key, "centre")).to(x.dtype), getattr(self, self._b(key, "scale")).to(x.dtype)

    def normalize(self, key: str, x: torch.Tensor) -> torch.Tensor:
        c, s = self._cs(key, x)
        return (x - c) / s

    def unnormalize(self, key: str, y: torch.Tensor) -> torch.Tensor:
        c, s = self._cs(key, y)
        return y * s + c
