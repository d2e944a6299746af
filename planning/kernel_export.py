"""One ring round of the fused kernels, built the way training builds it, for export.

``tiling.plan`` -> ``RoundSpec`` -> ``fused.attend`` (forward) and ``fused.grads`` (dQ, dK/dV):
the compile reports (``gpu_kernels.py``, ``tpu_kernels.py``) lower exactly what the ring runs.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from parallel.kernels import accumulators as ac
from parallel.kernels import fused, tiling
from parallel.kernels.spec import RoundSpec, Tile

KERNELS = {"ring_round_fwd": "fwd", "ring_round_dq": "dq", "ring_round_dkv": "dkv"}


class Case(NamedTuple):
    kernel: str  # pallas_gpu | pallas_tpu
    head_dim: int
    group: int
    dtype: str  # bfloat16 | float16 | float32
    has_seg: bool
    tiles: tuple[Tile, Tile, Tile]  # forward, dQ, dK/dV
    window: int = 0  # model.sliding_window: its band adds a compare to the masked tiles


def default_case(kernel, head_dim, group, dtype, has_seg, chunk, arch="sm_90") -> Case:
    tiles = tiling.plan(kernel, None, None, group=group, head_dim=head_dim, dtype=dtype,
                        chunk=chunk, seq_len=chunk, shards=1, interpret=False, arch=arch)
    return Case(kernel, head_dim, group, dtype, has_seg, tiles)


def spec(case: Case) -> RoundSpec:
    return RoundSpec(case.kernel, *case.tiles, case.group, 1, case.head_dim,
                     1 / math.sqrt(case.head_dim), True, case.has_seg, False, case.window)


def round_fn(case: Case):
    """``(q, k, v, do, pos, seg) -> (dq, dk, dv)``: one diagonal round, forward then backward,
    ``q/do [1, C, G, D]``, ``k/v [1, C, 1, D]``, ``pos/seg [1, C]`` (one kv head)."""
    s = spec(case)

    def f(q, k, v, do, pos, seg):
        seg = seg if case.has_seg else None
        query = fused.prepare(q, pos, seg, s)
        kv = ac.KV(ac.to_kv_major(k), ac.to_kv_major(v), pos, seg)
        acc = fused.attend(s, query, kv, ac.init_acc(ac.to_q_major(q, 1).astype(jnp.float32)))
        out, lse = ac.finalize(acc)
        do_q = ac.to_q_major(do, 1)
        delta = jnp.sum(do_q.astype(jnp.float32) * out, -1)
        return fused.grads(s, query, kv, fused.fold_rows(do_q), fused.fold_rows(lse),
                           fused.fold_rows(delta), jnp.zeros(out.shape, jnp.float32))
    return f


def arg_shapes(case: Case, chunk):
    sds = jax.ShapeDtypeStruct
    q = sds((1, chunk, case.group, case.head_dim), jnp.dtype(case.dtype))
    k = sds((1, chunk, 1, case.head_dim), jnp.dtype(case.dtype))
    pos = sds((1, chunk), jnp.int32)
    return q, k, k, q, pos, pos
