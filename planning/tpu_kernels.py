"""The fused TPU (Mosaic) kernels lowered for a TPU on a machine with none, and the VMEM
their blocks need.

``jax.export(..., platforms=["tpu"])`` runs Mosaic's lowering rules on one ring round
(``kernel_export.py``); Mosaic's own layout passes run later, in the TPU compiler, and are not
checked here. VMEM per kernel comes from its BlockSpecs: every input and output block twice
(the pipeline double-buffers them) plus the scratch accumulators, each padded to Mosaic's
(8 x packing, 128) tiles. Values the compiler keeps in VMEM on top (the ``[rows, block_kv]``
fp32 score tile and its relatives) are not in it; ``score_tile`` gives that tile's size.
"""
from __future__ import annotations

import math

import jax
from jax import export
from jax.extend import core as jax_core

from planning import kernel_export as kx
from planning.gpu_kernels import CompileError, _one_line

MiB = 1 << 20
# Scoped VMEM a kernel gets by default (XLA's --xla_tpu_scoped_vmem_limit_kib), bytes.
SCOPED_VMEM = {"v5e": 16 * MiB, "v5p": 16 * MiB, "v6e": 32 * MiB}


def _padded_bytes(shape, dtype) -> int:
    """Bytes of a VMEM buffer: the last dim padded to 128 lanes, the one before to 8 sublanes
    of 32 bits (16 rows of bf16)."""
    shape = (1, 1, *shape)
    itemsize = jax.numpy.dtype(dtype).itemsize
    sublanes = 8 * max(1, 4 // itemsize)
    rows = -(-shape[-2] // sublanes) * sublanes
    lanes = -(-shape[-1] // 128) * 128
    return math.prod(shape[:-2]) * rows * lanes * itemsize


def _pallas_calls(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield eqn
        for sub in jax_core.jaxprs_in_params(eqn.params):
            yield from _pallas_calls(sub)


def vmem(case: kx.Case, chunk: int) -> dict[str, dict]:
    """``{fwd|dq|dkv: {blocks, scratch, vmem, score_tile}}`` in bytes."""
    closed = jax.make_jaxpr(kx.round_fn(case))(*kx.arg_shapes(case, chunk))
    out = {}
    for eqn in _pallas_calls(closed.jaxpr):
        gm = eqn.params["grid_mapping"]
        blocks = sum(2 * _padded_bytes(bm.transformed_block_aval.shape, bm.array_aval.dtype)
                     for bm in gm.block_mappings)
        scratch_vars = eqn.params["jaxpr"].invars[gm.slice_scratch_ops]
        scratch = sum(_padded_bytes(v.aval.shape, v.aval.dtype) for v in scratch_vars)
        name = kx.KERNELS[eqn.params["name"]]
        tile = case.tiles[list(kx.KERNELS.values()).index(name)]
        out[name] = {"blocks": blocks, "scratch": scratch, "vmem": blocks + scratch,
                     "score_tile": tile.block_q * case.group * tile.block_kv * 4}
    return out


def lower(case: kx.Case, chunk: int) -> None:
    """Mosaic's lowering of the round for a TPU (CompileError, one line, if it fails)."""
    from jax._src.pallas.mosaic import tpu_info
    # A CPU has no TPU to describe the chip: lower as for v5e.
    tpu_info.registry.setdefault(jax.devices()[0].device_kind, lambda: tpu_info.get_tpu_info_for_chip(
        tpu_info.ChipVersion.TPU_V5E, 1))
    try:
        export.export(jax.jit(kx.round_fn(case)), platforms=["tpu"])(*kx.arg_shapes(case, chunk))
    except Exception as e:
        raise CompileError(f"Mosaic lowering failed: {_one_line(e)}") from None
