"""Fused ring-round attention for GPUs: Pallas, Triton backend.

One program per (q tile, batch x kv head) in the forward and dQ kernels, per (kv tile,
batch x kv head) in the dK/dV kernel. Each program loops over exactly the tiles of its row of
the visit table (``parallel/kernels/tables.py``): masked ``[lo, flo)``, unmasked
``[flo, fhi)``, masked ``[fhi, hi)``. GQA: the query heads of one kv head are folded into the
rows of a q tile (``R = block_q * G`` rows), so K/V are never repeated.

Array layouts (``BK`` = batch x kv heads, rows ``r = c * G + g``):
    q, do, o   [BK, Cq*G, D]     lse, delta  [BK, Cq*G]     k, v  [BK, Ck, D]
    q_pos/q_seg [B, Cq*G]        k_pos/k_seg [B, Ck]        tables [B, n, 4]
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from parallel.kernels import flash
from parallel.kernels.spec import RoundSpec


def _params(spec: RoundSpec):
    if spec.interpret:
        return {"interpret": True}
    from jax.experimental.pallas import triton as plgpu
    warps = 4 if spec.head_dim <= 64 else 8
    return {"compiler_params": plgpu.CompilerParams(num_warps=warps, num_stages=2)}


def _three_ranges(t_ref, body, carry):
    lo, flo, fhi, hi = t_ref[0], t_ref[1], t_ref[2], t_ref[3]
    carry = lax.fori_loop(lo, flo, body(True), carry)
    carry = lax.fori_loop(flo, fhi, body(False), carry)
    return lax.fori_loop(fhi, hi, body(True), carry)


def _kv_mask(spec: RoundSpec, masked, qp, qs, kp_ref, ks_ref, sl):
    """Visibility of the program's q rows against kv slice ``sl``, or None when unmasked."""
    if not masked:
        return None
    ks = ks_ref[sl][None, :] if spec.has_seg else None
    return flash.mask(qp, kp_ref[sl][None, :], qs, ks, spec.causal)


def _seg_refs(refs, has_seg):
    """The refs after the fixed inputs: ``(q_seg, k_seg, *outputs)`` or just the outputs."""
    return (refs[0], refs[1], refs[2:]) if has_seg else (None, None, refs)


class _Blocks:
    """The BlockSpecs of one kernel on grid ``(outer, b)``: the outer axis walks q tiles
    (forward, dQ: the whole kv chunk per program) or kv tiles (dK/dV: all the q rows)."""

    def __init__(self, spec: RoundSpec, rows, ck, d, outer_is_q: bool):
        kh = spec.kv_heads
        qb, kb = (spec.block_q * spec.group, ck) if outer_is_q else (rows, spec.block_kv)
        qi = (lambda o: o) if outer_is_q else (lambda o: 0)
        ki = (lambda o: 0) if outer_is_q else (lambda o: o)
        self.grid_outer = rows // qb if outer_is_q else ck // kb
        self.table = pl.BlockSpec((None, None, 4), lambda o, b: (b // kh, o, 0))
        self.rows = pl.BlockSpec((None, qb, d), lambda o, b: (b, qi(o), 0))
        self.row_stat = pl.BlockSpec((None, qb), lambda o, b: (b, qi(o)))
        self.kv = pl.BlockSpec((None, kb, d), lambda o, b: (b, ki(o), 0))
        self.q_vec = pl.BlockSpec((None, qb), lambda o, b: (b // kh, qi(o)))
        self.k_vec = pl.BlockSpec((None, kb), lambda o, b: (b // kh, ki(o)))

    def inputs(self, spec, table, q, k, v, q_pos, k_pos, q_seg, k_seg, bwd=()):
        """(in_specs, args): table, q, k, v, [do, lse, delta], positions, [segment ids]."""
        specs, args = [self.table, self.rows, self.kv, self.kv], [table, q, k, v]
        if bwd:
            specs += [self.rows, self.row_stat, self.row_stat]
            args += list(bwd)
        specs += [self.q_vec, self.k_vec]
        args += [q_pos, k_pos]
        if spec.has_seg:
            specs += [self.q_vec, self.k_vec]
            args += [q_seg, k_seg]
        return specs, args


# ----------------------------------------------------------------------------- forward


def _fwd_kernel(t_ref, q_ref, k_ref, v_ref, qp_ref, kp_ref, *refs, spec: RoundSpec):
    qs_ref, ks_ref, (o_ref, lse_ref) = _seg_refs(refs, spec.has_seg)
    q = q_ref[...]
    qp = qp_ref[...][:, None]
    qs = qs_ref[...][:, None] if spec.has_seg else None
    bk = spec.block_kv

    def body(masked):
        def step(j, carry):
            sl = pl.ds(pl.multiple_of(j * bk, bk), bk)
            vis = _kv_mask(spec, masked, qp, qs, kp_ref, ks_ref, sl)
            return flash.fwd_update(carry, q, k_ref[sl, :], v_ref[sl, :], spec.scale, vis)
        return step

    o, m, l = _three_ranges(t_ref, body, flash.fwd_init(q.shape[0], q.shape[1]))
    o, lse = flash.fwd_finish(o, m, l)
    o_ref[...] = o
    lse_ref[...] = lse[:, 0]


def forward(spec: RoundSpec, table, q, k, v, q_pos, k_pos, q_seg=None, k_seg=None):
    bk_, rows, d = q.shape
    blocks = _Blocks(spec, rows, k.shape[1], d, outer_is_q=True)
    in_specs, args = blocks.inputs(spec, table, q, k, v, q_pos, k_pos, q_seg, k_seg)
    out_shape = (jax.ShapeDtypeStruct((bk_, rows, d), jnp.float32),
                 jax.ShapeDtypeStruct((bk_, rows), jnp.float32))
    return pl.pallas_call(functools.partial(_fwd_kernel, spec=spec), grid=(blocks.grid_outer, bk_),
                          in_specs=in_specs, out_specs=(blocks.rows, blocks.row_stat),
                          out_shape=out_shape, name="ring_round_fwd", **_params(spec))(*args)


# ----------------------------------------------------------------------------- backward


def _dq_kernel(t_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qp_ref, kp_ref, *refs,
               spec: RoundSpec):
    qs_ref, ks_ref, (dq_ref,) = _seg_refs(refs, spec.has_seg)
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...][:, None], delta_ref[...][:, None]
    qp = qp_ref[...][:, None]
    qs = qs_ref[...][:, None] if spec.has_seg else None
    bk = spec.block_kv

    def body(masked):
        def step(j, dq):
            sl = pl.ds(pl.multiple_of(j * bk, bk), bk)
            vis = _kv_mask(spec, masked, qp, qs, kp_ref, ks_ref, sl)
            k = k_ref[sl, :]
            p = flash.probs(q, k, lse, spec.scale, vis)
            return flash.dq_update(dq, flash.grad_scores(p, do, v_ref[sl, :], delta), k)
        return step

    dq_ref[...] = _three_ranges(t_ref, body, jnp.zeros(q.shape, jnp.float32))


def backward_dq(spec: RoundSpec, table, q, k, v, do, lse, delta, q_pos, k_pos, q_seg=None,
                k_seg=None):
    """dQ contribution of one round, not yet multiplied by the softmax scale: ``[BK, Cq*G, D]``."""
    bk_, rows, d = q.shape
    blocks = _Blocks(spec, rows, k.shape[1], d, outer_is_q=True)
    in_specs, args = blocks.inputs(spec, table, q, k, v, q_pos, k_pos, q_seg, k_seg, (do, lse, delta))
    return pl.pallas_call(
        functools.partial(_dq_kernel, spec=spec), grid=(blocks.grid_outer, bk_), in_specs=in_specs,
        out_specs=blocks.rows, out_shape=jax.ShapeDtypeStruct((bk_, rows, d), jnp.float32),
        name="ring_round_dq", **_params(spec))(*args)


def _dkv_kernel(t_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qp_ref, kp_ref, *refs,
                spec: RoundSpec):
    qs_ref, ks_ref, (dk_ref, dv_ref) = _seg_refs(refs, spec.has_seg)
    k, v = k_ref[...], v_ref[...]
    kp = kp_ref[...][None, :]
    ks = ks_ref[...][None, :] if spec.has_seg else None
    r = spec.block_q * spec.group

    def body(masked):
        def step(i, carry):
            sl = pl.ds(pl.multiple_of(i * r, r), r)
            vis = None if not masked else flash.mask(
                qp_ref[sl][:, None], kp, qs_ref[sl][:, None] if spec.has_seg else None, ks, spec.causal)
            q, do = q_ref[sl, :], do_ref[sl, :]
            p = flash.probs(q, k, lse_ref[sl][:, None], spec.scale, vis)
            ds = flash.grad_scores(p, do, v, delta_ref[sl][:, None])
            return flash.dkv_update(*carry, p, ds, q, do)
        return step

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = _three_ranges(t_ref, body, (zeros, zeros))
    dk_ref[...] = dk * spec.scale
    dv_ref[...] = dv


def backward_dkv(spec: RoundSpec, table, q, k, v, do, lse, delta, q_pos, k_pos, q_seg=None,
                 k_seg=None):
    """dK (w.r.t. the unscaled keys) and dV of one round: two fp32 ``[BK, Ck, D]``."""
    bk_, rows, d = q.shape
    ck = k.shape[1]
    blocks = _Blocks(spec, rows, ck, d, outer_is_q=False)
    in_specs, args = blocks.inputs(spec, table, q, k, v, q_pos, k_pos, q_seg, k_seg, (do, lse, delta))
    out = jax.ShapeDtypeStruct((bk_, ck, d), jnp.float32)
    return pl.pallas_call(
        functools.partial(_dkv_kernel, spec=spec), grid=(blocks.grid_outer, bk_), in_specs=in_specs,
        out_specs=(blocks.kv, blocks.kv), out_shape=(out, out), name="ring_round_dkv",
        **_params(spec))(*args)
