"""``wmrl doctor``: what this machine has and what wmrl will choose on it, in under 30 s.

    wmrl doctor [estimate=false] [+pipeline.preset=steering] [+pipeline.stages.grpo.iterations=40] [hydra.run.dir=PATH]

Prints, and writes to ``report.json``: the CPU (model, AVX2 / AVX-512 / AVX512_BF16 / AMX), the
precision the defaults will use and why (``wmrl.kernel.precision``; without native bf16 the measured
bf16/fp32 slowdown), the cores, the torch threads ``num_threads=auto`` picks now and why, the
OpenMP wait policy, free memory and disk, the offscreen renderer (``MUJOCO_GL``: whether a frame
renders, and the alternatives tried), the versions of the packages wmrl runs on, the LIBERO
environment if one is set up (``.venv-libero``), and the estimated time of the default
``wmrl pipeline`` here (a calibration of about 10 s, ``wmrl.run.machine``).
"""

from __future__ import annotations

import importlib.metadata as md
import logging
import os
import platform
import shutil
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig

from wmrl.run.common import (
    RunContext,
    available_cores,
    busy_cores_elsewhere,
    resolve_threads,
    run_main,
)

log = logging.getLogger("wmrl.doctor")

PACKAGES = ("torch", "numpy", "lerobot", "mujoco", "robosuite", "diffusers", "zarr", "hydra-core", "grpcio",
            "cyclonedds", "ray")
REPO = Path(__file__).resolve().parents[2]


def _cpu() -> dict:
    import torch

    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and name in ("", platform.machine(), platform.processor()):
                name = line.split(":", 1)[1].strip()
            if line.startswith(("flags", "Features")):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return {"model": name, "arch": platform.machine(), "torch_capability": torch.backends.cpu.get_cpu_capability(),
            **{f: f in flags for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16")}}


def _memory_disk(path: Path) -> dict:
    out: dict = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            k, v = line.split(":", 1)
            if k in ("MemTotal", "MemAvailable"):
                out[k.lower() + "_gib"] = round(int(v.split()[0]) / 2**20, 1)
    except OSError:
        pass
    du = shutil.disk_usage(path)
    out.update(disk_free_gib=round(du.free / 2**30, 1), disk_path=str(path))
    return out


def _renderer() -> dict:
    from sim import render

    t0 = time.perf_counter()
    try:
        render.gl_context()
        return {"ok": True, "backend": render.gl_backend(), "MUJOCO_GL": os.environ.get("MUJOCO_GL"),
                "seconds": round(time.perf_counter() - t0, 2)}
    except RuntimeError as e:
        return {"ok": False, "error": str(e), "MUJOCO_GL": os.environ.get("MUJOCO_GL")}


def _versions() -> dict:
    out = {"python": platform.python_version()}
    for p in PACKAGES:
        try:
            out[p] = md.version(p)
        except md.PackageNotFoundError:
            out[p] = None
    return out


def _libero() -> dict:
    venv = REPO / ".venv-libero"
    if not (venv / "bin" / "python").exists():
        return {"present": False, "path": str(venv)}
    return {"present": True, "path": str(venv)}


def run(cfg: DictConfig, ctx: RunContext) -> dict:
    from wmrl.kernel.precision import measure_bf16_slowdown, resolve_bf16

    t0 = time.perf_counter()
    cpu = _cpu()
    prec = resolve_bf16("auto", "cpu", "defaults")
    print(f"CPU        {cpu['model']} ({cpu['arch']}); torch kernels: {cpu['torch_capability']}; "
          f"AVX2 {cpu['avx2']}, AVX-512 {cpu['avx512f']}, AVX512_BF16 {cpu['avx512_bf16']}, AMX {cpu['amx_bf16']}")
    slow = None
    if not prec.bf16:
        slow = measure_bf16_slowdown("cpu")
    print(f"precision  {prec.dtype} ({prec.reason})" + (f"; bf16 here would run {slow:.1f}x the fp32 time" if slow else ""))
    busy = busy_cores_elsewhere()
    k, why = resolve_threads("auto", busy=busy)
    print(f"threads    {k} ({why}); {available_cores()} core(s) available, {busy:.1f} busy with other processes now; "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}")
    mem = _memory_disk(ctx.out_dir)
    print(f"memory     {mem.get('memavailable_gib')} GiB free of {mem.get('memtotal_gib')} GiB; "
          f"disk {mem['disk_free_gib']} GiB free at {mem['disk_path']}")
    rend = _renderer()
    print("renderer   " + (f"{rend['backend']} works (MUJOCO_GL={rend['MUJOCO_GL'] or 'unset: egl, then osmesa'})" if rend["ok"] else
                            f"NONE: {rend['error']}"))
    ver = _versions()
    print("packages   " + ", ".join(f"{k} {v}" for k, v in ver.items() if v))
    lib = _libero()
    print("LIBERO     " + (f"environment at {lib['path']}" if lib["present"] else f"no environment ({lib['path']} not found)"))
    report = {"cpu": cpu, "precision": prec.as_dict(), "bf16_slowdown": slow,
              "threads": {"auto": k, "reason": why, "busy_cores": busy}, "memory_disk": mem, "renderer": rend,
              "versions": ver, "libero": lib}
    if cfg.get("estimate", True) and rend["ok"]:
        import torch
        from omegaconf import OmegaConf

        from wmrl.run.machine import calibrate, estimate_pipeline, pipeline_suite
        from wmrl.run.stages import apply_preset, compose_stage_config

        torch.set_num_threads(k)
        over = OmegaConf.to_container(cfg.pipeline, resolve=True) if cfg.get("pipeline") else {}
        pcfg = apply_preset(compose_stage_config("pipeline", over))
        suite = pipeline_suite(pcfg)
        est = estimate_pipeline(pcfg, calibrate(pcfg, suite=suite), suite)
        report["pipeline_estimate"] = est
        if est.get("total_s"):
            print(f"pipeline   the default `wmrl pipeline` should take about {est['total_s'] / 60:.1f} min here "
                  f"({', '.join(f'{s} {v:.0f}' for s, v in est['stages'].items())} s)")
        else:
            print(f"pipeline   no estimate: {est.get('why')}")
    elif not rend["ok"]:
        print("pipeline   no estimate: rendering does not work (see renderer)")
    report["doctor_seconds"] = round(time.perf_counter() - t0, 1)
    print(f"(doctor took {report['doctor_seconds']:.1f} s)")
    return report


@hydra.main(version_base="1.3", config_path="pkg://configs", config_name="doctor")
def main(cfg: DictConfig) -> None:
    run_main(cfg, run, "doctor")


if __name__ == "__main__":
    main()
