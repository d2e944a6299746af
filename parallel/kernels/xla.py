"""The ``xla`` kernel: blockwise attention of a chunk of queries against one K/V block, in
plain XLA (fori_loops over tiles, fp32 einsums); right on a CPU. Also the dense reference.

The kernel walks (q tile, kv tile) pairs with fp32 online-softmax accumulators (running max
``m``, denominator ``l``, numerator ``o``: ``accumulators.py``). Each pair is skipped, computed
without a mask, or computed with the mask, as decided by the one tile predicate
(``predicate.py``) from the true positions (and segment ids) of the tile's queries and keys.

Skipped tiles are never visited: per q tile (per kv tile in the backward) the kernel builds,
at run time, the list of tiles to compute and loops over exactly those with a dynamic trip
count; ``lax.cond`` then picks the masked or unmasked body. Nothing is unrolled, so the code
size does not grow with the number of tiles, and skipping never depends on XLA resolving a
conditional at compile time. Its work lists span any number of chunks, so a strategy hands it
all its queries and a whole (gathered) K/V block in one call (``ANY_CHUNKS``).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from parallel.kernels import accumulators as ac
from parallel.kernels import predicate
from parallel.kernels.spec import RoundSpec, Tile

ANY_CHUNKS = True  # one call may hold any number of chunks of queries and of keys

# Tile rules (``tiling.py``): one tile for all three passes, the user's or ``XLA_TILE``; any tile
# dividing the chunk runs, a larger one is clamped to it. The default is attention.block_q /
# block_kv's, so it must divide the chunk like theirs (not shrunk to fit). The backward's tiles
# are then ``backward_tile``'s (tiling.plan applies it to the dQ and dK/dV tiles).
XLA_TILE = 512  # positions, both sides
FIT_DEFAULTS = False
# The backward's tiles: a forward tile above this runs the backward on its largest divisor not
# above it (so it still divides the chunk), unless that is under a quarter of it (300 runs
# 150, a prime 307 keeps 307). Its five einsums and four elementwise passes per tile run on
# [kv, q, G] score tiles, and at 512 x 512 those (9 MB for 3 query heads per KV head) leave a
# CPU's caches.
# SmolLM2's shapes at 2,048 tokens (scripts/bench_step.py, 8 layers; the profile's attention
# backward row, read before it counted the kernel's tile einsums): 1.30 s at 512, 0.64 s at 256,
# 0.88 s at 128; the whole step 9.9-10.8 s -> 9.5-9.9 with the loss's pick. The forward is
# fastest at 512. Still so with key-major tiles (attend_block_bwd; one layer's forward and
# backward at SmolLM2's shapes, 2026-12-07): 0.29 s at 512, 0.23 s at 256, 0.38 s at 128.
XLA_BWD_TILE = 256


def backward_tile(block: int) -> int:
    """The backward's tile for a (fitted) forward tile of ``block`` positions (XLA_BWD_TILE)."""
    if block <= XLA_BWD_TILE:
        return block
    fit = max(d for d in range(1, XLA_BWD_TILE + 1) if block % d == 0)
    return fit if fit >= XLA_BWD_TILE // 4 else block


def default_tiles(group, head_dim, dtype, arch=None):
    return (Tile(XLA_TILE, XLA_TILE),) * 3


# ----------------------------------------------------------------------------- round interface


def queries(spec: RoundSpec, q_BSHD, pos_BS, seg_BS):
    """This device's queries as the kernel reads them: scaled fp32 ``[B, K, S, G, D]``."""
    return ac.to_q_major(q_BSHD.astype(jnp.float32) * spec.scale, spec.kv_heads), pos_BS, seg_BS


def attend(spec: RoundSpec, query, kv: ac.KV, acc: ac.Acc) -> ac.Acc:
    q_s, pos, seg = query
    return attend_block(q_s, kv, pos, seg, acc, block_q=spec.fwd.block_q,
                        block_kv=spec.fwd.block_kv, causal=spec.causal, window=spec.window)


def grad_queries(spec: RoundSpec, q_BSHD, pos_BS, seg_BS, do_BKSGD, lse_BKSG, delta_BKSG):
    """The backward's queries: :func:`queries` with the fp32 output cotangent and row stats."""
    return (*queries(spec, q_BSHD, pos_BS, seg_BS), do_BKSGD.astype(jnp.float32), lse_BKSG,
            delta_BKSG)


def attend_grads(spec: RoundSpec, query, kv: ac.KV, dq_BKSGD):
    q_s, pos, seg, do, lse, delta = query
    return attend_block_bwd(q_s, kv, pos, seg, do, lse, delta, dq_BKSGD,
                            block_q=spec.dq.block_q, block_kv=spec.dq.block_kv,
                            causal=spec.causal, window=spec.window)


# ----------------------------------------------------------------------------- kernel


def _tile_mask(q_pos, k_pos, q_seg, k_seg, causal, window=0):
    """``[B, 1, bq, 1, bk]`` visibility mask broadcastable against scores ``[B, K, bq, G, bk]``."""
    return predicate.visible(q_pos, k_pos, q_seg, k_seg, causal=causal,
                             window=window)[:, None, :, None, :]


def _slice(x, start, size, axis):
    return lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _seg_slice(seg, start, size):
    return None if seg is None else _slice(seg, start, size, 1)


def _rows(x, axis=3):
    """``x`` with its (query, group) axes at ``axis``, ``axis + 1`` merged into one (a bitcast):
    an einsum contracting both as two letters orders them its own way, and XLA then copies
    both operands into that order."""
    return x.reshape(x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2:])


class _Block(NamedTuple):
    """One K/V block ready for the tile loops: fp32 keys and values, the tile cases ``[nq, nk]``
    and the work list: per row (a q tile in the forward, a kv tile in the backward) the indices
    of the tiles to compute, in ascending order (``order``), and how many there are."""

    k: jax.Array
    v: jax.Array
    cases: jax.Array
    order: jax.Array
    counts: jax.Array


def _block(q_pos, q_seg, kv: ac.KV, *, block_q, block_kv, causal, window, by_kv) -> _Block:
    """The kernel loops over exactly the listed tiles: skipped ones cost nothing, not even a
    branch. ``by_kv``: rows are kv tiles (the backward), else q tiles (the forward)."""
    cases = predicate.tile_cases(q_pos, kv.pos, q_seg, kv.seg, block_q=block_q, block_kv=block_kv,
                                 causal=causal, window=window)
    skip = (cases == predicate.SKIP).T if by_kv else cases == predicate.SKIP
    order = jnp.argsort(skip, axis=1, stable=True).astype(jnp.int32)  # computed tiles first
    return _Block(kv.k.astype(jnp.float32), kv.v.astype(jnp.float32), cases, order,
                  jnp.sum(~skip, axis=1, dtype=jnp.int32))


def attend_block(q_BKCGD, kv: ac.KV, q_pos, q_seg, acc: ac.Acc, *, block_q, block_kv, causal=True,
                 window=0):
    """Folds one K/V block into the accumulators of a chunk of (already scaled, fp32) queries.

    ``q_pos``/``q_seg`` are ``[B, Cq]``; ``kv`` holds ``[B, K, Ck, D]`` keys and values in any
    float dtype (cast to fp32 once here) and their ``[B, Ck]`` positions / segment ids.
    """
    _, _, cq, _, _ = q_BKCGD.shape
    nq = cq // block_q
    k, v, cases, order, counts = _block(q_pos, q_seg, kv, block_q=block_q, block_kv=block_kv,
                                        causal=causal, window=window, by_kv=False)

    def q_tile(i, acc):
        qs = i * block_q
        q_t = _slice(q_BKCGD, qs, block_q, 2)
        qp_t = _slice(q_pos, qs, block_q, 1)
        qg_t = _seg_slice(q_seg, qs, block_q)
        tile_acc = ac.Acc(*(_slice(a, qs, block_q, 2) for a in acc))

        def kv_tile(t, tile_acc):
            j = order[i, t]
            ks = j * block_kv
            k_t = _slice(k, ks, block_kv, 2)
            v_t = _slice(v, ks, block_kv, 2)

            def compute(masked):
                def branch(a: ac.Acc):
                    s = jnp.einsum("bkqgd,bkmd->bkqgm", q_t, k_t)
                    if masked:
                        mask = _tile_mask(qp_t, _slice(kv.pos, ks, block_kv, 1), qg_t,
                                          _seg_slice(kv.seg, ks, block_kv), causal, window)
                        s = jnp.where(mask, s, -jnp.inf)
                    m_new = jnp.maximum(a.m, s.max(-1))
                    p = jnp.exp(s - m_new[..., None])
                    alpha = jnp.exp(a.m - m_new)
                    o = a.o * alpha[..., None] + jnp.einsum("bkqgm,bkmd->bkqgd", p, v_t)
                    return ac.Acc(o, m_new, a.l * alpha + p.sum(-1))
                return branch

            masked = cases[i, j] == predicate.MASKED
            return lax.cond(masked, compute(True), compute(False), tile_acc)

        tile_acc = lax.fori_loop(0, counts[i], kv_tile, tile_acc)
        return ac.Acc(*(lax.dynamic_update_slice_in_dim(a, t, qs, axis=2)
                        for a, t in zip(acc, tile_acc)))

    return lax.fori_loop(0, nq, q_tile, acc)


def attend_block_bwd(q_BKCGD, kv: ac.KV, q_pos, q_seg, do_BKCGD, lse_BKCG, delta_BKCG, dq_BKCGD,
                     *, block_q, block_kv, causal=True, window=0):
    """Gradient contributions of one K/V block.

    ``q`` is the scaled fp32 query chunk, ``do`` the fp32 output cotangent, ``delta`` the
    row sums of ``do * out``. Returns ``(dq, dk, dv)``: ``dq`` accumulated onto ``dq_BKCGD``
    (still to be multiplied by the softmax scale), ``dk``/``dv`` ``[B, K, Ck, D]`` fp32
    contributions of this block (``dk`` already w.r.t. unscaled keys since ``q`` is scaled).

    The tiles' scores are computed key-major, ``[B, K, kv, q, G]``: then dV = P^T dO and
    dK = dS^T Q contract the scores' last axis, and dQ is accumulated transposed
    (``[B, K, D, C, G]``, dQ^T = K^T dS^T), so none of the five einsums reads a score tile
    across its rows. Query-major, XLA's CPU dots wanted P and dS transposed, and wrote them so
    (a strided copy of every tile: 0.5 s of SmolLM2's 8-layer step).
    """
    ck = kv.k.shape[2]
    nk = ck // block_kv
    k, v, cases, order, counts = _block(q_pos, q_seg, kv, block_q=block_q, block_kv=block_kv,
                                        causal=causal, window=window, by_kv=True)
    dkv_shape = k.shape[:2] + (block_kv,) + k.shape[3:]
    qT = jnp.moveaxis(q_BKCGD, 4, 2)  # [B, K, D, C, G], once per call
    doT = jnp.moveaxis(do_BKCGD, 4, 2)
    dqT = jnp.moveaxis(dq_BKCGD, 4, 2)

    def kv_tile(j, carry):
        dqT, dk, dv = carry
        ks = j * block_kv
        k_t = _slice(k, ks, block_kv, 2)
        kT_t = jnp.swapaxes(k_t, 2, 3)  # [B, K, D, kv]
        v_t = _slice(v, ks, block_kv, 2)
        kp_t = _slice(kv.pos, ks, block_kv, 1)
        kg_t = _seg_slice(kv.seg, ks, block_kv)

        def q_tile(t, carry):
            dqT, dk_t, dv_t = carry
            i = order[j, t]
            qs = i * block_q
            q_t = _slice(q_BKCGD, qs, block_q, 2)
            qT_t = _slice(qT, qs, block_q, 3)
            do_t = _slice(do_BKCGD, qs, block_q, 2)
            doT_t = _slice(doT, qs, block_q, 3)
            lse_t = _slice(lse_BKCG, qs, block_q, 2)[:, :, None]
            delta_t = _slice(delta_BKCG, qs, block_q, 2)[:, :, None]

            def compute(masked):
                def branch(args):
                    dqT_t, dk_t, dv_t = args
                    s = jnp.einsum("bkmd,bkdqg->bkmqg", k_t, qT_t)
                    p = jnp.exp(s - lse_t)
                    if masked:
                        mask = predicate.visible(_slice(q_pos, qs, block_q, 1), kp_t,
                                                 _seg_slice(q_seg, qs, block_q), kg_t,
                                                 causal=causal, window=window)
                        p = jnp.where(jnp.swapaxes(mask, 1, 2)[:, None, :, :, None], p, 0.0)
                    dv_t = dv_t + jnp.einsum("bkmn,bknd->bkmd", _rows(p), _rows(do_t, 2))
                    dp = jnp.einsum("bkmd,bkdqg->bkmqg", v_t, doT_t)
                    ds = p * (dp - delta_t)
                    dqT_t = dqT_t + jnp.einsum("bkdm,bkmqg->bkdqg", kT_t, ds)
                    dk_t = dk_t + jnp.einsum("bkmn,bknd->bkmd", _rows(ds), _rows(q_t, 2))
                    return dqT_t, dk_t, dv_t
                return branch

            dqT_t, dk_t, dv_t = lax.cond(cases[i, j] == predicate.MASKED, compute(True),
                                         compute(False), (_slice(dqT, qs, block_q, 3), dk_t, dv_t))
            return lax.dynamic_update_slice_in_dim(dqT, dqT_t, qs, axis=3), dk_t, dv_t

        zeros = ac.zeros(k, dkv_shape)
        dqT, dk_t, dv_t = lax.fori_loop(0, counts[j], q_tile, (dqT, zeros, zeros))
        return (dqT, lax.dynamic_update_slice_in_dim(dk, dk_t, ks, axis=2),
                lax.dynamic_update_slice_in_dim(dv, dv_t, ks, axis=2))

    dqT, dk, dv = lax.fori_loop(0, nk, kv_tile, (dqT, ac.zeros(k), ac.zeros(k)))
    return jnp.moveaxis(dqT, 2, 4), dk, dv


# ----------------------------------------------------------------------------- dense reference


def dense_attention(q, k, v, *, positions=None, segment_ids=None, causal=True, window=0,
                    sinks=None):
    """Plain attention in natural order: q ``[B, L, Hq, D]``, k/v ``[B, L, Hkv, D]``.

    Mask: same segment and ``k_pos <= q_pos`` (and ``k_pos > q_pos - window`` when > 0). GQA groups query heads per kv head instead of
    repeating K/V. fp32 inside, returns ``q.dtype``. Rows with no visible key return 0.
    ``sinks [Hq]``: attention sinks, one more term ``exp(sink)`` in every row's denominator.
    """
    b, length, hq, d = q.shape
    hkv = k.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
    q_BKLGD = ac.to_q_major(q.astype(jnp.float32), hkv) * (1.0 / math.sqrt(d))
    k_BKLD = ac.to_kv_major(k.astype(jnp.float32))
    v_BKLD = ac.to_kv_major(v.astype(jnp.float32))
    s = jnp.einsum("bkqgd,bkmd->bkqgm", q_BKLGD, k_BKLD)
    mask = _tile_mask(positions, positions, segment_ids, segment_ids, causal, window)
    s = jnp.where(mask, s, -jnp.inf)
    m = s.max(-1, keepdims=True)
    if sinks is not None:  # [Hq] -> [1, K, 1, G, 1], query head h = (h // G, h % G)
        sink = jnp.asarray(sinks, jnp.float32).reshape(1, hkv, 1, hq // hkv, 1)
        m = jnp.maximum(m, sink)
    m = jnp.where(jnp.isfinite(m), lax.stop_gradient(m), 0.0)
    p = jnp.exp(s - m)  # exactly 0 where masked, also for its gradient
    denom = p.sum(-1, keepdims=True)
    if sinks is not None:
        denom = denom + jnp.exp(sink - m)
    p = p / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("bkqgm,bkmd->bkqgd", p, v_BKLD)
    return ac.from_q_major(out).astype(q.dtype)
