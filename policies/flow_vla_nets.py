"""Networks of ``policies.flow_vla.FlowVLAPolicy``: FiLM, the per-camera image encoders (conv stack
or a torchvision backbone), the sinusoidal time embedding, the residual velocity head and the DrQ
random-shift augmentation. Shapes in each docstring; see ``policies/flow_vla.py`` for the
architecture diagram.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

# ----------------------------------------------------------------------------- building blocks

class FiLM(nn.Module):
    """``x * (1 + gamma(c)) + beta(c)``, gamma/beta initialised to zero (identity at start)."""

    def __init__(self, cond_dim: int, channels: int):
        super().__init__()
        self.proj = nn.Linear(cond_dim, 2 * channels)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        g, b = self.proj(c).chunk(2, dim=-1)
        shape = (x.shape[0], -1) + (1,) * (x.ndim - 2)
        return x * (1 + g.reshape(shape)) + b.reshape(shape)


def _groups(c: int) -> int:
    for g in (8, 4, 2, 1):
        if c % g == 0:
            return g
    return 1


class ConvEncoder(nn.Module):
    """Conv stack (stride 2 per block) with GroupNorm, FiLM by the instruction, SiLU; flatten + Linear.

    Input ``float32 (B, 3, Hi, Wi)`` in [-1, 1]; output ``(B, out_dim)``.
    """

    def __init__(self, image_size: Sequence[int], channels: Sequence[int], out_dim: int, film_dim: int):
        super().__init__()
        self.convs, self.norms, self.films = nn.ModuleList(), nn.ModuleList(), nn.ModuleList()
        cin = 3
        for c in channels:
            self.convs.append(nn.Conv2d(cin, c, 3, stride=2, padding=1))
            self.norms.append(nn.GroupNorm(_groups(c), c))
            self.films.append(FiLM(film_dim, c))
            cin = c
        h, w = int(image_size[0]), int(image_size[1])
        for _ in channels:
            h, w = (h + 1) // 2, (w + 1) // 2
        self.out = nn.Sequential(nn.Flatten(), nn.Linear(cin * h * w, out_dim), nn.LayerNorm(out_dim))

    def forward(self, x: torch.Tensor, lang: torch.Tensor) -> torch.Tensor:
        for conv, norm, film in zip(self.convs, self.norms, self.films):
            x = F.silu(film(norm(conv(x)), lang))
        return self.out(x)


class TorchvisionEncoder(nn.Module):
    """A torchvision classification backbone (``fc`` removed) + FiLM on its pooled features.

    ``weights``: path to a local ``.safetensors`` state dict of the backbone (e.g. ImageNet
    ``resnet18``), or ``None`` for random init. Nothing is downloaded.
    """

    def __init__(self, name: str, out_dim: int, film_dim: int, weights: str | None = None):
        super().__init__()
        import torchvision

        if not hasattr(torchvision.models, name):
            raise ValueError(f"unknown torchvision backbone {name!r} (e.g. resnet18)")
        net = getattr(torchvision.models, name)(weights=None)
        if weights:
            from safetensors.torch import load_file

            missing, unexpected = net.load_state_dict(load_file(str(weights)), strict=False)
            if [k for k in missing if not k.startswith("fc.")]:
                raise ValueError(f"backbone weights {weights} miss keys {missing[:5]}...")
        feat = net.fc.in_features
        net.fc = nn.Identity()
        self.net = net
        self.film = FiLM(film_dim, feat)
        self.out = nn.Sequential(nn.Linear(feat, out_dim), nn.LayerNorm(out_dim))

    def forward(self, x: torch.Tensor, lang: torch.Tensor) -> torch.Tensor:
        return self.out(F.silu(self.film(self.net(x), lang)))


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding of ``t`` ``(B,)`` in [0, 1] -> ``(B, dim)`` (scaled by 1000 like DDPM)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    ang = (t.float() * 1000.0)[:, None] * freqs[None]
    return torch.cat([torch.sin(ang), torch.cos(ang)], dim=-1)


class ResBlock(nn.Module):
    def __init__(self, width: int, cond_dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.film = FiLM(cond_dim, width)
        self.fc1 = nn.Linear(width, width * 2)
        self.fc2 = nn.Linear(width * 2, width)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        h = self.film(self.norm(x), c)
        return x + self.fc2(F.silu(self.fc1(h)))


class VelocityHead(nn.Module):
    """Residual MLP over the flattened chunk: ``(x_t (B,H,D_a), t (B,), cond (B,C)) -> v (B,H,D_a)``."""

    def __init__(self, chunk_size: int, action_dim: int, cond_dim: int, width: int, depth: int, time_dim: int):
        super().__init__()
        self.h, self.d, self.time_dim = chunk_size, action_dim, time_dim
        self.inp = nn.Linear(chunk_size * action_dim, width)
        self.time_mlp = nn.Sequential(nn.Linear(time_dim, cond_dim), nn.SiLU(), nn.Linear(cond_dim, cond_dim))
        self.blocks = nn.ModuleList([ResBlock(width, cond_dim) for _ in range(depth)])
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, chunk_size * action_dim)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, x: torch.Tensor, t: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        c = F.silu(cond + self.time_mlp(timestep_embedding(t, self.time_dim)))
        h = self.inp(x.flatten(1))
        for blk in self.blocks:
            h = blk(h, c)
        return self.out(self.norm(h)).view(x.shape[0], self.h, self.d)


def random_shift(x: torch.Tensor, pad: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """DrQ random shift: replicate-pad by ``pad`` px and crop back at a random integer offset per image."""
    if pad <= 0:
        return x
    b, c, h, w = x.shape
    xp = F.pad(x, (pad, pad, pad, pad), mode="replicate")
    ox = torch.randint(0, 2 * pad + 1, (b,), generator=generator, device=x.device)
    oy = torch.randint(0, 2 * pad + 1, (b,), generator=generator, device=x.device)
    rows = (oy[:, None] + torch.arange(h, device=x.device)[None])  # (B, h)
    cols = (ox[:, None] + torch.arange(w, device=x.device)[None])  # (B, w)
    idx_r = rows[:, None, :, None].expand(b, c, h, w + 2 * pad)
    xp = torch.gather(xp, 2, idx_r)
    idx_c = cols[:, None, None, :].expand(b, c, h, w)
    return torch.gather(xp, 3, idx_c)
