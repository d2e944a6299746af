"""All-gather context parallelism: every device attends its own queries to the whole row.

K/V (only the Hkv heads, with the true positions and segment ids of their tokens) are
all-gathered over the sequence axis; each device folds the N gathered chunks into its
accumulators with the per-round kernel, one chunk at a time (``rounds.py``), so tiles
are skipped by the one predicate and striped/zigzag still balance the causal work. Nothing waits
for a neighbour between chunks (one round, no ring), so a device's time is its own total, not
a sum of per-round maxima. Backward: the fp32 dK/dV of all N chunks are reduce-scattered home
(``psum_scatter``; an all-reduce and a slice on a CPU, see ``ALL_REDUCE_INSTEAD_OF_SCATTER``).
With GQA the gathered K/V are small next to the queries, which is where this wins.
"""
from __future__ import annotations

from jax import lax

from parallel import kernels
from parallel.kernels import accumulators as ac
from parallel.strategies import Strategy

# Platforms whose reduce-scatter is an all-reduce and a slice here instead: XLA CPU's
# reduce-scatter across processes (gloo) took ~2 s for 8 MB of dK/dV where the all-reduce
# took milliseconds (scripts/bench_attention.py --impls ring,allgather --processes 2). A
# GPU/TPU keeps the reduce-scatter, which moves half the bytes of an all-reduce.
ALL_REDUCE_INSTEAD_OF_SCATTER = {"cpu"}


class AllGather(Strategy):
    def _gather(self, x, axis):
        if x is None or self.call.size == 1:
            return x
        return lax.all_gather(x, self.call.axis, axis=axis, tiled=True)

    def meet(self, q_BCHD, k_BCKD, v_BCKD, pos_BC, seg_BC):
        kv = ac.KV(self._gather(ac.to_kv_major(k_BCKD), 2), self._gather(ac.to_kv_major(v_BCKD), 2),
                   self._gather(pos_BC, 1), self._gather(seg_BC, 1))
        return q_BCHD, pos_BC, seg_BC, kv

    def home(self, d_BKSD, dtype):
        """This device's chunk of the sum over devices of ``d [B, K, N*C, D]`` (fp32 dK/dV)."""
        call = self.call
        if call.size > 1:
            chunk = d_BKSD.shape[2] // call.size
            if kernels.platform_of(call.mesh) in ALL_REDUCE_INSTEAD_OF_SCATTER:
                i = lax.axis_index(call.axis)
                d_BKSD = lax.dynamic_slice_in_dim(lax.psum(d_BKSD, call.axis), i * chunk, chunk, 2)
            else:
                d_BKSD = lax.psum_scatter(d_BKSD, call.axis, scatter_dimension=2, tiled=True)
        return ac.from_kv_major(d_BKSD).astype(dtype)
