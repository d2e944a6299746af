"""What every per-round kernel reads and writes: a K/V block with the true positions of its
tokens, the fp32 online-softmax accumulators of a chunk of queries, and the internal layouts.

Layouts (chosen so that every tile matmul is a plain batched GEMM over (B, K) with the
query-head group folded into the rows, and K/V are never repeated for GQA):

    q_BKCGD  queries, K = kv heads, C = chunk length, G = query heads per kv head
    k_BKCD   keys / values
    m_BKCG   per-row running max (and l, lse, delta)

Rows that have seen no visible key stay harmless: the running max starts at a finite
``M_INIT``, so ``exp(m_old - m_new)`` of such a row is ``exp(0) = 1`` times an all-zero
accumulator instead of ``exp(-inf - -inf) = NaN``; masked scores are -inf, so they contribute
exactly ``exp(-inf) = 0`` whatever the running max is.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

M_INIT = -1e30


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


def kv_block(k_BSKD, v_BSKD, pos_BS, seg_BS) -> KV:
    """Keys/values ``[B, S, K, D]`` (any number of chunks) with their true positions."""
    return KV(to_kv_major(k_BSKD), to_kv_major(v_BSKD), pos_BS, seg_BS)


def zeros(like, shape=None):
    # zeros_like (not zeros) so that inside shard_map the value varies over the same mesh axes
    # as ``like``: loop carries and switch branches must keep one type.
    return jnp.zeros_like(like, dtype=jnp.float32, shape=shape)


def init_acc(q_BKCGD):
    rows = q_BKCGD.shape[:-1]
    return Acc(zeros(q_BKCGD), zeros(q_BKCGD, rows) + M_INIT, zeros(q_BKCGD, rows))


def finalize(acc: Acc):
    """Normalised output ``[B, K, C, G, D]`` (fp32) and the row logsumexp ``[B, K, C, G]``.

    A row that saw no visible key returns 0 and lse = +inf, so that the backward's
    ``exp(s - lse)`` is exactly 0 for it.
    """
    seen = acc.l > 0
    out = acc.o / jnp.where(seen, acc.l, 1.0)[..., None]
    lse = jnp.where(seen, acc.m + jnp.log(jnp.where(seen, acc.l, 1.0)), jnp.inf)
    return out, lse


def with_sink(out, lse, sink):
    """Attention sinks (gpt-oss): a logit per head that joins every row's softmax denominator
    and adds nothing to the output, ``softmax([scores, sink])[:-1] @ V``. Applied once to the
    finished rows (``out [B, K, C, G, D]``, ``lse [B, K, C, G]``), never per round: the output
    shrinks by ``exp(lse - lse')`` with ``lse' = logaddexp(lse, sink)``. The backward then needs
    nothing new: with ``out'`` and ``lse'`` as its residuals, the usual ``exp(s - lse')`` and row
    sums of ``dout * out'`` are the sinked softmax's. A row that saw no key keeps output 0 and
    lse +inf (all its mass on the sink)."""
    seen = jnp.isfinite(lse)
    new = jnp.where(seen, jnp.logaddexp(jnp.where(seen, lse, 0.0), sink), jnp.inf)
    shrink = jnp.where(seen, jnp.exp(jnp.where(seen, lse - new, 0.0)), 0.0)
    return out * shrink[..., None], new


def sink_grad(lse, delta, sink):
    """d loss / d sink per row (``[B, K, C, G]``): ``-p_sink * delta`` with ``p_sink =
    exp(sink - lse')`` (``lse'`` with the sink, +inf for a row that saw no key: 0) and ``delta``
    the row sums of ``dout * out'``."""
    return -jnp.exp(sink - lse) * delta


def merge(acc: Acc, o, lse) -> Acc:
    """Adds a round's normalised output ``o`` and logsumexp (-inf: saw nothing) exactly: a
    round is an accumulator with ``m = lse`` and ``l = 1``."""
    m = jnp.maximum(acc.m, lse)  # finite: acc.m starts at M_INIT
    alpha, beta = jnp.exp(acc.m - m), jnp.exp(lse - m)
    return Acc(acc.o * alpha[..., None] + o * beta[..., None], m, acc.l * alpha + beta)
