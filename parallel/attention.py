"""Context-parallel (ring) attention over the mesh's sequence axis, for every token layout.

Each device keeps its chunk of queries; the K/V blocks, with the true positions and segment
ids of their tokens, travel round the ring with ``ppermute``. In round ``r`` device ``d`` folds
the block that started on device ``d - r`` into fp32 online-softmax accumulators (see
``parallel/blockwise.py``); the next block's transfer is issued before the current block's
compute so XLA can overlap them, and the last round sends nothing. The layout only changes
which positions each chunk holds, so one kernel serves contiguous, striped and zigzag.

Backward (custom VJP): dQ accumulates locally; each block's dK/dV accumulator travels with
it (one hop behind the K/V prefetch) and arrives home after N hops. Only the Hkv heads travel.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from parallel import blockwise as bw
from parallel import kernels
from parallel.kernels import fused
from parallel.kernels.spec import RoundSpec
from parallel.layouts import check as check_layout
from parallel.layouts import permutation

BATCH_AXES = ("data", "fsdp")
HEAD_AXIS = "tensor"


@dataclasses.dataclass(frozen=True)
class _Ring:
    """Static description of one ring-attention call (hashable: a custom_vjp nondiff arg)."""

    mesh: object
    axis: str
    batch_axes: tuple
    head_axis: str | None
    causal: bool
    block_q: int
    block_kv: int
    scale: float
    kernel: str = "xla"  # resolved: xla | pallas_gpu | pallas_tpu
    interpret: bool = False  # Pallas interpret mode

    def round_spec(self, q_heads, kv_heads, head_dim, has_seg) -> RoundSpec:
        return RoundSpec(self.kernel, self.block_q, self.block_kv, q_heads // kv_heads, kv_heads,
                         head_dim, self.scale, self.causal, has_seg, self.interpret)

    @property
    def size(self):
        return self.mesh.shape[self.axis]

    def spec(self, *names):
        """PartitionSpec from per-dim roles: 'b' batch, 's' sequence, 'h' heads, None."""
        role = {"b": self.batch_axes or None, "s": self.axis, "h": self.head_axis, None: None}
        return P(*(role[n] for n in names))


def _divisors(n: int) -> str:
    ds = [x for x in range(1, n + 1) if n % x == 0]
    return ", ".join(map(str, ds if len(ds) <= 12 else ds[:6] + ["..."] + ds[-3:]))


def tile_size(name, block, chunk, seq_len, shards):
    """Tile size actually used: clamped to the chunk when larger, else it must divide it.

    Clamping lets the model's default (512) run on short sequences and makes the smallest valid
    length per device work; a smaller tile that does not divide the chunk is a user error
    (ValueError; ``training/validate.py`` reports it before anything compiles).
    """
    if block < 1:
        raise ValueError(f"{name} must be >= 1, got {block}")
    if block >= chunk:
        return chunk
    if chunk % block:
        raise ValueError(
            f"{name}={block} does not divide the per-device chunk of {chunk} tokens "
            f"(seq_len {seq_len} / {shards} sequence shards); valid {name}: "
            f"{_divisors(chunk)} (or anything larger, clamped to {chunk})")
    return block


def _mesh_axes(mesh, axis, batch, heads_q, heads_kv):
    """The batch and head axes to shard over: those present in the mesh with size > 1."""
    if axis not in mesh.shape:
        raise ValueError(f"mesh has no axis {axis!r}; its axes are {tuple(mesh.shape)}")
    batch_axes = tuple(a for a in BATCH_AXES if a != axis and mesh.shape.get(a, 1) > 1)
    nb = math.prod(mesh.shape[a] for a in batch_axes)
    if batch % nb:
        raise ValueError(f"batch {batch} is not divisible by the mesh's batch axes "
                         f"{'x'.join(f'{a}={mesh.shape[a]}' for a in batch_axes)} = {nb}")
    head_axis = HEAD_AXIS if HEAD_AXIS != axis and mesh.shape.get(HEAD_AXIS, 1) > 1 else None
    if head_axis is not None:
        nt = mesh.shape[head_axis]
        if heads_kv % nt or heads_q % nt:
            raise ValueError(f"query heads ({heads_q}) and kv heads ({heads_kv}) must both be "
                             f"divisible by the mesh's {head_axis} axis ({nt})")
    return batch_axes, head_axis


def context_parallel_attention(q, k, v, *, mesh, layout, positions=None, segment_ids=None,
                               axis="sequence", causal=True, stripe=1, block_q=None, block_kv=None,
                               kernel="auto"):
    """Exact attention with L split over ``mesh[axis]`` as a ring, in any token layout.

    q ``[B, L, Hq, D]``, k/v ``[B, L, Hkv, D]`` in layout order along L; ``positions [B, L]``
    int32 are the true (natural) token indices used by the mask (derived from
    ``permutation(layout, L, mesh.shape[axis], stripe)`` when None); ``segment_ids [B, L]``
    restrict attention to the same packed document. Returns ``[B, L, Hq, D]`` in layout
    order and ``q.dtype``. Batch is also split over the mesh's data/fsdp axes and heads over
    its tensor axis when they exist with size > 1. ``block_q``/``block_kv`` are the tile
    sizes inside each device's chunk (clamped to the chunk when larger; None: the kernel's
    default). ``kernel``: ``auto | xla | pallas_gpu | pallas_tpu`` (``parallel/kernels``).
    """
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        raise ValueError(f"expected q [B, L, Hq, D] and k, v [B, L, Hkv, D]; got q {q.shape}, "
                         f"k {k.shape}, v {v.shape}")
    b, length, hq, d = q.shape
    hkv = k.shape[2]
    if k.shape[:2] != (b, length) or k.shape[3] != d or hq % hkv:
        raise ValueError(f"incompatible shapes q {q.shape} and k/v {k.shape}: need the same B, L, D "
                         f"and query heads a multiple of kv heads")
    batch_axes, head_axis = _mesh_axes(mesh, axis, b, hq, hkv)
    n = mesh.shape[axis]
    check_layout(layout, length, n, stripe)
    chunk = length // n
    platform = kernels.platform_of(mesh)
    kernel = kernels.resolve(kernel, platform)
    default_q, default_kv = kernels.default_tiles(kernel, hq // hkv)
    ring = _Ring(mesh, axis, batch_axes, head_axis, bool(causal),
                 tile_size("block_q", block_q or default_q, chunk, length, n),
                 tile_size("block_kv", block_kv or default_kv, chunk, length, n),
                 1.0 / math.sqrt(d), kernel, kernels.interpret(kernel, platform))
    if positions is None:
        positions = jnp.broadcast_to(jnp.asarray(permutation(layout, length, n, stripe)), (b, length))
    elif positions.shape != (b, length):
        raise ValueError(f"positions must be [B, L] = {(b, length)}, got {positions.shape}")
    if segment_ids is not None and segment_ids.shape != (b, length):
        raise ValueError(f"segment_ids must be [B, L] = {(b, length)}, got {segment_ids.shape}")
    positions = positions.astype(jnp.int32)
    if segment_ids is not None:
        segment_ids = segment_ids.astype(jnp.int32)
    return _ring_attention(q, k, v, positions, segment_ids, ring)


# ----------------------------------------------------------------------------- custom VJP


def _explicit_axes(mesh):
    types = getattr(mesh, "axis_types", ())
    return any(t == jax.sharding.AxisType.Explicit for t in types)


def _reshard(x, spec_or_like, ring):
    """On a mesh with Explicit axes, shard_map needs its inputs already laid out as its specs
    say (and callers expect their own sharding back); Auto meshes reshard implicitly."""
    if x is None or not _explicit_axes(ring.mesh):
        return x
    spec = spec_or_like if isinstance(spec_or_like, P) else jax.typeof(spec_or_like).sharding.spec
    return jax.sharding.reshard(x, jax.sharding.NamedSharding(ring.mesh, spec))


def _cp_fwd_rule(q, k, v, positions, segment_ids, ring):
    out, lse = _forward(q, k, v, positions, segment_ids, ring)
    return _reshard(out, q, ring), (q, k, v, positions, segment_ids, out, lse)


def _cp_bwd_rule(ring, res, dout):
    q, k, v, positions, segment_ids, out, lse = res
    dq, dk, dv = _backward(q, k, v, positions, segment_ids, out, lse, dout, ring)
    return _reshard(dq, q, ring), _reshard(dk, k, ring), _reshard(dv, v, ring), None, None


def _cp_primal(q, k, v, positions, segment_ids, ring):
    return _reshard(_forward(q, k, v, positions, segment_ids, ring)[0], q, ring)


_ring_attention = jax.custom_vjp(_cp_primal, nondiff_argnums=(5,))
_ring_attention.defvjp(_cp_fwd_rule, _cp_bwd_rule)


# ----------------------------------------------------------------------------- per-device ring


def _shift(tree, ring):
    """One hop round the ring: device d sends to d + 1."""
    n = ring.size
    perm = [(i, (i + 1) % n) for i in range(n)]
    return jax.tree.map(lambda x: lax.ppermute(x, ring.axis, perm), tree)


def _forward(q, k, v, positions, segment_ids, ring: _Ring):
    # Positions (often constants) are the same in every layer: without tying them to q/k/v,
    # autodiff through a remat'd layer scan treats everything computed from them alone
    # (tile cases, masks) as known, and would hoist it out of the scan as stacked residuals.
    q, k, v, positions, segment_ids = lax.optimization_barrier((q, k, v, positions, segment_ids))
    specs = _fwd_specs(ring, segment_ids is not None)
    return _forward_program(ring, segment_ids is not None)(
        *(_reshard(x, s, ring) for x, s in zip((q, k, v, positions, segment_ids), specs)))


def _fwd_specs(ring, has_seg):
    qspec = ring.spec("b", "s", "h", None)
    return (qspec, qspec, qspec, ring.spec("b", "s"), ring.spec("b", "s") if has_seg else None)


def _bwd_specs(ring, has_seg):
    qspec = ring.spec("b", "s", "h", None)
    return _fwd_specs(ring, has_seg) + (qspec, ring.spec("b", "h", "s", None), qspec)


# One jitted program per ring configuration, reused across calls: eager callers (and layouts
# that differ only in the runtime positions) then share one compilation.
@functools.lru_cache(maxsize=None)
def _forward_program(ring: _Ring, has_seg: bool):
    def local(q_BCHD, k_BCKD, v_BCKD, pos_BC, seg_BC):
        hkv = k_BCKD.shape[2]  # local count: heads may be split over the tensor axis
        kv = bw.KV(bw.to_kv_major(k_BCKD), bw.to_kv_major(v_BCKD), pos_BC, seg_BC)
        q_s = bw.to_q_major(q_BCHD.astype(jnp.float32) * ring.scale, hkv)
        acc = bw.init_acc(q_s)
        if ring.kernel == "xla":
            attend = lambda kv, acc: bw.attend_block(q_s, kv, pos_BC, seg_BC, acc, block_q=ring.block_q,
                                                     block_kv=ring.block_kv, causal=ring.causal)
        else:
            spec = ring.round_spec(q_BCHD.shape[2], hkv, q_BCHD.shape[3], has_seg)
            query = fused.prepare(q_BCHD, pos_BC, seg_BC, spec)
            attend = lambda kv, acc: fused.attend(spec, query, kv, acc)

        def round_(_, carry):
            kv, acc = carry
            kv_next = _shift(kv, ring)  # issued first: independent of this round's compute
            return kv_next, attend(kv, acc)

        kv, acc = lax.fori_loop(0, ring.size - 1, round_, (kv, acc))
        out, lse = bw.finalize(attend(kv, acc))  # last round: nothing left to send
        return bw.from_q_major(out).astype(q_BCHD.dtype), lse

    qspec = ring.spec("b", "s", "h", None)
    return jax.jit(jax.shard_map(local, mesh=ring.mesh, in_specs=_fwd_specs(ring, has_seg),
                                 out_specs=(qspec, ring.spec("b", "h", "s", None)),
                                 check_vma=ring.kernel == "xla"))


def _backward(q, k, v, positions, segment_ids, out, lse, dout, ring: _Ring):
    specs = _bwd_specs(ring, segment_ids is not None)
    args = (q, k, v, positions, segment_ids, out, lse, dout)
    return _backward_program(ring, segment_ids is not None)(
        *(_reshard(x, s, ring) for x, s in zip(args, specs)))


@functools.lru_cache(maxsize=None)
def _backward_program(ring: _Ring, has_seg: bool):
    n = ring.size

    def local(q_BCHD, k_BCKD, v_BCKD, pos_BC, seg_BC, out_BCHD, lse_BKCG, dout_BCHD):
        hkv = k_BCKD.shape[2]
        do = bw.to_q_major(dout_BCHD.astype(jnp.float32), hkv)
        delta = jnp.sum(do * bw.to_q_major(out_BCHD.astype(jnp.float32), hkv), axis=-1)
        kv = bw.KV(bw.to_kv_major(k_BCKD), bw.to_kv_major(v_BCKD), pos_BC, seg_BC)
        if ring.kernel == "xla":
            q_s = bw.to_q_major(q_BCHD.astype(jnp.float32) * ring.scale, hkv)

            def grads(kv, dq):
                return bw.attend_block_bwd(q_s, kv, pos_BC, seg_BC, do, lse_BKCG, delta, dq,
                                           block_q=ring.block_q, block_kv=ring.block_kv,
                                           causal=ring.causal)
        else:
            spec = ring.round_spec(q_BCHD.shape[2], hkv, q_BCHD.shape[3], has_seg)
            query = fused.prepare(q_BCHD, pos_BC, seg_BC, spec)
            do_f = fused.fold_rows(bw.to_q_major(dout_BCHD, hkv))
            lse_f, delta_f = fused.fold_rows(lse_BKCG), fused.fold_rows(delta)

            def grads(kv, dq):
                return fused.grads(spec, query, kv, do_f, lse_f, delta_f, dq)

        # zeros_like: varies over the same mesh axes as q
        dq = jnp.zeros_like(bw.to_q_major(q_BCHD, hkv), dtype=jnp.float32)
        if n == 1:
            dq, dk, dv = grads(kv, dq)
        else:
            kv_next = _shift(kv, ring)
            dq, dk, dv = grads(kv, dq)

            def round_(kv_next, dq, dkv, prefetch):
                # dK/dV of the block computed last round move on while this round computes
                # fresh contributions for the block that just arrived; they meet afterwards.
                dkv_in = _shift(dkv, ring)
                kv = kv_next
                kv_next = _shift(kv, ring) if prefetch else None
                dq, dk, dv = grads(kv, dq)
                return kv_next, dq, (dkv_in[0] + dk, dkv_in[1] + dv)

            def loop_body(_, carry):
                return round_(*carry, prefetch=True)

            kv_next, dq, dkv = lax.fori_loop(1, n - 1, loop_body, (kv_next, dq, (dk, dv)))
            _, dq, dkv = round_(kv_next, dq, dkv, prefetch=False)
            dk, dv = _shift(dkv, ring)  # the final hop brings each block's gradient home
        dq = bw.from_q_major(dq * ring.scale).astype(q_BCHD.dtype)
        return dq, bw.from_kv_major(dk).astype(k_BCKD.dtype), bw.from_kv_major(dv).astype(v_BCKD.dtype)

    qspec = ring.spec("b", "s", "h", None)
    return jax.jit(jax.shard_map(local, mesh=ring.mesh, in_specs=_bwd_specs(ring, has_seg),
                                 out_specs=(qspec, qspec, qspec), check_vma=ring.kernel == "xla"))
