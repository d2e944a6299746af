"""Peak dense bf16 FLOP/s per accelerator: the one table behind both the trainer's MFU
(training/mfu.py) and the planner's step-time bound (planning/hardware.py, which adds memory and
link bandwidths).

Like errors.py it sits below every layer and imports nothing of the project and no jax, so the
planner can read it before it simulates devices and the trainer without importing the planner.
"""
from __future__ import annotations

# Dense bf16 peak TFLOP/s per device (no sparsity), from the vendors' data sheets. Keys are
# lower-case substrings of jax's ``device_kind`` ("NVIDIA H100 80GB HBM3", "TPU v5 lite"),
# tried in this order. H200 is the H100 die with more HBM; TPU v5 lite is v5e.
PEAK_TFLOPS = {
    "h200": 989.0, "h100": 989.0, "a100": 312.0, "l40s": 362.0, "a10": 125.0,
    "tpu v4": 275.0, "tpu v5 lite": 197.0, "tpu v5e": 197.0, "tpu v5p": 459.0, "tpu v6": 918.0,
}
# A CPU core with two AVX2 FMA units: 2 x 8 fp32 lanes x 2 flops x ~2.5 GHz.
CPU_CORE_TFLOPS = 0.08


def peak_tflops(device_kind: str) -> float | None:
    """Per-device peak TFLOP/s of a jax ``device_kind``, or None when the table lacks it."""
    kind = device_kind.lower()
    for name, tflops in PEAK_TFLOPS.items():
        if name in kind:
            return tflops
    return None
