"""Peak FLOP/s of the mesh, for MFU: from the accelerators table (accelerators.py), overridable
in the config."""
from __future__ import annotations

import os

import jax

from accelerators import CPU_CORE_TFLOPS, peak_tflops


def peak_flops_total(devices=None, override_tflops: float = 0.0) -> float:
    """Peak FLOP/s of the whole mesh. Simulated CPU devices share the host's cores, so the CPU
    peak counts cores, not devices."""
    devices = jax.devices() if devices is None else devices
    if devices[0].platform == "cpu":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        per_process = (override_tflops or CPU_CORE_TFLOPS * cores) * 1e12
        return per_process * jax.process_count()
    if override_tflops:
        return override_tflops * 1e12 * len(devices)
    tflops = peak_tflops(devices[0].device_kind)
    if tflops is not None:
        return tflops * 1e12 * len(devices)
    raise ValueError(f"unknown device kind {devices[0].device_kind!r} for MFU; set "
                     f"train.peak_tflops to its per-device bf16 peak")
