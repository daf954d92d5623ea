"""Random-number state as checkpoint contents, so a resumed run continues the uninterrupted one bit for bit.

A trainer's randomness lives in several streams: its own ``torch.Generator`` (batches, flow noise),
``numpy.random.Generator`` objects (window sampling, augmentation), and the process-wide torch, numpy
and Python generators that library code may draw from. Re-seeding them on resume (``seed + step``)
gives a run as different from the uninterrupted one as another data seed (issue #25 measured 2.8 %
relative L2 of the final BC weights). :func:`capture_rng` turns every stream into named tensors
(``torch.Generator`` states, ``uint8``) and JSON (numpy bit-generator states, Python's Mersenne
Twister state), the checkpoint formats of :mod:`wmrl.kernel.checkpoint` (no pickle); :func:`restore_rng`
puts them back.

Key names: ``rng/global/torch``, ``rng/global/cuda/<i>``, ``rng/stream/<name>`` in the tensors; the
metadata dict holds ``global_numpy``, ``global_python`` and ``numpy_streams``.
"""

from __future__ import annotations

import random
from typing import Any, Mapping, Union

import numpy as np
import torch

RNGStream = Union[torch.Generator, np.random.Generator]

_PREFIX = "rng/"


def _global_numpy_state() -> dict:
    st = np.random.get_state(legacy=False)
    return {"bit_generator": st["bit_generator"], "key": st["state"]["key"].tolist(), "pos": int(st["state"]["pos"]),
            "has_gauss": int(st["has_gauss"]), "gauss": float(st["gauss"])}


def _set_global_numpy_state(d: Mapping[str, Any]) -> None:
    np.random.set_state({"bit_generator": d["bit_generator"],
                         "state": {"key": np.asarray(d["key"], dtype=np.uint32), "pos": int(d["pos"])},
                         "has_gauss": int(d["has_gauss"]), "gauss": float(d["gauss"])})


def capture_rng(streams: Mapping[str, RNGStream] | None = None,
                include_global: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The state of ``streams`` (and of the process-wide generators) as ``(tensors, meta)``.

    Args:
        streams: named generators of the run: ``torch.Generator`` (CPU or CUDA) or
            ``numpy.random.Generator``; names are free text without ``/``.
        include_global: also capture torch's default CPU (and initialised CUDA) generators, numpy's
            global ``RandomState`` and Python's ``random``.

    Returns:
        ``tensors``: name -> ``uint8`` CPU tensor (for ``extra.safetensors``); ``meta``: a
        JSON-serialisable dict (for ``meta.json``).

    Raises:
        TypeError: a stream that is neither a torch nor a numpy generator.
        ValueError: a stream name containing ``/``.
    """
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, Any] = {"numpy_streams": {}}
    for name, g in (streams or {}).items():
        if "/" in name:
            raise ValueError(f"RNG stream name {name!r} must not contain '/'")
        if isinstance(g, torch.Generator):
            tensors[f"{_PREFIX}stream/{name}"] = g.get_state().clone()
        elif isinstance(g, np.random.Generator):
            meta["numpy_streams"][name] = g.bit_generator.state
        else:
            raise TypeError(f"RNG stream {name!r} is a {type(g).__name__}, not a torch.Generator or numpy Generator")
    if include_global:
        tensors[f"{_PREFIX}global/torch"] = torch.get_rng_state().clone()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            for i, s in enumerate(torch.cuda.get_rng_state_all()):
                tensors[f"{_PREFIX}global/cuda/{i}"] = s.clone()
        meta["global_numpy"] = _global_numpy_state()
        version, internal, gauss = random.getstate()
        meta["global_python"] = [version, list(internal), gauss]
    return tensors, meta


def restore_rng(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any],
                streams: Mapping[str, RNGStream] | None = None) -> list[str]:
    """Put back what :func:`capture_rng` captured, into ``streams`` (the same names) and the
    process-wide generators (when they were captured).

    Returns the names of the streams that had no saved state (left as they are: e.g. a checkpoint
    written before this stream existed); the caller decides whether that is an error.

    Raises:
        ValueError: a saved numpy state of another bit generator than the stream's.
    """
    missing = []
    np_saved = meta.get("numpy_streams", {}) if meta else {}
    for name, g in (streams or {}).items():
        if isinstance(g, torch.Generator):
            key = f"{_PREFIX}stream/{name}"
            if key in tensors:
                g.set_state(tensors[key].to(torch.uint8).cpu())
            else:
                missing.append(name)
        else:
            st = np_saved.get(name)
            if st is None:
                missing.append(name)
                continue
            if st.get("bit_generator") != g.bit_generator.state["bit_generator"]:
                raise ValueError(f"RNG stream {name!r}: saved state is {st.get('bit_generator')}, the stream is "
                                 f"{g.bit_generator.state['bit_generator']}")
            g.bit_generator.state = st
    if f"{_PREFIX}global/torch" in tensors:
        torch.set_rng_state(tensors[f"{_PREFIX}global/torch"].to(torch.uint8).cpu())
    cuda = sorted(k for k in tensors if k.startswith(f"{_PREFIX}global/cuda/"))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensors[k].to(torch.uint8).cpu() for k in cuda])
    if meta and "global_numpy" in meta:
        _set_global_numpy_state(meta["global_numpy"])
    if meta and "global_python" in meta:
        version, internal, gauss = meta["global_python"]
        random.setstate((version, tuple(internal), gauss))
    return missing


def split_rng_tensors(tensors: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(rng tensors, the others)`` of a checkpoint's extra tensors."""
    rng = {k: v for k, v in tensors.items() if k.startswith(_PREFIX)}
    return rng, {k: v for k, v in tensors.items() if not k.startswith(_PREFIX)}
