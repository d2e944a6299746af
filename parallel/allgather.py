"""All-gather context parallelism: every device attends its own queries to the whole row.

K/V (only the Hkv heads, with the true positions and segment ids of their tokens) are
all-gathered over the sequence axis; each device folds the N gathered chunks into its
accumulators with the per-round kernel, one chunk at a time (``parallel/rounds.py``), so tiles
are skipped by the one predicate and striped/zigzag still balance the causal work. Nothing waits
for a neighbour between chunks, so a device's time is its own total, not a sum of per-round
maxima. Backward: the fp32 dK/dV of all N chunks are reduce-scattered home (``psum_scatter``;
an all-reduce and a slice on a CPU, see ``ALL_REDUCE_INSTEAD_OF_SCATTER``).
With GQA the gathered K/V are small next to the queries, which is where this wins.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from parallel import kernels
from parallel import rounds
from parallel.kernels import accumulators as ac


# Platforms whose reduce-scatter is an all-reduce and a slice here instead: XLA CPU's
# reduce-scatter across processes (gloo) took ~2 s for 8 MB of dK/dV where the all-reduce
# took milliseconds (scripts/bench_attention.py --impls ring,allgather --processes 2). A
# GPU/TPU keeps the reduce-scatter, which moves half the bytes of an all-reduce.
ALL_REDUCE_INSTEAD_OF_SCATTER = {"cpu"}


def _reduce_scatter(x, ring, chunk):
    """Each device's chunk of the sum over devices of ``x [B, K, N*C, D]`` (fp32 dK/dV)."""
    if kernels.platform_of(ring.mesh) in ALL_REDUCE_INSTEAD_OF_SCATTER:
        i = lax.axis_index(ring.axis)
        return lax.dynamic_slice_in_dim(lax.psum(x, ring.axis), i * chunk, chunk, 2)
    return lax.psum_scatter(x, ring.axis, scatter_dimension=2, tiled=True)


def _gather(x, ring, axis):
    if x is None or ring.size == 1:
        return x
    return lax.all_gather(x, ring.axis, axis=axis, tiled=True)


def _gathered_kv(k_BCKD, v_BCKD, pos_BC, seg_BC, ring):
    return ac.KV(_gather(ac.to_kv_major(k_BCKD), ring, 2), _gather(ac.to_kv_major(v_BCKD), ring, 2),
                 _gather(pos_BC, ring, 1), _gather(seg_BC, ring, 1))


def forward_local(ring):
    def local(q_BCHD, k_BCKD, v_BCKD, pos_BC, seg_BC):
        fwd = rounds.Rounds(ring, q_BCHD, pos_BC, seg_BC, k_BCKD.shape[2], q_BCHD.shape[1])
        kv = _gathered_kv(k_BCKD, v_BCKD, pos_BC, seg_BC, ring)
        return fwd.finish(fwd.attend(kv, fwd.init()))
    return local


def backward_local(ring):
    def local(q_BCHD, k_BCKD, v_BCKD, pos_BC, seg_BC, out_BCHD, lse_BKCG, dout_BCHD):
        delta = jnp.sum(dout_BCHD.astype(jnp.float32) * out_BCHD.astype(jnp.float32), axis=-1)
        bwd = rounds.Rounds(ring, q_BCHD, pos_BC, seg_BC, k_BCKD.shape[2], q_BCHD.shape[1],
                            lse_BKCG, dout_BCHD, delta)
        kv = _gathered_kv(k_BCKD, v_BCKD, pos_BC, seg_BC, ring)
        dq, dk, dv = bwd.grads(kv, bwd.zeros_dq())
        if ring.size > 1:
            dk, dv = (_reduce_scatter(x, ring, k_BCKD.shape[1]) for x in (dk, dv))
        return (bwd.finish_dq(dq), ac.from_kv_major(dk).astype(k_BCKD.dtype),
                ac.from_kv_major(dv).astype(v_BCKD.dtype))
    return local
