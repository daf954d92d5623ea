"""Precision that fits the hardware: bfloat16 autocast only where the machine runs it fast.

Every model that can run under bf16 autocast (the BC policy's training, the world model in
training and imagination) takes a setting ``bf16`` in ``{"auto", True, False}``:

* ``"auto"`` (the default everywhere): bf16 autocast on a CUDA device that supports bf16, or on a
  CPU that PyTorch reports with native bf16 instructions (x86 AVX512_BF16 or AMX), otherwise fp32.
  On a CPU without them PyTorch falls back to reference kernels that were measured 12x slower than
  fp32 (AMD Zen 3, ``wmrl bench policy``: a BC step of 2342 ms in bf16 against 197 ms in fp32).
* ``True``: bf16 autocast wherever it runs; on hardware without native bf16 it warns once per
  process with the slowdown measured there and then (:func:`measure_bf16_slowdown`).
* ``False``: fp32.

The override ``WMRL_NATIVE_BF16=0|1`` replaces the CPU/GPU capability report (for checks of the
fp32 path on a machine that has bf16, and for a CPU whose capability PyTorch misreports).

:func:`resolve_bf16` returns a :class:`Precision` whose ``as_dict()`` goes into every report:
``{"dtype": "bf16"|"fp32", "setting": "auto"|"true"|"false", "device": "cpu"|"cuda", "reason": ...}``.
Weights, optimizer state and EMA stay fp32 in every mode; only the forward pass is autocast.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import platform
import time
from typing import Any

log = logging.getLogger("wmrl.kernel.precision")

ENV_OVERRIDE = "WMRL_NATIVE_BF16"
_WARNED: set[str] = set()


@dataclasses.dataclass(frozen=True)
class Precision:
    """The resolved precision of one model on one device.

    Attributes:
        dtype: ``"bf16"`` (bfloat16 autocast of the forward pass) or ``"fp32"``.
        setting: the user's setting, normalised: ``"auto"``, ``"true"`` or ``"false"``.
        device: device type, ``"cpu"`` or ``"cuda"``.
        reason: one line saying why this dtype was chosen.
    """

    dtype: str
    setting: str
    device: str
    reason: str

    @property
    def bf16(self) -> bool:
        return self.dtype == "bf16"

    def autocast(self):
        """``torch.autocast`` for this precision (a no-op context in fp32)."""
        import torch

        if not self.bf16:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device, dtype=torch.bfloat16)

    def as_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)

    @classmethod
    def fixed_fp32(cls, device: Any, reason: str) -> "Precision":
        """The record of a model that always runs in fp32 (setting ``"none"``)."""
        return cls("fp32", "none", _device_type(device), reason)


def normalise_setting(setting: Any) -> str:
    """``"auto"``, ``"true"`` or ``"false"`` from a bool, ``None`` (auto) or a string.

    Raises:
        ValueError: for anything else, naming the accepted values.
    """
    if setting is None:
        return "auto"
    if isinstance(setting, bool):
        return "true" if setting else "false"
    s = str(setting).strip().lower()
    if s in ("auto", "true", "false"):
        return s
    raise ValueError(f"bf16 must be auto, true or false, got {setting!r}")


def _device_type(device: Any) -> str:
    s = str(getattr(device, "type", device) or "cpu")
    return s.split(":")[0]


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def native_bf16(device: Any = "cpu") -> tuple[bool, str]:
    """Whether ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:N"`` or a ``torch.device``) runs bf16
    natively, and the evidence, as ``(bool, reason)``.

    CPU: ``torch.cpu._is_avx512_bf16_supported()`` / ``torch.cpu._is_amx_tile_supported()`` (what
    PyTorch's own kernels dispatch on), else the ``avx512_bf16`` / ``amx_bf16`` / ``bf16`` flags of
    ``/proc/cpuinfo`` where that API is missing. CUDA: ``torch.cuda.is_bf16_supported()``.
    ``WMRL_NATIVE_BF16=0|1`` overrides both.
    """
    override = os.environ.get(ENV_OVERRIDE)
    if override is not None and override.strip() != "":
        if override.strip() not in ("0", "1"):
            raise ValueError(f"{ENV_OVERRIDE} must be 0 or 1, got {override!r}")
        on = override.strip() == "1"
        return on, f"{ENV_OVERRIDE}={override.strip()} overrides the capability report"
    import torch

    dev = _device_type(device)
    if dev == "cuda":
        if not torch.cuda.is_available():
            return False, "CUDA is not available"
        ok = bool(torch.cuda.is_bf16_supported())
        name = torch.cuda.get_device_name()
        return ok, f"{name} {'supports' if ok else 'does not support'} bf16 (torch.cuda.is_bf16_supported)"
    if dev != "cpu":
        return False, f"device type {dev!r}: no bf16 capability check, fp32 is the safe choice"
    cpu = getattr(torch, "cpu", None)
    avx512_bf16 = getattr(cpu, "_is_avx512_bf16_supported", None)
    amx = getattr(cpu, "_is_amx_tile_supported", None)
    if callable(avx512_bf16):
        if avx512_bf16():
            return True, "the CPU has AVX512_BF16 (torch.cpu._is_avx512_bf16_supported)"
        if callable(amx) and amx():
            return True, "the CPU has AMX (torch.cpu._is_amx_tile_supported)"
        if platform.machine().lower() in ("x86_64", "amd64", "i686", "x86"):
            return False, ("the CPU has no AVX512_BF16 or AMX (torch.cpu._is_avx512_bf16_supported): "
                           "bf16 would run on slow reference kernels")
    flags = _cpu_flags()
    for flag in ("avx512_bf16", "amx_bf16", "bf16"):
        if flag in flags:
            return True, f"the CPU reports the {flag!r} flag (/proc/cpuinfo)"
    return False, "the CPU reports no native bf16 instructions: bf16 would run on slow reference kernels"


def measure_bf16_slowdown(device: Any = "cpu", size: int = 256, reps: int = 5) -> float:
    """Time of a linear layer's forward + backward (``size`` x ``size``, batch ``size``) under bf16
    autocast divided by its fp32 time, median of ``reps`` each, measured now (about 0.1-1 s)."""
    import torch

    dev = _device_type(device)
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(size, size).to(device)
    x = torch.randn(size, size, generator=g).to(device)

    def once(bf16: bool) -> float:
        t0 = time.perf_counter()
        with torch.autocast(device_type=dev, dtype=torch.bfloat16, enabled=bf16):
            y = lin(x).square().mean()
        y.backward()
        if dev == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    times = {True: [], False: []}
    for _ in range(reps + 1):  # the first pair warms up
        for mode in (False, True):
            times[mode].append(once(mode))
    med = {m: sorted(v[1:])[len(v[1:]) // 2] for m, v in times.items()}
    return med[True] / max(med[False], 1e-9)


def resolve_bf16(setting: Any = "auto", device: Any = "cpu", what: str = "model") -> Precision:
    """The precision for ``what`` (a name for messages, e.g. ``"BC"``) on ``device``.

    Args:
        setting: ``"auto"`` / ``None``, ``True`` / ``"true"``, ``False`` / ``"false"``.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or a ``torch.device``.
        what: the model's name, used in the warning and the reason.

    Returns:
        :class:`Precision`. An explicit ``True`` on hardware without native bf16 logs one warning per
        process and device type, with the slowdown measured by :func:`measure_bf16_slowdown`.

    Raises:
        ValueError: a setting other than auto / true / false, or a bad ``WMRL_NATIVE_BF16``.
    """
    s = normalise_setting(setting)
    dev = _device_type(device)
    if s == "false":
        return Precision("fp32", s, dev, f"{what}: bf16=false")
    native, why = native_bf16(device)
    if s == "auto":
        return Precision("bf16" if native else "fp32", s, dev, f"{what}: bf16=auto and {why}")
    if not native and dev not in _WARNED:
        _WARNED.add(dev)
        try:
            cost = f"{measure_bf16_slowdown(device):.1f}x"
        except Exception as e:  # the measurement is advice; never fail a run over it
            cost = f"unmeasured ({type(e).__name__})"
        log.warning("bf16=true on hardware without native bf16 (%s): a bf16 matmul runs %s the fp32 time "
                    "here; set bf16=auto (or false) to run in fp32", why, cost)
    return Precision("bf16", s, dev, f"{what}: bf16=true" + ("" if native else f", although {why}"))
