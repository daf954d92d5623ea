"""Masked reductions shared by every loss (supervised and RL): one ``masked_mean`` with one meaning.

``keep`` masks are bool, True where an entry counts (a valid target, an alive chunk of a valid
group); padded / dead entries are False and enter neither the value nor the gradient.
"""

from __future__ import annotations

import torch


def expand_keep(keep: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``keep`` (bool, shape a prefix of ``like.shape``) reshaped to broadcast against ``like``.

    Raises:
        ValueError: ``keep`` is not bool or its shape is not a prefix of ``like.shape``."""
    keep = torch.as_tensor(keep, device=like.device)
    if keep.dtype != torch.bool:
        raise ValueError(f"mask must be bool (True = keep), got {keep.dtype}")
    if tuple(like.shape[: keep.ndim]) != tuple(keep.shape):
        raise ValueError(f"mask {tuple(keep.shape)} is not a prefix of the value shape {tuple(like.shape)}")
    return keep.reshape(*keep.shape, *([1] * (like.ndim - keep.ndim)))


def masked_mean(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over the entries where ``keep`` is True.

    Args:
        values: float ``(B, ...)``; must be finite where kept.
        keep: bool, the shape of ``values`` or any leading prefix of it (``(B, H)`` for ``(B, H, D)``
            values), True = the entry counts.

    Returns a scalar tensor of ``values.dtype``; ``0`` when nothing is kept. Dropped entries enter
    neither the value nor the gradient, even when they are inf or NaN.
    """
    valid = expand_keep(keep, values)
    v = torch.where(valid, values, torch.zeros((), dtype=values.dtype, device=values.device))
    n = valid.expand_as(values).sum().clamp_min(1)
    return v.sum() / n
