"""Per-round attention kernels and how one is chosen.

Every kernel computes the same thing for one ring round: the queries of this device's chunk
against one arriving K/V block, with the mask from true positions and segment ids.

- ``xla``: ``parallel/blockwise.py`` (fori_loop over tiles, fp32 einsums); right on a CPU.
- ``pallas_gpu``: fused Pallas kernels, Triton backend (``parallel/kernels/pallas_gpu.py``).
- ``pallas_tpu``: fused Pallas kernels, Mosaic backend (``parallel/kernels/pallas_tpu.py``).
- ``auto``: the fused kernel of the devices' platform, ``xla`` on a CPU.

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

# Default tiles: (q rows, kv positions). GQA folds the query heads of one kv head into the rows
# of a q tile, so a Pallas q tile of R rows covers R / G positions. Triton keeps a tile in
# registers and wants small ones; Mosaic streams large tiles through VMEM.
DEFAULT_BLOCKS = {"xla": (512, 512), "pallas_gpu": (64, 64), "pallas_tpu": (512, 512)}


def platform_of(mesh) -> str:
    devices = getattr(mesh, "devices", None)
    if devices is not None:
        return devices.flat[0].platform
    import jax
    return jax.devices()[0].platform


def resolve(kernel: str, platform: str) -> str:
    """The concrete kernel (``xla | pallas_gpu | pallas_tpu``) for a request on a platform."""
    if kernel not in KERNELS:
        raise KernelError(f"unknown attention kernel {kernel!r}; valid: {', '.join(KERNELS)}")
    if kernel == "auto":
        return AUTO.get(platform, "xla")
    return kernel


def default_tiles(kernel: str, group: int = 1) -> tuple[int, int]:
    """(block_q, block_kv) in positions for a resolved kernel and ``group`` query heads per kv head."""
    rows, kv = DEFAULT_BLOCKS[kernel]
    return (rows if kernel == "xla" else max(1, rows // group)), kv


def tiles(kernel: str, attention, group: int = 1) -> tuple[int, int]:
    """(block_q, block_kv) a resolved kernel uses, from the ``attention`` config section."""
    if kernel == "xla":
        return attention.block_q, attention.block_kv
    default_q, default_kv = default_tiles(kernel, group)
    return attention.pallas_block_q or default_q, attention.pallas_block_kv or default_kv


def interpret(kernel: str, platform: str) -> bool:
    """Whether a (resolved) Pallas kernel runs in interpret mode on this platform."""
    if kernel == "xla":
        return False
    forced = os.environ.get("STRIPEDJAX_PALLAS_INTERPRET", "")
    if forced in ("0", "1"):
        return forced == "1"
    native = NATIVE_PLATFORM[kernel]
    return AUTO.get(platform) != kernel and platform != native
