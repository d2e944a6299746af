"""A fused (Pallas) kernel as one ring round: fold the layouts, call the kernel, merge rounds.

The per-round interface (``parallel/kernels/__init__.py``) of every fused kernel in the
registry: ``spec.kernel`` names the module that implements ``forward``/``backward_dq``/
``backward_dkv`` over visit tables (``tables.py``). The strategies keep the fp32 accumulators
of ``accumulators.py`` (numerator, running max, denominator); a fused forward returns one
round's normalised output and logsumexp, which merge into them exactly
(``accumulators.merge``). A round whose visit table is empty is skipped whole (no kernel
launch). One call holds one chunk of queries and one of keys (``ANY_CHUNKS``), so that the
positions inside each side increase and the visit table is exact work.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from parallel import kernels
from parallel.kernels import accumulators as ac
from parallel.kernels import tables
from parallel.kernels.spec import RoundSpec, Tile

ANY_CHUNKS = False


class Query(NamedTuple):
    """This device's queries in the fused kernels' layout (rows ``c * G + g``)."""

    q: jax.Array  # [B*K, C*G, D] input dtype, unscaled
    pos_rows: jax.Array  # [B, C*G] int32
    seg_rows: jax.Array | None  # [B, C*G] int32
    pos: jax.Array  # [B, C] int32: for the visit tables
    seg: jax.Array | None


def _backend(spec: RoundSpec):
    return kernels.module(spec.kernel)


def fold_rows(x_BKCG):
    """``[B, K, C, G, ...] -> [B*K, C*G, ...]`` (a reshape: no copy)."""
    b, k, c, g = x_BKCG.shape[:4]
    return x_BKCG.reshape(b * k, c * g, *x_BKCG.shape[4:])


def fold_kv(x_BKCD):
    b, k = x_BKCD.shape[:2]
    return x_BKCD.reshape(b * k, *x_BKCD.shape[2:])


def prepare(q_BCHD, pos_BC, seg_BC, spec: RoundSpec) -> Query:
    q_BKCGD = ac.to_q_major(q_BCHD, spec.kv_heads)
    rep = lambda x: None if x is None else jnp.repeat(x, spec.group, axis=1)
    return Query(fold_rows(q_BKCGD), rep(pos_BC), rep(seg_BC), pos_BC, seg_BC)


def _visits(spec, tile: Tile, query: Query, kv: ac.KV):
    return tables.visits(query.pos, kv.pos, query.seg, kv.seg, block_q=tile.block_q,
                         block_kv=tile.block_kv, causal=spec.causal, window=spec.window)


def attend(spec: RoundSpec, query: Query, kv: ac.KV, acc: ac.Acc) -> ac.Acc:
    """Folds one arriving K/V block into the accumulators (``[B, K, C, G, ...]`` fp32)."""
    t = _visits(spec, spec.fwd, query, kv)

    def run(acc):
        o, lse = _backend(spec).forward(spec, t.by_q, query.q, fold_kv(kv.k), fold_kv(kv.v),
                                        query.pos_rows, kv.pos, query.seg_rows, kv.seg)
        return ac.merge(acc, o.reshape(acc.o.shape), lse.reshape(acc.m.shape))

    return lax.cond(t.any, run, lambda acc: acc, acc)


def grads(spec: RoundSpec, query: Query, kv: ac.KV, do_f, lse_f, delta_f, dq_BKCGD):
    """One round of the backward: ``dq`` (accumulated, unscaled, ``[B, K, C, G, D]``) and this
    block's ``dk``/``dv`` ``[B, K, Ck, D]`` fp32. ``do_f``/``lse_f``/``delta_f`` are folded."""
    t_dq = _visits(spec, spec.dq, query, kv)
    t_dkv = t_dq if spec.dkv[:2] == spec.dq[:2] else _visits(spec, spec.dkv, query, kv)
    k, v = fold_kv(kv.k), fold_kv(kv.v)
    args = (query.q, k, v, do_f, lse_f, delta_f, query.pos_rows, kv.pos, query.seg_rows, kv.seg)
    zeros = jnp.zeros_like(kv.k, dtype=jnp.float32)

    def run(dq):
        be = _backend(spec)
        dq = dq + be.backward_dq(spec, t_dq.by_q, *args).reshape(dq.shape)
        dk, dv = be.backward_dkv(spec, t_dkv.by_kv, *args)
        return dq, dk.reshape(zeros.shape), dv.reshape(zeros.shape)

    return lax.cond(t_dq.any, run, lambda dq: (dq, zeros, zeros), dq_BKCGD)


# ----------------------------------------------------------------------------- round interface


def queries(spec: RoundSpec, q_BSHD, pos_BS, seg_BS) -> Query:
    return prepare(q_BSHD, pos_BS, seg_BS, spec)


def grad_queries(spec: RoundSpec, q_BSHD, pos_BS, seg_BS, do_BKSGD, lse_BKSG, delta_BKSG):
    """The backward's queries: the kernel reads ``do`` in the input dtype, folded like q."""
    return (prepare(q_BSHD, pos_BS, seg_BS, spec), fold_rows(do_BKSGD), fold_rows(lse_BKSG),
            fold_rows(delta_BKSG))


def attend_grads(spec: RoundSpec, query, kv: ac.KV, dq_BKCGD):
    prep, do_f, lse_f, delta_f = query
    return grads(spec, prep, kv, do_f, lse_f, delta_f, dq_BKCGD)
