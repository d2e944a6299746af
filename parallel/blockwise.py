"""Blockwise attention on one device's chunk, and the dense reference.

The blockwise kernel walks (q tile, kv tile) pairs with fp32 online-softmax accumulators
(running max ``m``, denominator ``l``, numerator ``o``). Each pair is skipped, computed
without a mask, or computed with the mask, as decided by :func:`tile_case` from the true
positions (and segment ids) of the tile's queries and keys. The same predicate drives the
kernel, the tests and ``parallel/schedule.py``.

Internal layouts (chosen so that every tile matmul is a plain batched GEMM over (B, K) with
the query-head group folded into the rows, and K/V are never repeated for GQA):

    q_BKCGD  queries, K = kv heads, C = chunk length, G = query heads per kv head
    k_BKCD   keys / values
    m_BKCG   per-row running max (and l, lse, delta)

Skipped tiles are never visited: per q tile (per kv tile in the backward) the kernel builds,
at run time, the list of tiles to compute and loops over exactly those with a dynamic trip
count; ``lax.cond`` then picks the masked or unmasked body. Nothing is unrolled, so the code
size does not grow with the number of tiles, and skipping never depends on XLA resolving a
conditional at compile time.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

SKIP, FULL, MASKED = 0, 1, 2

# Finite, so that exp(m_old - m_new) of a row that has seen no key is exp(0) = 1 times an
# all-zero accumulator instead of exp(-inf - -inf) = NaN; masked scores use -inf so that
# they contribute exactly exp(-inf) = 0 whatever the running max is.
_M_INIT = -1e30


# ----------------------------------------------------------------------------- predicate


def tile_case(q_min, q_max, k_min, k_max, qs_min=None, qs_max=None, ks_min=None, ks_max=None,
              *, causal=True):
    """Case of one (q tile, kv tile) pair from the ranges of its positions and segment ids.

    Works elementwise on numpy or jax arrays (broadcasting). Returns int32 SKIP / FULL / MASKED:
    skip when every key is in the future (causal) or the segment ranges are disjoint;
    full (no mask) when every key is visible from every query and both tiles hold one and the
    same segment; masked otherwise.
    """
    never = (q_min != q_min) | (k_min != k_min)  # all False, broadcast to the pair shape
    skip = k_min > q_max if causal else never
    full = k_max <= q_min if causal else ~never
    if qs_min is not None:
        skip = skip | (ks_min > qs_max) | (ks_max < qs_min)
        full = full & (qs_min == qs_max) & (ks_min == ks_max) & (qs_min == ks_min)
    # (1 - skip) * (2 - full): 0 when skipped, else 1 (full) or 2 (masked).
    return ((1 - skip.astype(np.int32)) * (2 - full.astype(np.int32))).astype(np.int32)


def _tile_ranges(x, block):
    """min and max of ``x [..., C]`` over consecutive tiles of ``block``: two ``[..., C/block]``."""
    t = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    return t.min(-1), t.max(-1)


def tile_cases(q_pos, k_pos, q_seg=None, k_seg=None, *, block_q, block_kv, causal=True):
    """Case table ``[..., nq, nk]`` for all tile pairs of a chunk of queries and one of keys.

    ``q_pos [..., Cq]``, ``k_pos [..., Ck]`` (and the segment ids, or None) are true positions;
    leading dims (batch rows) are combined: a pair is skipped only when it is skipped for every
    row and unmasked only when it is unmasked for every row (a row that would skip is then
    masked to nothing). Numpy in, numpy out; jax in, jax out.
    """
    xp = np if isinstance(q_pos, np.ndarray) and isinstance(k_pos, np.ndarray) else jnp
    q_min, q_max = _tile_ranges(q_pos, block_q)
    k_min, k_max = _tile_ranges(k_pos, block_kv)
    seg = ()
    if q_seg is not None:
        qs_min, qs_max = _tile_ranges(q_seg, block_q)
        ks_min, ks_max = _tile_ranges(k_seg, block_kv)
        seg = (qs_min[..., :, None], qs_max[..., :, None], ks_min[..., None, :], ks_max[..., None, :])
    case = tile_case(q_min[..., :, None], q_max[..., :, None], k_min[..., None, :], k_max[..., None, :],
                     *seg, causal=causal)
    if case.ndim > 2:
        lead = tuple(range(case.ndim - 2))
        all_skip = xp.all(case == SKIP, axis=lead)
        all_full = xp.all(case == FULL, axis=lead)
        case = xp.where(all_skip, SKIP, xp.where(all_full, FULL, MASKED)).astype(np.int32)
    return case


def visible(q_pos, k_pos, q_seg=None, k_seg=None, *, causal=True):
    """Elementwise mask ``[..., Cq, Ck]``: key visible from query (same segment, k_pos <= q_pos)."""
    xp = np if isinstance(q_pos, np.ndarray) and isinstance(k_pos, np.ndarray) else jnp
    mask = xp.ones(q_pos.shape[:-1] + (q_pos.shape[-1], k_pos.shape[-1]), dtype=bool)
    if causal:
        mask = k_pos[..., None, :] <= q_pos[..., :, None]
    if q_seg is not None:
        mask = mask & (k_seg[..., None, :] == q_seg[..., :, None])
    return mask


# ----------------------------------------------------------------------------- layouts


def to_q_major(q_BCHD, num_kv_heads):
    """``[B, C, Hq, D] -> [B, K, C, G, D]``: query head ``h`` uses kv head ``h // G``."""
    b, c, hq, d = q_BCHD.shape
    return q_BCHD.reshape(b, c, num_kv_heads, hq // num_kv_heads, d).transpose(0, 2, 1, 3, 4)


def from_q_major(q_BKCGD):
    b, k, c, g, d = q_BKCGD.shape
    return q_BKCGD.transpose(0, 2, 1, 3, 4).reshape(b, c, k * g, d)


def to_kv_major(k_BCKD):
    return k_BCKD.transpose(0, 2, 1, 3)


def from_kv_major(k_BKCD):
    return k_BKCD.transpose(0, 2, 1, 3)


# ----------------------------------------------------------------------------- kernel


class Acc(NamedTuple):
    """fp32 online-softmax state of a chunk of queries."""

    o: jax.Array  # [B, K, C, G, D] unnormalised numerator
    m: jax.Array  # [B, K, C, G] running max of the scaled scores
    l: jax.Array  # [B, K, C, G] running denominator


class KV(NamedTuple):
    """A block of keys/values with the true positions (and segment ids) of its tokens."""

    k: jax.Array  # [B, K, C, D]
    v: jax.Array  # [B, K, C, D]
    pos: jax.Array  # [B, C] int32
    seg: jax.Array | None  # [B, C] int32


def _zeros(like, shape=None):
    # zeros_like (not zeros) so that inside shard_map the value varies over the same mesh axes
    # as ``like``: loop carries and switch branches must keep one type.
    return jnp.zeros_like(like, dtype=jnp.float32, shape=shape)


def init_acc(q_BKCGD):
    rows = q_BKCGD.shape[:-1]
    return Acc(_zeros(q_BKCGD), _zeros(q_BKCGD, rows) + _M_INIT, _zeros(q_BKCGD, rows))


def _tile_mask(q_pos, k_pos, q_seg, k_seg, causal):
    """``[B, 1, bq, 1, bk]`` visibility mask broadcastable against scores ``[B, K, bq, G, bk]``."""
    return visible(q_pos, k_pos, q_seg, k_seg, causal=causal)[:, None, :, None, :]


def _slice(x, start, size, axis):
    return lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _seg_slice(seg, start, size):
    return None if seg is None else _slice(seg, start, size, 1)


def _work_lists(cases, axis):
    """Per row of ``cases`` (axis=1: per q tile over kv tiles; axis=0: per kv tile over q
    tiles): the indices of the tiles to compute, in ascending order, and how many there are.

    The kernel loops over exactly these: skipped tiles cost nothing, not even a branch.
    """
    skip = (cases == SKIP) if axis == 1 else (cases == SKIP).T
    order = jnp.argsort(skip, axis=1, stable=True).astype(jnp.int32)  # computed tiles first
    return order, jnp.sum(~skip, axis=1, dtype=jnp.int32)


def attend_block(q_BKCGD, kv: KV, q_pos, q_seg, acc: Acc, *, block_q, block_kv, causal=True):
    """Folds one K/V block into the accumulators of a chunk of (already scaled, fp32) queries.

    ``q_pos``/``q_seg`` are ``[B, Cq]``; ``kv`` holds ``[B, K, Ck, D]`` keys and values in any
    float dtype (cast to fp32 once here) and their ``[B, Ck]`` positions / segment ids.
    """
    _, _, cq, _, _ = q_BKCGD.shape
    nq = cq // block_q
    k = kv.k.astype(jnp.float32)
    v = kv.v.astype(jnp.float32)
    cases = tile_cases(q_pos, kv.pos, q_seg, kv.seg, block_q=block_q, block_kv=block_kv, causal=causal)
    order, counts = _work_lists(cases, axis=1)

    def q_tile(i, acc):
        qs = i * block_q
        q_t = _slice(q_BKCGD, qs, block_q, 2)
        qp_t = _slice(q_pos, qs, block_q, 1)
        qg_t = _seg_slice(q_seg, qs, block_q)
        tile_acc = Acc(*(_slice(a, qs, block_q, 2) for a in acc))

        def kv_tile(t, tile_acc):
            j = order[i, t]
            ks = j * block_kv
            k_t = _slice(k, ks, block_kv, 2)
            v_t = _slice(v, ks, block_kv, 2)

            def compute(masked):
                def branch(a: Acc):
                    s = jnp.einsum("bkqgd,bkmd->bkqgm", q_t, k_t)
                    if masked:
                        mask = _tile_mask(qp_t, _slice(kv.pos, ks, block_kv, 1), qg_t,
                                          _seg_slice(kv.seg, ks, block_kv), causal)
                        s = jnp.where(mask, s, -jnp.inf)
                    m_new = jnp.maximum(a.m, s.max(-1))
                    p = jnp.exp(s - m_new[..., None])
                    alpha = jnp.exp(a.m - m_new)
                    o = a.o * alpha[..., None] + jnp.einsum("bkqgm,bkmd->bkqgd", p, v_t)
                    return Acc(o, m_new, a.l * alpha + p.sum(-1))
                return branch

            return lax.cond(cases[i, j] == MASKED, compute(True), compute(False), tile_acc)

        tile_acc = lax.fori_loop(0, counts[i], kv_tile, tile_acc)
        return Acc(*(lax.dynamic_update_slice_in_dim(a, t, qs, axis=2) for a, t in zip(acc, tile_acc)))

    return lax.fori_loop(0, nq, q_tile, acc)


def finalize(acc: Acc):
    """Normalised output ``[B, K, C, G, D]`` (fp32) and the row logsumexp ``[B, K, C, G]``.

    A row that saw no visible key returns 0 and lse = +inf, so that the backward's
    ``exp(s - lse)`` is exactly 0 for it.
    """
    seen = acc.l > 0
    out = acc.o / jnp.where(seen, acc.l, 1.0)[..., None]
    lse = jnp.where(seen, acc.m + jnp.log(jnp.where(seen, acc.l, 1.0)), jnp.inf)
    return out, lse


def attend_block_bwd(q_BKCGD, kv: KV, q_pos, q_seg, do_BKCGD, lse_BKCG, delta_BKCG, dq_BKCGD,
                     *, block_q, block_kv, causal=True):
    """Gradient contributions of one K/V block.

    ``q`` is the scaled fp32 query chunk, ``do`` the fp32 output cotangent, ``delta`` the
    row sums of ``do * out``. Returns ``(dq, dk, dv)``: ``dq`` accumulated onto ``dq_BKCGD``
    (still to be multiplied by the softmax scale), ``dk``/``dv`` ``[B, K, Ck, D]`` fp32
    contributions of this block (``dk`` already w.r.t. unscaled keys since ``q`` is scaled).
    """
    ck = kv.k.shape[2]
    nk = ck // block_kv
    k = kv.k.astype(jnp.float32)
    v = kv.v.astype(jnp.float32)
    cases = tile_cases(q_pos, kv.pos, q_seg, kv.seg, block_q=block_q, block_kv=block_kv, causal=causal)
    order, counts = _work_lists(cases, axis=0)
    dkv_shape = k.shape[:2] + (block_kv,) + k.shape[3:]

    def kv_tile(j, carry):
        dq, dk, dv = carry
        ks = j * block_kv
        k_t = _slice(k, ks, block_kv, 2)
        v_t = _slice(v, ks, block_kv, 2)
        kp_t = _slice(kv.pos, ks, block_kv, 1)
        kg_t = _seg_slice(kv.seg, ks, block_kv)

        def q_tile(t, carry):
            dq, dk_t, dv_t = carry
            i = order[j, t]
            qs = i * block_q
            q_t = _slice(q_BKCGD, qs, block_q, 2)
            do_t = _slice(do_BKCGD, qs, block_q, 2)
            lse_t = _slice(lse_BKCG, qs, block_q, 2)
            delta_t = _slice(delta_BKCG, qs, block_q, 2)

            def compute(masked):
                def branch(args):
                    dq_t, dk_t, dv_t = args
                    s = jnp.einsum("bkqgd,bkmd->bkqgm", q_t, k_t)
                    p = jnp.exp(s - lse_t[..., None])
                    if masked:
                        mask = _tile_mask(_slice(q_pos, qs, block_q, 1), kp_t,
                                          _seg_slice(q_seg, qs, block_q), kg_t, causal)
                        p = jnp.where(mask, p, 0.0)
                    dv_t = dv_t + jnp.einsum("bkqgm,bkqgd->bkmd", p, do_t)
                    dp = jnp.einsum("bkqgd,bkmd->bkqgm", do_t, v_t)
                    ds = p * (dp - delta_t[..., None])
                    dq_t = dq_t + jnp.einsum("bkqgm,bkmd->bkqgd", ds, k_t)
                    dk_t = dk_t + jnp.einsum("bkqgm,bkqgd->bkmd", ds, q_t)
                    return dq_t, dk_t, dv_t
                return branch

            dq_t, dk_t, dv_t = lax.cond(cases[i, j] == MASKED, compute(True), compute(False),
                                        (_slice(dq, qs, block_q, 2), dk_t, dv_t))
            return lax.dynamic_update_slice_in_dim(dq, dq_t, qs, axis=2), dk_t, dv_t

        zeros = _zeros(k, dkv_shape)
        dq, dk_t, dv_t = lax.fori_loop(0, counts[j], q_tile, (dq, zeros, zeros))
        return (dq, lax.dynamic_update_slice_in_dim(dk, dk_t, ks, axis=2),
                lax.dynamic_update_slice_in_dim(dv, dv_t, ks, axis=2))

    return lax.fori_loop(0, nk, kv_tile, (dq_BKCGD, _zeros(k), _zeros(k)))


# ----------------------------------------------------------------------------- dense reference


def dense_attention(q, k, v, *, positions=None, segment_ids=None, causal=True):
    """Plain attention in natural order: q ``[B, L, Hq, D]``, k/v ``[B, L, Hkv, D]``.

    Mask: same segment and ``k_pos <= q_pos``. GQA groups query heads per kv head instead of
    repeating K/V. fp32 inside, returns ``q.dtype``. Rows with no visible key return 0.
    """
    b, length, hq, d = q.shape
    hkv = k.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
    q_BKLGD = to_q_major(q.astype(jnp.float32), hkv) * (1.0 / math.sqrt(d))
    k_BKLD = to_kv_major(k.astype(jnp.float32))
    v_BKLD = to_kv_major(v.astype(jnp.float32))
    s = jnp.einsum("bkqgd,bkmd->bkqgm", q_BKLGD, k_BKLD)
    mask = _tile_mask(positions, positions, segment_ids, segment_ids, causal)
    s = jnp.where(mask, s, -jnp.inf)
    m = s.max(-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), lax.stop_gradient(m), 0.0)
    p = jnp.exp(s - m)  # exactly 0 where masked, also for its gradient
    denom = p.sum(-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("bkqgm,bkmd->bkqgd", p, v_BKLD)
    return from_q_major(out).astype(q.dtype)
