"""Per-round attention kernels: the registry, and how one is chosen.

Every kernel computes the same thing for one ring round: a chunk of queries against one
arriving K/V block, with the mask from true positions and segment ids, read by the one tile
predicate (``predicate.py``), folded into the fp32 accumulators of ``accumulators.py``.

- ``xla``: ``xla.py`` (fori_loop over tiles, fp32 einsums); right on a CPU.
- ``pallas_gpu``: fused Pallas kernels, Triton backend (``pallas_gpu.py``).
- ``pallas_tpu``: fused Pallas kernels, Mosaic backend (``pallas_tpu.py``).
- ``cudnn``: cuDNN's flash attention per round, each round's mask chosen at run time from its
  positions; a round it cannot express runs ``pallas_gpu`` (``cudnn.py``). On a CPU a dense
  stand-in runs behind the same contract (like interpret mode).
- ``auto``: the fused kernel of the devices' platform, ``xla`` on a CPU.

The interface a strategy calls (its chunk-pair loop, ``Rounds``), per kernel module
(:func:`rounds`), all functions of a ``spec.RoundSpec``:

- ``queries(spec, q [B, S, Hq, D], pos, seg)``: the queries in the kernel's form;
- ``attend(spec, queries, kv: KV, acc: Acc) -> Acc``: fold one K/V block in;
- ``grad_queries(spec, q, pos, seg, do [B, K, S, G, D], lse, delta)``: the backward's form;
- ``attend_grads(spec, grad_queries, kv, dq) -> (dq, dk, dv)``: dq accumulated (unscaled),
  this block's fp32 dk/dv;
- ``ANY_CHUNKS``: whether one call may hold several chunks of queries or keys (else the
  strategy calls it chunk pair by chunk pair).

``xla`` implements it itself. A fused kernel implements ``forward``/``backward_dq``/
``backward_dkv`` over visit tables (``tables.py``) and ``fused.py`` turns it into the interface.
Each module also holds its tile rules: ``default_tiles`` and, optionally, ``check_tile`` (the
one-line error for a tile its real kernel cannot run); ``tiling.py`` fits and checks through
them. A new kernel is one file plus one :data:`REGISTRY` entry.

A Pallas kernel asked for on a platform that is not its own (a CPU in the tests) runs in
Pallas interpret mode: exact, slow. ``STRIPEDJAX_PALLAS_INTERPRET=1`` forces interpret mode
everywhere, ``=0`` never uses it (a GPU host then runs the real kernel in every test).
"""
from __future__ import annotations

import dataclasses
import importlib
import os

from errors import KernelError


@dataclasses.dataclass(frozen=True)
class Kernel:
    platform: str | None  # where it runs natively (None: everywhere, never interpreted)
    fused: bool  # a fused Pallas kernel over visit tables, driven through ``fused.py``


# name -> entry; the module is ``parallel/kernels/<name>.py``
REGISTRY = {
    "xla": Kernel(platform=None, fused=False),
    "pallas_gpu": Kernel(platform="gpu", fused=True),
    "pallas_tpu": Kernel(platform="tpu", fused=True),
    "cudnn": Kernel(platform="gpu", fused=False),
}
KERNELS = ("auto", *REGISTRY)
NATIVE_PLATFORM = {name: k.platform for name, k in REGISTRY.items() if k.platform}
AUTO = {"gpu": "pallas_gpu", "cuda": "pallas_gpu", "rocm": "pallas_gpu", "tpu": "pallas_tpu"}


def module(kernel: str):
    """The module of a resolved kernel (``parallel/kernels/<kernel>.py``), imported on demand."""
    return importlib.import_module(f"{__name__}.{kernel}")


def rounds(kernel: str):
    """The per-round interface of a resolved kernel (see the module docstring)."""
    return module("fused") if REGISTRY[kernel].fused else module(kernel)


def first_device(mesh):
    devices = getattr(mesh, "devices", None)
    if devices is not None:
        return devices.flat[0]
    import jax
    return jax.devices()[0]


def platform_of(mesh) -> str:
    return first_device(mesh).platform


def resolve(kernel: str, platform: str, dtype=None, head_dim=None) -> str:
    """The concrete kernel (a :data:`REGISTRY` name) for a request on a platform. ``auto`` on a
    GPU with activations cuDNN runs (``dtype`` bf16/fp16, ``head_dim``) picks ``cudnn`` where
    its one-time probe passes (:func:`auto_reason` says why either way), else the platform's
    fused kernel."""
    if kernel == "auto":
        if (AUTO.get(platform) == "pallas_gpu" and _cudnn_fits(dtype, head_dim)
                and _cudnn_probe()[0]):
            return "cudnn"
        return AUTO.get(platform, "xla")
    if kernel not in REGISTRY:  # not KERNELS: it misses entries added later
        raise KernelError(f"unknown attention kernel {kernel!r}; "
                          f"valid: {', '.join(('auto', *REGISTRY))}")
    return kernel


def _cudnn_fits(dtype, head_dim=None) -> bool:
    return dtype is not None and module("cudnn").fits(dtype, head_dim)


def _cudnn_probe():
    return module("cudnn").probe()


def auto_reason(platform: str, dtype=None, head_dim=None) -> str:
    """Why ``auto`` resolved as it did on this platform (for the startup line)."""
    if AUTO.get(platform) != "pallas_gpu":
        return f"the {platform} default"
    if not _cudnn_fits(dtype, head_dim):
        return (f"cudnn needs bf16/fp16 activations and a head dim a multiple of 8 up to 128, "
                f"these are {dtype} with head dim {head_dim}")
    return _cudnn_probe()[1]


def tiles(kernel: str, attention) -> tuple[int | None, int | None]:
    """(block_q, block_kv) asked of a resolved kernel by the ``attention`` config section; None:
    the kernel's defaults (its module's ``default_tiles``: they depend on the shapes and the
    device)."""
    if kernel == "xla":
        return attention.block_q, attention.block_kv
    return attention.pallas_block_q or None, attention.pallas_block_kv or None


def interpret(kernel: str, platform: str) -> bool:
    """Whether a (resolved) Pallas kernel runs in interpret mode on this platform."""
    native = REGISTRY[kernel].platform
    if native is None:
        return False
    forced = os.environ.get("STRIPEDJAX_PALLAS_INTERPRET", "")
    if forced in ("0", "1"):
        return forced == "1"
    return AUTO.get(platform) != kernel and platform != native
