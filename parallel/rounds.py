"""The per-round kernel interface every context-parallel strategy calls, and the ring's loops.

A strategy (ring, all-gather, Ulysses, hybrid) only decides which queries and which K/V blocks
meet on a device; the arithmetic is always the same: this device's queries against one block of
keys/values, with the mask from their true positions and segment ids, folded into fp32
online-softmax accumulators (forward) or turned into dQ/dK/dV contributions (backward), by the
XLA kernel (``parallel/blockwise.py``) or a fused Pallas kernel (``parallel/kernels/fused.py``).

Queries and K/V may each span several *chunks* (``C = L / N`` consecutive slots of the layout,
one device's share): Ulysses holds the whole sequence on its heads, all-gather holds every
device's K/V. They are visited chunk pair by chunk pair, so that every kernel call sees one
chunk of queries against one chunk of keys, as in a ring round: positions inside a chunk are
increasing in every layout, which is what keeps a fused kernel's visit table exact work, and
each tile pair is still skipped or masked by the one tile predicate.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from parallel import blockwise as bw
from parallel.kernels import fused


def _sl(x, start, size, axis):
    return None if x is None else lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _put(x, part, start, axis):
    return lax.dynamic_update_slice_in_dim(x, part, start, axis=axis)


def kv_block(k_BSKD, v_BSKD, pos_BS, seg_BS) -> bw.KV:
    """Keys/values of this device (any number of chunks) with their true positions."""
    return bw.KV(bw.to_kv_major(k_BSKD), bw.to_kv_major(v_BSKD), pos_BS, seg_BS)


def _kv_chunk(kv: bw.KV, j, chunk) -> bw.KV:
    s = j * chunk
    return bw.KV(_sl(kv.k, s, chunk, 2), _sl(kv.v, s, chunk, 2), _sl(kv.pos, s, chunk, 1),
                 _sl(kv.seg, s, chunk, 1))


def _chunks(x, chunk, axis):
    return x.shape[axis] // chunk


class Forward:
    """This device's queries ``q [B, S, Hq, D]`` (S = a whole number of chunks), their true
    positions / segment ids ``[B, S]``, and ``kv_heads`` local K/V heads."""

    def __init__(self, call, q_BSHD, pos_BS, seg_BS, kv_heads, chunk):
        self.call, self.chunk, self.hkv = call, chunk, kv_heads
        self.q, self.pos, self.seg = q_BSHD, pos_BS, seg_BS
        self.nq = _chunks(q_BSHD, chunk, 1)
        if call.kernel != "xla":
            self.spec = call.round_spec(q_BSHD.shape[2], kv_heads, q_BSHD.shape[3], seg_BS is not None)

    def init(self) -> bw.Acc:
        return bw.init_acc(bw.to_q_major(self.q, self.hkv))

    def _query(self, i, whole=False):
        c = self.q.shape[1] if whole else self.chunk
        q, pos, seg = _sl(self.q, i * c, c, 1), _sl(self.pos, i * c, c, 1), _sl(self.seg, i * c, c, 1)
        if self.call.kernel == "xla":
            return bw.to_q_major(q.astype(jnp.float32) * self.call.scale, self.hkv), pos, seg
        return fused.prepare(q, pos, seg, self.spec)

    def _pair(self, query, kv, acc):
        call = self.call
        if call.kernel == "xla":
            q_s, pos, seg = query
            return bw.attend_block(q_s, kv, pos, seg, acc, block_q=call.block_q,
                                   block_kv=call.block_kv, causal=call.causal)
        return fused.attend(self.spec, query, kv, acc)

    def attend(self, kv: bw.KV, acc: bw.Acc) -> bw.Acc:
        """Folds a K/V block (a whole number of chunks) into the accumulators."""
        c, nk = self.chunk, _chunks(kv.k, self.chunk, 2)
        if (self.nq == 1 and nk == 1) or self.call.kernel == "xla":
            # The XLA kernel builds its work lists per tile over any number of chunks.
            return self._pair(self._query(0, whole=True), kv, acc)

        def q_chunk(i, acc):
            query = self._query(i)
            part = bw.Acc(*(_sl(a, i * c, c, 2) for a in acc))
            part = lax.fori_loop(0, nk, lambda j, p: self._pair(query, _kv_chunk(kv, j, c), p), part)
            return bw.Acc(*(_put(a, p, i * c, 2) for a, p in zip(acc, part)))

        return lax.fori_loop(0, self.nq, q_chunk, acc)

    def finish(self, acc: bw.Acc):
        """Output ``[B, S, Hq, D]`` in the queries' dtype and the logsumexp ``[B, K, S, G]``."""
        out, lse = bw.finalize(acc)
        return bw.from_q_major(out).astype(self.q.dtype), lse


class Backward:
    """The backward of :class:`Forward`: ``lse [B, K, S, G]`` from it, the output cotangent
    ``dout [B, S, Hq, D]`` and either the output (``out``) or the row sums of ``dout * out``
    (``delta [B, S, Hq]``, when they were computed where the output lives)."""

    def __init__(self, call, q_BSHD, pos_BS, seg_BS, kv_heads, chunk, lse_BKSG, dout_BSHD,
                 out_BSHD=None, delta_BSH=None):
        self.call, self.chunk, self.hkv = call, chunk, kv_heads
        self.q, self.pos, self.seg = q_BSHD, pos_BS, seg_BS
        self.nq = _chunks(q_BSHD, chunk, 1)
        self.lse = lse_BKSG
        do = bw.to_q_major(dout_BSHD.astype(jnp.float32), kv_heads)
        if delta_BSH is None:
            self.delta = jnp.sum(do * bw.to_q_major(out_BSHD.astype(jnp.float32), kv_heads), axis=-1)
        else:
            self.delta = bw.to_q_major(delta_BSH.astype(jnp.float32)[..., None], kv_heads)[..., 0]
        if call.kernel == "xla":
            self.do = do
        else:
            self.spec = call.round_spec(q_BSHD.shape[2], kv_heads, q_BSHD.shape[3], seg_BS is not None)
            self.do = bw.to_q_major(dout_BSHD, kv_heads)  # the kernel reads the input dtype

    def zeros_dq(self):
        # zeros_like: varies over the same mesh axes as q
        return jnp.zeros_like(bw.to_q_major(self.q, self.hkv), dtype=jnp.float32)

    def _query(self, i, whole=False):
        c = self.q.shape[1] if whole else self.chunk
        q, pos, seg = _sl(self.q, i * c, c, 1), _sl(self.pos, i * c, c, 1), _sl(self.seg, i * c, c, 1)
        do, lse, delta = (_sl(x, i * c, c, 2) for x in (self.do, self.lse, self.delta))
        if self.call.kernel == "xla":
            q_s = bw.to_q_major(q.astype(jnp.float32) * self.call.scale, self.hkv)
            return q_s, pos, seg, do, lse, delta
        return (fused.prepare(q, pos, seg, self.spec), fused.fold_rows(do), fused.fold_rows(lse),
                fused.fold_rows(delta))

    def _pair(self, query, kv, dq):
        call = self.call
        if call.kernel == "xla":
            q_s, pos, seg, do, lse, delta = query
            return bw.attend_block_bwd(q_s, kv, pos, seg, do, lse, delta, dq, block_q=call.block_q,
                                       block_kv=call.block_kv, causal=call.causal)
        prep, do_f, lse_f, delta_f = query
        return fused.grads(self.spec, prep, kv, do_f, lse_f, delta_f, dq)

    def grads(self, kv: bw.KV, dq):
        """``dq`` accumulated (unscaled, ``[B, K, S, G, D]`` fp32) and the block's fp32
        ``dk``/``dv`` ``[B, K, Sk, D]``."""
        c, nk = self.chunk, _chunks(kv.k, self.chunk, 2)
        if (self.nq == 1 and nk == 1) or self.call.kernel == "xla":
            return self._pair(self._query(0, whole=True), kv, dq)
        zeros = jnp.zeros_like(kv.k, dtype=jnp.float32)

        def q_chunk(i, carry):
            dq, dk, dv = carry
            query = self._query(i)

            def kv_chunk(j, carry):
                dq_i, dk, dv = carry
                dq_i, dk_j, dv_j = self._pair(query, _kv_chunk(kv, j, c), dq_i)
                return (dq_i, _put(dk, _sl(dk, j * c, c, 2) + dk_j, j * c, 2),
                        _put(dv, _sl(dv, j * c, c, 2) + dv_j, j * c, 2))

            dq_i, dk, dv = lax.fori_loop(0, nk, kv_chunk, (_sl(dq, i * c, c, 2), dk, dv))
            return _put(dq, dq_i, i * c, 2), dk, dv

        return lax.fori_loop(0, self.nq, q_chunk, (dq, zeros, zeros))

    def finish(self, dq):
        return bw.from_q_major(dq * self.call.scale).astype(self.q.dtype)


# ----------------------------------------------------------------------------- ring loops


def shift(tree, call):
    """One hop round the ring: device d sends to d + U (U = 1 for the plain ring; the hybrid's
    ring connects the same member of neighbouring Ulysses groups)."""
    n, u = call.size, call.ulysses
    perm = [(i, (i + u) % n) for i in range(n)]
    return jax.tree.map(lambda x: lax.ppermute(x, call.axis, perm), tree)


def ring_forward(kv, acc, attend, rounds, shift):
    """``rounds`` ring rounds: the next block's transfer is issued before the current block's
    compute (independent of it, so XLA can overlap them); the last round sends nothing."""
    def round_(_, carry):
        kv, acc = carry
        kv_next = shift(kv)
        return kv_next, attend(kv, acc)

    kv, acc = lax.fori_loop(0, rounds - 1, round_, (kv, acc))
    return attend(kv, acc)


def ring_backward(kv, dq, grads, rounds, shift):
    """dQ accumulates locally; each block's dK/dV accumulator travels one hop behind the K/V
    prefetch and arrives home after ``rounds`` hops. Returns ``(dq, dk, dv)``."""
    if rounds == 1:
        return grads(kv, dq)
    kv_next = shift(kv)
    dq, dk, dv = grads(kv, dq)

    def round_(kv_next, dq, dkv, prefetch):
        # dK/dV of the block computed last round move on while this round computes fresh
        # contributions for the block that just arrived; they meet afterwards.
        dkv_in = shift(dkv)
        kv = kv_next
        kv_next = shift(kv) if prefetch else None
        dq, dk, dv = grads(kv, dq)
        return kv_next, dq, (dkv_in[0] + dk, dkv_in[1] + dv)

    kv_next, dq, dkv = lax.fori_loop(1, rounds - 1, lambda _, c: round_(*c, prefetch=True),
                                     (kv_next, dq, (dk, dv)))
    _, dq, dkv = round_(kv_next, dq, dkv, prefetch=False)
    dk, dv = shift(dkv)  # the final hop brings each block's gradient home
    return dq, dk, dv
