"""The tile math every fused kernel shares (values already loaded from refs, fp32 accumulators).

Row conventions match ``accumulators.py``: the running max starts at a finite ``M_INIT`` and
masked scores are -inf, so a row that has seen no visible key keeps an all-zero accumulator and
never produces NaN; a round's logsumexp is natural log and -inf for such a row. The backward
takes the global logsumexp (+inf for a row with no visible key at all: ``exp(s - lse) = 0``).
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from parallel.kernels.accumulators import M_INIT

_NT = (((1,), (1,)), ((), ()))  # a [m, d] . b [n, d] -> [m, n]
_TN = (((0,), (0,)), ((), ()))  # a [m, n] . b [m, d] -> [n, d]
_NN = (((1,), (0,)), ((), ()))  # a [m, n] . b [n, d] -> [m, d]


def _dot(a, b, dims):
    # fp32 inputs get full precision (a GPU would otherwise round them to TF32); bf16 and fp16
    # feed the tensor cores / MXU and accumulate in fp32 either way.
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def mask(q_pos, k_pos, q_seg, k_seg, causal, window=0):
    """Visibility ``[R, bk]`` from ``q_pos [R, 1]``, ``k_pos [1, bk]`` (segment ids alike or None);
    ``window`` > 0: also ``k_pos > q_pos - window`` (``predicate.visible``'s sliding window)."""
    vis = (k_pos <= q_pos) if causal else None
    if window:
        vis = vis & (k_pos > q_pos - window)
    if q_seg is not None:
        same = k_seg == q_seg
        vis = same if vis is None else vis & same
    return vis


def scores(q, k, scale, vis):
    s = _dot(q, k, _NT) * scale
    return s if vis is None else jnp.where(vis, s, -jnp.inf)


def fwd_update(carry, q, k, v, scale, vis):
    """One kv tile into ``(o [R, D], m [R, 1], l [R, 1])``."""
    o, m, l = carry
    s = scores(q, k, scale, vis)
    m_new = jnp.maximum(m, s.max(-1, keepdims=True))
    p = jnp.exp(s - m_new)
    alpha = jnp.exp(m - m_new)
    o = o * alpha + _dot(p.astype(v.dtype), v, _NN)
    return o, m_new, l * alpha + p.sum(-1, keepdims=True)


def fwd_init(rows, d):
    return (jnp.zeros((rows, d), jnp.float32), jnp.full((rows, 1), M_INIT, jnp.float32),
            jnp.zeros((rows, 1), jnp.float32))


def fwd_finish(o, m, l):
    """Normalised output and the natural-log lse ``[R, 1]`` (-inf where nothing was seen)."""
    seen = l > 0
    safe = jnp.where(seen, l, 1.0)
    return o / safe, jnp.where(seen, m + jnp.log(safe), -jnp.inf)


def probs(q, k, lse, scale, vis):
    """Softmax probabilities of one tile from the global ``lse [R, 1]``."""
    p = jnp.exp(_dot(q, k, _NT) * scale - lse)
    return p if vis is None else jnp.where(vis, p, 0.0)


def grad_scores(p, do, v, delta):
    """dS of one tile (w.r.t. the scaled scores): ``p * (dO V^T - delta)``."""
    return p * (_dot(do, v, _NT) - delta)


def dq_update(dq, ds, k):
    return dq + _dot(ds.astype(k.dtype), k, _NN)


def dkv_update(dk, dv, p, ds, q, do):
    return dk + _dot(ds.astype(q.dtype), q, _TN), dv + _dot(p.astype(do.dtype), do, _TN)
