"""Fused ring-round attention for GPUs: Pallas, Triton backend.

One program per (q tile, query head, batch x kv head) in the forward and dQ kernels; one per
(kv tile, batch x kv head) in the dK/dV kernel, which loops over the query heads of its kv head.
Each program visits exactly the tiles of its row of the visit table
(``parallel/kernels/tables.py``): masked ``[lo, flo)``, unmasked ``[flo, fhi)``, masked
``[fhi, hi)``.

GQA: the queries arrive folded by kv head (rows ``c * G + g``: ``fused.prepare``; K/V are never
repeated) and are read here as ``[BK, Cq, G, D]``, a program taking one query head's rows at
stride G. A tile of ``block_q * G`` folded rows would have to be a power of two (Triton's rule
for every in-kernel array), which it never is for G = 3, 5, 6, 7, ...; padding the group to a
power of two would compute up to 60% dummy rows (G = 5 -> 8) and copy q, dO and the row
statistics every round. Per-head programs do no extra arithmetic and make the tile independent
of G, so one table of default tiles (``GPU_TILES``) serves every model; the G programs of a kv
head re-read the same K/V tiles, from L2 (they run together: the grid's fastest axes are the q
tile and the head).

Array layouts (``BK`` = batch x kv heads; ``(C, G)`` is a view of the folded rows ``C*G``):
    q, do, o   [BK, Cq, G, D]    lse, delta  [BK, Cq, G]    k, v  [BK, Ck, D]
    q_pos/q_seg [B, Cq, G]       k_pos/k_seg [B, Ck]        tables [B, n, 4]
"""
from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from errors import KernelError
from parallel.kernels import flash
from parallel.kernels.spec import RoundSpec, Tile

# JAX >= 0.11 warns at every Triton kernel it lowers (dozens a step); train.py says it once, in
# its startup line (training/loop.kernel_note). Tested on JAX 0.11.2 (an H200) and 0.12.0.1.
TRITON_DEPRECATED = tuple(int(x) for x in jax.__version__.split(".")[:2]) >= (0, 11)
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated",
                        category=DeprecationWarning)


# ----------------------------------------------------------------------------- tile rules
# (``tiling.py`` fits them to the chunk.) Triton sizes every in-kernel array to a power of two and
# its dots want 16 or more per side, so tiles and the head dim are powers of two >= 16. A program
# holds one query head, so the tile does not depend on the group. The defaults are per
# architecture, head dim and dtype, and may differ between the forward, dQ and dK/dV kernels:
# each is the largest tile, then warps and stages, that compiles with no register spill and
# within the arch's shared memory.

TRITON_MIN = 16  # the smallest side of a Triton dot

# Shared memory a block may use (the opt-in maximum), bytes: A100 (sm_80); the other Amperes
# and Ada, e.g. A10, L4, RTX 4090 (sm_86 / sm_89: the sm_86 row); H100 / H200 (sm_90).
SMEM_LIMIT = {"sm_80": 166_912, "sm_86": 101_376, "sm_90": 232_448}

# (arch, head_dim) -> (forward, dQ, dK/dV) tiles: Tile(block_q, block_kv, num_warps, num_stages).
# Chosen by
#     python scripts/gpu_compile.py --sweep --arch sm_80,sm_86,sm_90 --dtypes bfloat16
# (planning/tile_sweep.py: every candidate compiled for the arch by the triton package; the
# largest tile, then warps, then stages, with and without segment ids, for groups 1, 4 and 7,
# with no spill, 8 KiB under SMEM_LIMIT and with tensor-core instructions). fp16 compiles the
# same (python scripts/gpu_compile.py reports every default clean). fp32 inputs halve the tiles,
# unswept: full-precision fp32 dots have no tensor cores and still spill at these tiles
# (--dtypes float32 shows it); fp32 is no GPU training dtype here (model.dtype=auto is bf16).
GPU_TILES = {
    ("sm_90", 64): (Tile(128, 128, 8, 3), Tile(128, 128, 8, 3), Tile(128, 64, 8, 3)),
    ("sm_90", 128): (Tile(128, 128, 8, 2), Tile(128, 64, 8, 3), Tile(128, 64, 8, 1)),
    ("sm_90", 256): (Tile(64, 32, 8, 3), Tile(64, 32, 8, 3), Tile(128, 16, 8, 2)),
    ("sm_80", 64): (Tile(128, 128, 8, 3), Tile(128, 64, 8, 3), Tile(128, 32, 4, 2)),
    ("sm_80", 128): (Tile(64, 128, 8, 2), Tile(64, 128, 8, 2), Tile(128, 64, 8, 2)),
    ("sm_80", 256): (Tile(32, 128, 8, 2), Tile(64, 64, 8, 2), Tile(64, 32, 8, 2)),
    ("sm_86", 64): (Tile(128, 128, 8, 3), Tile(128, 64, 8, 3), Tile(128, 32, 4, 3)),
    ("sm_86", 128): (Tile(64, 128, 8, 1), Tile(64, 128, 8, 1), Tile(64, 64, 8, 2)),
    ("sm_86", 256): (Tile(64, 64, 8, 1), Tile(64, 16, 8, 2), Tile(16, 64, 8, 2)),
}


def device_arch(device=None) -> str:
    """The ``GPU_TILES`` architecture of a device, from its compute capability: sm_80 for 8.0,
    sm_86 for the other 8.x, sm_90 for 9.0 and above and when there is none (a CPU: interpret
    mode, or an export)."""
    cc = getattr(device, "compute_capability", None)
    if not cc or float(cc) >= 9:
        return "sm_90"
    return "sm_80" if float(cc) == 8.0 else "sm_86"


def default_tiles(group, head_dim, dtype, arch=None):
    """The ``GPU_TILES`` row of ``arch`` (None: sm_90) for the nearest head dim at or above
    ``head_dim`` (else the largest); fp32 inputs hold twice the bytes per operand: half the
    tiles (a guess the sweep has not made)."""
    dims = sorted({d for (_, d) in GPU_TILES})
    row = GPU_TILES[(arch or "sm_90", next((x for x in dims if x >= head_dim), dims[-1]))]
    if dtype in ("bfloat16", "float16"):
        return row
    return tuple(t._replace(block_q=max(TRITON_MIN, t.block_q // 2),
                            block_kv=max(TRITON_MIN, t.block_kv // 2)) for t in row)


def _pow2(n):
    return n >= 1 and n & (n - 1) == 0


def check_tile(names, tile: Tile, group, head_dim, chunk):
    """One-line KernelError unless Triton can compile ``tile`` and the head dim."""
    valid = f"powers of two >= {TRITON_MIN} dividing the chunk of {chunk} tokens"
    for name, b in zip(names, tile[:2]):
        if not (_pow2(b) and b >= TRITON_MIN):
            raise KernelError(f"{name}={b}: the Triton kernel (pallas_gpu) needs {valid}")
    if not (_pow2(head_dim) and head_dim >= TRITON_MIN):
        raise KernelError(f"head dim {head_dim} (model.head_dim, or d_model / num_heads): the "
                          f"Triton kernel (pallas_gpu) needs a power of two >= {TRITON_MIN}; "
                          f"use attention.kernel=xla")


def _params(spec: RoundSpec, tile: Tile):
    if spec.interpret:
        return {"interpret": True}
    from jax.experimental.pallas import triton as plgpu
    return {"compiler_params": plgpu.CompilerParams(num_warps=tile.num_warps,
                                                    num_stages=tile.num_stages)}


def _three_ranges(t_ref, body, carry, scale=1):
    """Runs ``body(masked)`` over the row's three ranges, each stretched ``scale`` times."""
    lo, flo, fhi, hi = (t_ref[i] * scale for i in range(4))
    carry = lax.fori_loop(lo, flo, body(True), carry)
    carry = lax.fori_loop(flo, fhi, body(False), carry)
    return lax.fori_loop(fhi, hi, body(True), carry)


def _seg_refs(refs, has_seg):
    """The refs after the fixed inputs: ``(q_seg, k_seg, *outputs)`` or just the outputs."""
    return (refs[0], refs[1], refs[2:]) if has_seg else (None, None, refs)


def _heads(x, g):
    """``[BK, C*G, ...] -> [BK, C, G, ...]`` (a reshape: no copy)."""
    return x.reshape(x.shape[0], x.shape[1] // g, g, *x.shape[2:])


def _fold(x):
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


class _Blocks:
    """The BlockSpecs of one kernel. Forward / dQ: grid ``(q tile, head, bk)``, a program's q
    rows are one head's tile, its keys the whole kv chunk. dK/dV: grid ``(kv tile, bk)``, every
    q row of the bk's heads."""

    def __init__(self, spec: RoundSpec, tile: Tile, q_BKCGD, ck, per_q_tile: bool):
        bk_, cq, g, d = q_BKCGD.shape
        kh, self.params = spec.kv_heads, _params(spec, tile)
        if per_q_tile:
            self.grid = (cq // tile.block_q, g, bk_)
            q_block, kb = (None, tile.block_q, None), ck
            qi, ki = (lambda o, h, b: (b, o, h)), (lambda o, h, b: (b, 0))
        else:
            self.grid = (ck // tile.block_kv, bk_)
            q_block, kb = (None, cq, g), tile.block_kv
            qi, ki = (lambda o, b: (b, 0, 0)), (lambda o, b: (b, o))
        batch = lambda f: lambda *a: (a[-1] // kh, *f(*a)[1:])  # the b of batch x kv head
        self.table = pl.BlockSpec((None, None, 4), lambda *a: (a[-1] // kh, a[0], 0))
        self.rows = pl.BlockSpec((*q_block, d), lambda *a: (*qi(*a), 0))
        self.row_stat = pl.BlockSpec(q_block, qi)
        self.kv = pl.BlockSpec((None, kb, d), lambda *a: (*ki(*a), 0))
        self.q_vec = pl.BlockSpec(q_block, batch(qi))
        self.k_vec = pl.BlockSpec((None, kb), batch(ki))

    def call(self, kernel, ins, out_specs, out_shape, name):
        """``ins``: the (in_spec, arg) pairs of :func:`_inputs`."""
        specs, args = zip(*ins)
        return pl.pallas_call(kernel, grid=self.grid, in_specs=list(specs), out_specs=out_specs,
                              out_shape=out_shape, name=name, **self.params)(*args)


def _inputs(blocks, spec, table, q_BKCGD, k, v, q_pos, k_pos, q_seg, k_seg, bwd=()):
    """(in_spec, arg) pairs: table, q, k, v, [do, lse, delta], positions, [segment ids]."""
    g = spec.group
    ins = [(blocks.table, table), (blocks.rows, q_BKCGD), (blocks.kv, k), (blocks.kv, v)]
    ins += zip((blocks.rows, blocks.row_stat, blocks.row_stat), (_heads(x, g) for x in bwd))
    ins += [(blocks.q_vec, _heads(q_pos, g)), (blocks.k_vec, k_pos)]
    if spec.has_seg:
        ins += [(blocks.q_vec, _heads(q_seg, g)), (blocks.k_vec, k_seg)]
    return ins


def _kv_mask(spec: RoundSpec, masked, qp, qs, kp_ref, ks_ref, sl):
    """Visibility of the program's q rows against kv slice ``sl``, or None when unmasked."""
    if not masked:
        return None
    ks = ks_ref[sl][None, :] if spec.has_seg else None
    return flash.mask(qp, kp_ref[sl][None, :], qs, ks, spec.causal, spec.window)


# ----------------------------------------------------------------------------- forward


def _fwd_kernel(t_ref, q_ref, k_ref, v_ref, qp_ref, kp_ref, *refs, spec: RoundSpec):
    qs_ref, ks_ref, (o_ref, lse_ref) = _seg_refs(refs, spec.has_seg)
    q = q_ref[...]
    qp = qp_ref[...][:, None]
    qs = qs_ref[...][:, None] if spec.has_seg else None
    bk = spec.fwd.block_kv

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
    """One round's normalised output ``[BK, Cq*G, D]`` and logsumexp ``[BK, Cq*G]``, fp32."""
    q = _heads(q, spec.group)
    blocks = _Blocks(spec, spec.fwd, q, k.shape[1], per_q_tile=True)
    ins = _inputs(blocks, spec, table, q, k, v, q_pos, k_pos, q_seg, k_seg)
    out_shape = (jax.ShapeDtypeStruct(q.shape, jnp.float32),
                 jax.ShapeDtypeStruct(q.shape[:3], jnp.float32))
    o, lse = blocks.call(functools.partial(_fwd_kernel, spec=spec), ins,
                         (blocks.rows, blocks.row_stat), out_shape, "ring_round_fwd")
    return _fold(o), _fold(lse)


# ----------------------------------------------------------------------------- backward


def _dq_kernel(t_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qp_ref, kp_ref, *refs,
               spec: RoundSpec):
    qs_ref, ks_ref, (dq_ref,) = _seg_refs(refs, spec.has_seg)
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...][:, None], delta_ref[...][:, None]
    qp = qp_ref[...][:, None]
    qs = qs_ref[...][:, None] if spec.has_seg else None
    bk = spec.dq.block_kv

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
    q = _heads(q, spec.group)
    blocks = _Blocks(spec, spec.dq, q, k.shape[1], per_q_tile=True)
    ins = _inputs(blocks, spec, table, q, k, v, q_pos, k_pos, q_seg, k_seg, (do, lse, delta))
    dq = blocks.call(functools.partial(_dq_kernel, spec=spec), ins, blocks.rows,
                     jax.ShapeDtypeStruct(q.shape, jnp.float32), "ring_round_dq")
    return _fold(dq)


def _dkv_kernel(t_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qp_ref, kp_ref, *refs,
                spec: RoundSpec):
    qs_ref, ks_ref, (dk_ref, dv_ref) = _seg_refs(refs, spec.has_seg)
    k, v = k_ref[...], v_ref[...]
    kp = kp_ref[...][None, :]
    ks = ks_ref[...][None, :] if spec.has_seg else None
    g, bq = spec.group, spec.dkv.block_q

    def body(masked):
        def step(t, carry):  # step t: q tile t // G of query head t % G
            sl, h = pl.ds(pl.multiple_of((t // g) * bq, bq), bq), t % g
            vis = None if not masked else flash.mask(
                qp_ref[sl, h][:, None], kp, qs_ref[sl, h][:, None] if spec.has_seg else None, ks,
                spec.causal, spec.window)
            q, do = q_ref[sl, h, :], do_ref[sl, h, :]
            p = flash.probs(q, k, lse_ref[sl, h][:, None], spec.scale, vis)
            ds = flash.grad_scores(p, do, v, delta_ref[sl, h][:, None])
            return flash.dkv_update(*carry, p, ds, q, do)
        return step

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = _three_ranges(t_ref, body, (zeros, zeros), scale=g)
    dk_ref[...] = dk * spec.scale
    dv_ref[...] = dv


def backward_dkv(spec: RoundSpec, table, q, k, v, do, lse, delta, q_pos, k_pos, q_seg=None,
                 k_seg=None):
    """dK (w.r.t. the unscaled keys) and dV of one round: two fp32 ``[BK, Ck, D]``."""
    q = _heads(q, spec.group)
    blocks = _Blocks(spec, spec.dkv, q, k.shape[1], per_q_tile=False)
    ins = _inputs(blocks, spec, table, q, k, v, q_pos, k_pos, q_seg, k_seg, (do, lse, delta))
    out = jax.ShapeDtypeStruct(k.shape, jnp.float32)
    return blocks.call(functools.partial(_dkv_kernel, spec=spec), ins,
                       (blocks.kv, blocks.kv), (out, out), "ring_round_dkv")
