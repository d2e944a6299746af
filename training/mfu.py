"""Peak FLOP/s per device, for MFU: a table of common accelerators, overridable in the config."""
from __future__ import annotations

import os

import jax

# Dense bf16 peak TFLOP/s per device (no sparsity), from the vendors' data sheets.
PEAK_TFLOPS = {
    "h200": 989.0, "h100": 989.0, "a100": 312.0, "l40s": 362.0, "a10": 125.0,
    "tpu v4": 275.0, "tpu v5 lite": 197.0, "tpu v5e": 197.0, "tpu v5p": 459.0, "tpu v6": 918.0,
}
# A CPU core with two AVX2 FMA units: 2 x 8 fp32 lanes x 2 flops x ~2.5 GHz.
CPU_CORE_TFLOPS = 0.08


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
    kind = devices[0].device_kind.lower()
    for name, tflops in PEAK_TFLOPS.items():
        if name in kind:
            return tflops * 1e12 * len(devices)
    raise ValueError(f"unknown device kind {devices[0].device_kind!r} for MFU; set "
                     f"train.peak_tflops to its per-device bf16 peak")
