"""Per-round attention kernels and how one is chosen.

Every kernel computes the same thing for one ring round: the queries of this device's chunk
against one arriving K/V block, with the mask from true positions and segment ids.

- ``xla``: ``parallel/blockwise.py`` (fori_loop over tiles, fp32 einsums); right on a CPU.
- ``pallas_gpu``: fused Pallas kernels, Triton backend (``parallel/kernels/pallas_gpu.py``).
- ``pallas_tpu``: fused Pallas kernels, Mosaic backend (``parallel/kernels/pallas_tpu.py``).
- ``auto``: the fused kernel of the devices' platform, ``xla`` on a CPU.

Tile sizes, their defaults and their rules: ``parallel/kernels/tiling.py``.

A Pallas kernel asked for on a platform that is not its own (a CPU in the tests) runs in
Pallas interpret mode: exact, slow. ``STRIPEDJAX_PALLAS_INTERPRET=1`` forces interpret mode
everywhere, ``=0`` never uses it (a GPU host then runs the real kernel in every test).
"""
from __future__ import annotations

import os

from errors import KernelError

KERNELS = ("auto", "xla", "pallas_gpu", "pallas_tpu")
NATIVE_PLATFORM = {"pallas_gpu": "gpu", "pallas_tpu": "tpu"}
AUTO = {"gpu": "pallas_gpu", "cuda": "pallas_gpu", "rocm": "pallas_gpu", "tpu": "pallas_tpu"}


def first_device(mesh):
    devices = getattr(mesh, "devices", None)
    if devices is not None:
        return devices.flat[0]
    import jax
    return jax.devices()[0]


def platform_of(mesh) -> str:
    return first_device(mesh).platform


def resolve(kernel: str, platform: str) -> str:
    """The concrete kernel (``xla | pallas_gpu | pallas_tpu``) for a request on a platform."""
    if kernel not in KERNELS:
        raise KernelError(f"unknown attention kernel {kernel!r}; valid: {', '.join(KERNELS)}")
    if kernel == "auto":
        return AUTO.get(platform, "xla")
    return kernel


def tiles(kernel: str, attention) -> tuple[int | None, int | None]:
    """(block_q, block_kv) asked of a resolved kernel by the ``attention`` config section; None:
    the Pallas kernel's defaults (``tiling.py``: they depend on the shapes and the device)."""
    if kernel == "xla":
        return attention.block_q, attention.block_kv
    return attention.pallas_block_q or None, attention.pallas_block_kv or None


def interpret(kernel: str, platform: str) -> bool:
    """Whether a (resolved) Pallas kernel runs in interpret mode on this platform."""
    if kernel == "xla":
        return False
    forced = os.environ.get("STRIPEDJAX_PALLAS_INTERPRET", "")
    if forced in ("0", "1"):
        return forced == "1"
    native = NATIVE_PLATFORM[kernel]
    return AUTO.get(platform) != kernel and platform != native
