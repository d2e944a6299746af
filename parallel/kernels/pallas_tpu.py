"""Fused ring-round attention for TPUs: Pallas, Mosaic backend.

Same contract and layouts as ``pallas_gpu.py``; the schedule is the TPU one: the grid's last
axis steps through the tiles of one row of the visit table, which goes in through scalar
prefetch, so each step's K/V (or Q) tile index comes from the table and its DMA overlaps the
previous step's compute. Steps past the row's range re-point at its last tile (no new DMA)
and compute nothing; fp32 accumulators live in VMEM scratch across the steps.

Positions and segment ids travel as ``[B, C*G, 1]`` (q side, rows on sublanes) and
``[B, 1, Ck]`` (kv side, keys on lanes), so the mask is a broadcast compare in the tile's
own layout; the row statistics (lse, delta) are ``[BK, C*G, 1]``.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from errors import KernelError
from parallel.kernels import flash
from parallel.kernels.spec import RoundSpec, Tile


# ----------------------------------------------------------------------------- tile rules
# (``tiling.py`` fits them to the chunk.) A tile holds ``block_q * G`` rows of the folded queries
# (sublanes: a multiple of 8) and ``block_kv`` keys on lanes (a multiple of 128), unless it is the
# whole chunk. The default keeps about 512 rows whatever the group, in power-of-two positions.

TPU_ROWS, TPU_KV = 512, 512  # q rows (positions x group) and keys per Mosaic tile


def default_tiles(group, head_dim, dtype, arch=None):
    block_q = 1 << max(3, (TPU_ROWS // group).bit_length() - 1)  # a power of two, >= 8
    return (Tile(block_q, TPU_KV),) * 3


def check_tile(names, tile: Tile, group, head_dim, chunk):
    """One-line KernelError unless Mosaic can lay ``tile`` out."""
    (nq, nk), (bq, bk) = names, tile[:2]
    if bk != chunk and bk % 128:
        raise KernelError(f"{nk}={bk}: the Mosaic kernel (pallas_tpu) needs a multiple of 128 "
                          f"dividing the chunk of {chunk} tokens, or the chunk itself")
    if bq != chunk and bq * group % 8:
        raise KernelError(f"{nq}={bq}: the Mosaic kernel (pallas_tpu) needs {nq} x "
                          f"{group} query heads per kv head to be a multiple of 8, or the chunk")


def _row(tbl_ref, b, i, n, kh):
    base = ((b // kh) * n + i) * 4
    return tbl_ref[base], tbl_ref[base + 1], tbl_ref[base + 2], tbl_ref[base + 3]


def _step_tile(tbl_ref, b, i, t, n, kh):
    """The tile visited at step ``t`` of row ``i``: clamped into ``[lo, hi)`` (lo if empty)."""
    lo, _, _, hi = _row(tbl_ref, b, i, n, kh)
    return jnp.minimum(lo + t, jnp.maximum(hi - 1, lo))


def _when_visited(tbl_ref, i, t, n, kh, compute):
    """Runs ``compute(masked)`` if step ``t`` of row ``i`` is in its range."""
    lo, flo, fhi, hi = _row(tbl_ref, pl.program_id(0), i, n, kh)
    j = lo + t
    unmasked = (j >= flo) & (j < fhi)
    pl.when((j < hi) & unmasked)(lambda: compute(False))
    pl.when((j < hi) & ~unmasked)(lambda: compute(True))


def _mask(spec: RoundSpec, masked, qp_ref, kp_ref, qs_ref, ks_ref):
    """The step's visibility mask, or None for a tile the table runs unmasked."""
    if not masked:
        return None
    seg = (qs_ref[...], ks_ref[...]) if spec.has_seg else (None, None)
    return flash.mask(qp_ref[...], kp_ref[...], seg[0], seg[1], spec.causal, spec.window)


def _split(refs, has_seg):
    return (refs[0], refs[1], refs[2:]) if has_seg else (None, None, refs)


def _call(kernel, spec: RoundSpec, grid, in_specs, out_specs, out_shape, scratch, args, name):
    grid_spec = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=grid, in_specs=in_specs,
                                             out_specs=out_specs, scratch_shapes=scratch)
    extra = {"interpret": True} if spec.interpret else {"compiler_params": pltpu.CompilerParams(
        dimension_semantics=("parallel", "parallel", "arbitrary"))}
    return pl.pallas_call(kernel, grid_spec=grid_spec, out_shape=out_shape, name=name,
                          **extra)(*args)


def _columns(x):
    return x[..., None]


def _lanes(x_BC):
    return x_BC[:, None, :]


class _Blocks:
    """The BlockSpecs of one kernel, from where a grid step ``(b, outer, t)`` finds its q tile
    and its kv tile (``q_at`` / ``kv_at``: ``(tbl, b, outer, t) -> tile index``)."""

    def __init__(self, spec: RoundSpec, tile: Tile, d, q_at, kv_at):
        r, bkv, kh = tile.block_q * spec.group, tile.block_kv, spec.kv_heads
        self.rows = pl.BlockSpec((None, r, d), lambda b, o, t, tbl: (b, q_at(tbl, b, o, t), 0))
        self.row_stat = pl.BlockSpec((None, r, 1), lambda b, o, t, tbl: (b, q_at(tbl, b, o, t), 0))
        self.kv = pl.BlockSpec((None, bkv, d), lambda b, o, t, tbl: (b, kv_at(tbl, b, o, t), 0))
        self.q_col = pl.BlockSpec((None, r, 1), lambda b, o, t, tbl: (b // kh, q_at(tbl, b, o, t), 0))
        self.k_lane = pl.BlockSpec((None, 1, bkv), lambda b, o, t, tbl: (b // kh, 0, kv_at(tbl, b, o, t)))

    def inputs(self, spec, table, q, k, v, q_pos, k_pos, q_seg, k_seg, bwd=()):
        """(in_specs, args): q, k, v, [do, lse, delta], positions, [segment ids]."""
        specs = [self.rows, self.kv, self.kv]
        args = [table.reshape(-1), q, k, v]
        if bwd:
            do, lse, delta = bwd
            specs += [self.rows, self.row_stat, self.row_stat]
            args += [do, _columns(lse), _columns(delta)]
        specs += [self.q_col, self.k_lane]
        args += [_columns(q_pos), _lanes(k_pos)]
        if spec.has_seg:
            specs += [self.q_col, self.k_lane]
            args += [_columns(q_seg), _lanes(k_seg)]
        return specs, args


def _outer(tbl, b, o, t):
    return o


# ----------------------------------------------------------------------------- forward


def _fwd_kernel(tbl_ref, q_ref, k_ref, v_ref, qp_ref, kp_ref, *refs, spec: RoundSpec, nq, nk):
    qs_ref, ks_ref, (o_ref, lse_ref, o_acc, m_acc, l_acc) = _split(refs, spec.has_seg)
    i, t = pl.program_id(1), pl.program_id(2)

    @pl.when(t == 0)
    def _():
        o_acc[...], m_acc[...], l_acc[...] = flash.fwd_init(*o_acc.shape)

    def compute(masked):
        vis = _mask(spec, masked, qp_ref, kp_ref, qs_ref, ks_ref)
        o_acc[...], m_acc[...], l_acc[...] = flash.fwd_update(
            (o_acc[...], m_acc[...], l_acc[...]), q_ref[...], k_ref[...], v_ref[...], spec.scale, vis)

    _when_visited(tbl_ref, i, t, nq, spec.kv_heads, compute)

    @pl.when(t == nk - 1)
    def _():
        o_ref[...], lse_ref[...] = flash.fwd_finish(o_acc[...], m_acc[...], l_acc[...])


def forward(spec: RoundSpec, table, q, k, v, q_pos, k_pos, q_seg=None, k_seg=None):
    bk_, rows, d = q.shape
    r = spec.fwd.block_q * spec.group
    nq, nk = rows // r, k.shape[1] // spec.fwd.block_kv
    blocks = _Blocks(spec, spec.fwd, d, _outer, functools.partial(_step_tile, n=nq, kh=spec.kv_heads))
    in_specs, args = blocks.inputs(spec, table, q, k, v, q_pos, k_pos, q_seg, k_seg)
    out_shape = (jax.ShapeDtypeStruct((bk_, rows, d), jnp.float32),
                 jax.ShapeDtypeStruct((bk_, rows, 1), jnp.float32))
    scratch = [pltpu.VMEM((r, d), jnp.float32), pltpu.VMEM((r, 1), jnp.float32),
               pltpu.VMEM((r, 1), jnp.float32)]
    o, lse = _call(functools.partial(_fwd_kernel, spec=spec, nq=nq, nk=nk), spec, (bk_, nq, nk),
                   in_specs, (blocks.rows, blocks.row_stat), out_shape, scratch, args,
                   "ring_round_fwd")
    return o, lse[..., 0]


# ----------------------------------------------------------------------------- backward


def _dq_kernel(tbl_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qp_ref, kp_ref, *refs,
               spec: RoundSpec, nq, nk):
    qs_ref, ks_ref, (dq_ref, dq_acc) = _split(refs, spec.has_seg)
    i, t = pl.program_id(1), pl.program_id(2)

    @pl.when(t == 0)
    def _():
        dq_acc[...] = jnp.zeros(dq_acc.shape, jnp.float32)

    def compute(masked):
        vis = _mask(spec, masked, qp_ref, kp_ref, qs_ref, ks_ref)
        k = k_ref[...]
        p = flash.probs(q_ref[...], k, lse_ref[...], spec.scale, vis)
        ds = flash.grad_scores(p, do_ref[...], v_ref[...], delta_ref[...])
        dq_acc[...] = flash.dq_update(dq_acc[...], ds, k)

    _when_visited(tbl_ref, i, t, nq, spec.kv_heads, compute)

    @pl.when(t == nk - 1)
    def _():
        dq_ref[...] = dq_acc[...]


def backward_dq(spec: RoundSpec, table, q, k, v, do, lse, delta, q_pos, k_pos, q_seg=None,
                k_seg=None):
    """dQ contribution of one round, not yet multiplied by the softmax scale: ``[BK, Cq*G, D]``."""
    bk_, rows, d = q.shape
    r = spec.dq.block_q * spec.group
    nq, nk = rows // r, k.shape[1] // spec.dq.block_kv
    blocks = _Blocks(spec, spec.dq, d, _outer, functools.partial(_step_tile, n=nq, kh=spec.kv_heads))
    in_specs, args = blocks.inputs(spec, table, q, k, v, q_pos, k_pos, q_seg, k_seg, (do, lse, delta))
    return _call(functools.partial(_dq_kernel, spec=spec, nq=nq, nk=nk), spec, (bk_, nq, nk),
                 in_specs, blocks.rows, jax.ShapeDtypeStruct((bk_, rows, d), jnp.float32),
                 [pltpu.VMEM((r, d), jnp.float32)], args, "ring_round_dq")


def _dkv_kernel(tbl_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qp_ref, kp_ref, *refs,
                spec: RoundSpec, nq, nk):
    qs_ref, ks_ref, (dk_ref, dv_ref, dk_acc, dv_acc) = _split(refs, spec.has_seg)
    j, t = pl.program_id(1), pl.program_id(2)

    @pl.when(t == 0)
    def _():
        dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
        dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

    def compute(masked):
        vis = _mask(spec, masked, qp_ref, kp_ref, qs_ref, ks_ref)
        q, do = q_ref[...], do_ref[...]
        p = flash.probs(q, k_ref[...], lse_ref[...], spec.scale, vis)
        ds = flash.grad_scores(p, do, v_ref[...], delta_ref[...])
        dk_acc[...], dv_acc[...] = flash.dkv_update(dk_acc[...], dv_acc[...], p, ds, q, do)

    _when_visited(tbl_ref, j, t, nk, spec.kv_heads, compute)

    @pl.when(t == nq - 1)
    def _():
        dk_ref[...] = dk_acc[...] * spec.scale
        dv_ref[...] = dv_acc[...]


def backward_dkv(spec: RoundSpec, table, q, k, v, do, lse, delta, q_pos, k_pos, q_seg=None,
                 k_seg=None):
    """dK (w.r.t. the unscaled keys) and dV of one round: two fp32 ``[BK, Ck, D]``."""
    bk_, rows, d = q.shape
    ck = k.shape[1]
    nq, nk = rows // (spec.dkv.block_q * spec.group), ck // spec.dkv.block_kv
    blocks = _Blocks(spec, spec.dkv, d, functools.partial(_step_tile, n=nk, kh=spec.kv_heads),
                     _outer)
    in_specs, args = blocks.inputs(spec, table, q, k, v, q_pos, k_pos, q_seg, k_seg, (do, lse, delta))
    out = jax.ShapeDtypeStruct((bk_, ck, d), jnp.float32)
    scratch = [pltpu.VMEM((spec.dkv.block_kv, d), jnp.float32)] * 2
    return _call(functools.partial(_dkv_kernel, spec=spec, nq=nq, nk=nk), spec, (bk_, nk, nq),
                 in_specs, (blocks.kv, blocks.kv), (out, out), scratch, args, "ring_round_dkv")
