"""The chunk-pair loop every context-parallel strategy runs on the per-round kernel interface.

A strategy (ring, all-gather, Ulysses, hybrid) only decides which queries and which K/V blocks
meet on a device; the arithmetic is always the same: this device's queries against one block of
keys/values, with the mask from their true positions and segment ids, folded into fp32
online-softmax accumulators (forward) or turned into dQ/dK/dV contributions (backward), by the
kernel the call names (``parallel/kernels``: ``xla``, or a fused Pallas kernel).

Queries and K/V may each span several *chunks* (``C = L / N`` consecutive slots of the layout,
one device's share): Ulysses holds the whole sequence on its heads, all-gather holds every
device's K/V. A kernel that takes one chunk a side (``ANY_CHUNKS`` False: the fused ones) is
called chunk pair by chunk pair, as in a ring round: positions inside a chunk are increasing in
every layout, which is what keeps a fused kernel's visit table exact work, and each tile pair
is still skipped or masked by the one tile predicate.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from parallel import kernels
from parallel.kernels import accumulators as ac


def _sl(x, start, size, axis):
    return None if x is None else lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _put(x, part, start, axis):
    return lax.dynamic_update_slice_in_dim(x, part, start, axis=axis)


def _kv_chunk(kv: ac.KV, j, chunk) -> ac.KV:
    s = j * chunk
    return ac.KV(_sl(kv.k, s, chunk, 2), _sl(kv.v, s, chunk, 2), _sl(kv.pos, s, chunk, 1),
                 _sl(kv.seg, s, chunk, 1))


def _chunks(x, chunk, axis):
    return x.shape[axis] // chunk


class Rounds:
    """This device's queries ``q [B, S, Hq, D]`` (S = a whole number of chunks), their true
    positions / segment ids ``[B, S]`` and ``kv_heads`` local K/V heads, met by K/V blocks.

    Forward: :meth:`init`, :meth:`attend` per block, :meth:`finish`. Backward (given the
    forward's ``lse [B, K, S, G]``, the output cotangent ``dout [B, S, Hq, D]`` and the row sums
    ``delta [B, S, Hq]`` of ``dout * out``; the output ``out`` itself for a kernel whose
    ``NEEDS_OUT``): :meth:`zeros_dq`, :meth:`grads` per block,
    :meth:`finish_dq`.
    """

    def __init__(self, call, q_BSHD, pos_BS, seg_BS, kv_heads, chunk, lse_BKSG=None,
                 dout_BSHD=None, delta_BSH=None, out_BSHD=None):
        self.chunk, self.hkv = chunk, kv_heads
        self.q, self.pos, self.seg = q_BSHD, pos_BS, seg_BS
        self.nq = _chunks(q_BSHD, chunk, 1)
        self.spec = call.round_spec(q_BSHD.shape[2], kv_heads, q_BSHD.shape[3], seg_BS is not None)
        self.kernel = kernels.rounds(call.kernel)
        self.rows = () if dout_BSHD is None else (  # [B, K, S, G(, D)]: sliced with the queries
            ac.to_q_major(dout_BSHD, kv_heads), lse_BKSG,
            ac.to_q_major(delta_BSH.astype(jnp.float32)[..., None], kv_heads)[..., 0])
        if out_BSHD is not None:  # a kernel whose backward reads the global output (cudnn)
            self.rows += (ac.to_q_major(out_BSHD, kv_heads),)

    def _query(self, i, whole, grad):
        c = self.q.shape[1] if whole else self.chunk
        q, pos, seg = (_sl(x, i * c, c, 1) for x in (self.q, self.pos, self.seg))
        if not grad:
            return self.kernel.queries(self.spec, q, pos, seg)
        return self.kernel.grad_queries(self.spec, q, pos, seg,
                                        *(_sl(x, i * c, c, 2) for x in self.rows))

    def _pairs(self, kv: ac.KV, grad, pair, q_state, kv_state):
        """``pair(query, kv, q_part) -> (q_part, kv_out)`` over the (q chunk, kv chunk) pairs:
        ``q_state`` (arrays ``[B, K, S, ...]``) is sliced per q chunk, the ``kv_out`` of every
        pair added into ``kv_state`` (``[B, K, Sk, ...]``) per kv chunk. One call when the
        kernel takes any number of chunks (or there is one pair): then its ``kv_out`` returns."""
        c, nk = self.chunk, _chunks(kv.k, self.chunk, 2)
        if (self.nq == 1 and nk == 1) or self.kernel.ANY_CHUNKS:
            return pair(self._query(0, True, grad), kv, q_state)

        def q_chunk(i, carry):
            q_state, kv_state = carry
            query = self._query(i, False, grad)

            def kv_chunk(j, carry):
                part, kv_state = carry
                part, out = pair(query, _kv_chunk(kv, j, c), part)
                return part, tuple(_put(x, _sl(x, j * c, c, 2) + o, j * c, 2)
                                   for x, o in zip(kv_state, out))

            part = jax.tree.map(lambda a: _sl(a, i * c, c, 2), q_state)
            part, kv_state = lax.fori_loop(0, nk, kv_chunk, (part, kv_state))
            return jax.tree.map(lambda a, p: _put(a, p, i * c, 2), q_state, part), kv_state

        return lax.fori_loop(0, self.nq, q_chunk, (q_state, kv_state))

    # ------------------------------------------------------------------------- forward

    def init(self) -> ac.Acc:
        return ac.init_acc(ac.to_q_major(self.q, self.hkv))

    def attend(self, kv: ac.KV, acc: ac.Acc) -> ac.Acc:
        """Folds a K/V block (a whole number of chunks) into the accumulators."""
        attend = lambda query, kv, acc: (self.kernel.attend(self.spec, query, kv, acc), ())
        return self._pairs(kv, False, attend, acc, ())[0]

    def finish(self, acc: ac.Acc, sink_H=None):
        """Output ``[B, S, Hq, D]`` in the queries' dtype and the logsumexp ``[B, K, S, G]``;
        with attention sinks (a logit per local query head), each row's softmax also counts
        ``exp(sink)`` (``ac.with_sink``)."""
        out, lse = ac.finalize(acc)
        if sink_H is not None:
            out, lse = ac.with_sink(out, lse, self.sink_rows(sink_H))
        return ac.from_q_major(out).astype(self.q.dtype), lse

    def sink_grads(self, sink_H):
        """Backward: the sinks' gradient per query row ``[B, S, Hq]`` (``ac.sink_grad`` of the
        forward's logsumexp and the row sums this backward was given)."""
        _, lse_BKSG, delta_BKSG = self.rows[:3]
        d_BKSG = ac.sink_grad(lse_BKSG, delta_BKSG, self.sink_rows(sink_H))
        return ac.from_q_major(d_BKSG[..., None])[..., 0]

    def sink_rows(self, sink_H):
        """``[H] -> [1, K, 1, G]``: query head ``h`` is ``(h // G, h % G)``."""
        return sink_H.astype(jnp.float32).reshape(1, self.hkv, 1, -1)

    # ------------------------------------------------------------------------- backward

    def zeros_dq(self):
        # zeros_like: varies over the same mesh axes as q
        return jnp.zeros_like(ac.to_q_major(self.q, self.hkv), dtype=jnp.float32)

    def grads(self, kv: ac.KV, dq):
        """``dq`` accumulated (unscaled, ``[B, K, S, G, D]`` fp32) and the block's fp32
        ``dk``/``dv`` ``[B, K, Sk, D]``."""
        def grads(query, kv, dq):
            dq, dk, dv = self.kernel.attend_grads(self.spec, query, kv, dq)
            return dq, (dk, dv)

        zeros = jnp.zeros_like(kv.k, dtype=jnp.float32)
        dq, (dk, dv) = self._pairs(kv, True, grads, dq, (zeros, zeros))
        return dq, dk, dv

    def finish_dq(self, dq):
        return ac.from_q_major(dq * self.spec.scale).astype(self.q.dtype)
