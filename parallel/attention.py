"""Context-parallel attention over the mesh's sequence axis, for every token layout.

``impl`` picks how the sequence is split over devices; all of them are exact, read the same
true positions and segment ids, and call the same per-round kernel (``parallel/rounds.py``):

- ``ring`` (here): each device keeps its chunk of queries; the K/V blocks, with the true
  positions and segment ids of their tokens, travel round the ring with ``ppermute``. In round
  ``r`` device ``d`` folds the block that started on device ``d - r`` into fp32 online-softmax
  accumulators; the next block's transfer is issued before the current block's compute so XLA
  can overlap them, and the last round sends nothing. Backward (custom VJP): dQ accumulates
  locally; each block's dK/dV accumulator travels with it and arrives home after N hops.
- ``allgather`` (``parallel/allgather.py``): K/V gathered whole, dK/dV reduce-scattered.
- ``ulysses`` / ``usp`` (``parallel/ulysses.py``): all-to-all from sequence- to head-sharded,
  then full-length attention per head group; ``usp`` runs a ring across U-device groups.

The layout only changes which positions each chunk holds, so one kernel serves contiguous,
striped and zigzag. Only the Hkv heads travel (GQA: K/V are never repeated).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from parallel import kernels, rounds
from parallel.kernels import accumulators as ac
from parallel.kernels import tiling
from parallel.kernels.spec import RoundSpec
from parallel.layouts import check as check_layout
from parallel.layouts import permutation
from parallel.mesh import BATCH_AXES

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
    impl: str = "ring"  # ring | allgather | ulysses | usp
    ulysses: int = 1  # devices per all-to-all group (neighbours on the axis); N for ulysses

    tiles: tuple = ()  # (forward, dQ, dK/dV) Tiles (``parallel/kernels/tiling.py``)

    def round_spec(self, q_heads, kv_heads, head_dim, has_seg) -> RoundSpec:
        return RoundSpec(self.kernel, *self.tiles, q_heads // kv_heads, kv_heads, head_dim,
                         self.scale, self.causal, has_seg, self.interpret)

    @property
    def size(self):
        return self.mesh.shape[self.axis]

    @property
    def groups(self):
        """All-to-all groups along the axis: U neighbouring devices each (None: the whole axis)."""
        u = self.ulysses
        if u == self.size:
            return None
        return [list(range(g, g + u)) for g in range(0, self.size, u)]

    def spec(self, *names):
        """PartitionSpec from per-dim roles: 'b' batch, 's' sequence, 'h' heads, None."""
        role = {"b": self.batch_axes or None, "s": self.axis, "h": self.head_axis, None: None}
        return P(*(role[n] for n in names))


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


IMPLS = ("ring", "allgather", "ulysses", "usp")


def context_parallel_attention(q, k, v, *, mesh, layout, positions=None, segment_ids=None,
                               axis="sequence", causal=True, stripe=1, block_q=None, block_kv=None,
                               kernel="auto", impl="ring", ulysses=None):
    """Exact attention with L split over ``mesh[axis]``, in any token layout.

    q ``[B, L, Hq, D]``, k/v ``[B, L, Hkv, D]`` in layout order along L; ``positions [B, L]``
    int32 are the true (natural) token indices used by the mask (derived from
    ``permutation(layout, L, mesh.shape[axis], stripe)`` when None); ``segment_ids [B, L]``
    restrict attention to the same packed document. Returns ``[B, L, Hq, D]`` in layout
    order and ``q.dtype``. Batch is also split over the mesh's data/fsdp axes and heads over
    its tensor axis when they exist with size > 1. ``block_q``/``block_kv`` are the tile
    sizes inside each device's chunk (clamped to the chunk when larger; None: the kernel's
    default). ``kernel``: ``auto | xla | pallas_gpu | pallas_tpu`` (``parallel/kernels``).
    ``impl``: ``ring | allgather | ulysses | usp``; ``ulysses`` is usp's all-to-all degree U
    (it must divide the axis size and the local query and kv head counts; ulysses uses U = N).
    """
    if impl not in IMPLS:
        raise ValueError(f"unknown context-parallel impl {impl!r}; valid: {', '.join(IMPLS)}")
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
    u = 1
    if impl in ("ulysses", "usp"):
        from parallel.ulysses import check_heads
        nt = mesh.shape[head_axis] if head_axis else 1
        u = n if impl == "ulysses" else ulysses
        check_heads(impl, hq // nt, hkv // nt, n, u)
    chunk = length // n
    platform = kernels.platform_of(mesh)
    kernel = kernels.resolve(kernel, platform)
    interpret = kernels.interpret(kernel, platform)
    tiles = tiling.plan(kernel, block_q, block_kv, group=hq // hkv, head_dim=d,
                        dtype=jnp.dtype(q.dtype).name, chunk=chunk, seq_len=length, shards=n,
                        interpret=interpret, arch=tiling.gpu_arch(kernels.first_device(mesh)))
    block_q, block_kv = tiles[0][:2]
    ring = _Ring(mesh, axis, batch_axes, head_axis, bool(causal), block_q, block_kv,
                 1.0 / math.sqrt(d), kernel, interpret, impl, u, tiles)
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


# ----------------------------------------------------------------------------- programs


def _strategy(ring):
    if ring.impl == "ring":
        return _RingStrategy
    if ring.impl == "allgather":
        from parallel import allgather
        return allgather
    from parallel import ulysses
    return ulysses


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


# One jitted program per configuration, reused across calls: eager callers (and layouts that
# differ only in the runtime positions) then share one compilation. Every strategy maps the
# same sequence-sharded inputs to the same outputs; the logsumexp residual is in whatever
# per-device layout the strategy's backward reads.
@functools.lru_cache(maxsize=None)
def _forward_program(ring: _Ring, has_seg: bool):
    qspec = ring.spec("b", "s", "h", None)
    return jax.jit(jax.shard_map(_strategy(ring).forward_local(ring), mesh=ring.mesh,
                                 in_specs=_fwd_specs(ring, has_seg),
                                 out_specs=(qspec, ring.spec("b", "h", "s", None)),
                                 check_vma=ring.kernel == "xla"))


def _backward(q, k, v, positions, segment_ids, out, lse, dout, ring: _Ring):
    specs = _bwd_specs(ring, segment_ids is not None)
    args = (q, k, v, positions, segment_ids, out, lse, dout)
    return _backward_program(ring, segment_ids is not None)(
        *(_reshard(x, s, ring) for x, s in zip(args, specs)))


@functools.lru_cache(maxsize=None)
def _backward_program(ring: _Ring, has_seg: bool):
    qspec = ring.spec("b", "s", "h", None)
    return jax.jit(jax.shard_map(_strategy(ring).backward_local(ring), mesh=ring.mesh,
                                 in_specs=_bwd_specs(ring, has_seg),
                                 out_specs=(qspec, qspec, qspec), check_vma=ring.kernel == "xla"))


class _RingStrategy:
    """The ring: each device keeps its queries; K/V blocks travel, one hop a round."""

    @staticmethod
    def forward_local(ring):
        def local(q_BCHD, k_BCKD, v_BCKD, pos_BC, seg_BC):
            hkv = k_BCKD.shape[2]  # local count: heads may be split over the tensor axis
            fwd = rounds.Rounds(ring, q_BCHD, pos_BC, seg_BC, hkv, q_BCHD.shape[1])
            acc = rounds.ring_forward(ac.kv_block(k_BCKD, v_BCKD, pos_BC, seg_BC), fwd.init(),
                                      fwd.attend, ring.size, lambda t: rounds.shift(t, ring))
            return fwd.finish(acc)
        return local

    @staticmethod
    def backward_local(ring):
        def local(q_BCHD, k_BCKD, v_BCKD, pos_BC, seg_BC, out_BCHD, lse_BKCG, dout_BCHD):
            hkv = k_BCKD.shape[2]
            delta = jnp.sum(dout_BCHD.astype(jnp.float32) * out_BCHD.astype(jnp.float32), axis=-1)
            bwd = rounds.Rounds(ring, q_BCHD, pos_BC, seg_BC, hkv, q_BCHD.shape[1], lse_BKCG,
                                dout_BCHD, delta)
            dq, dk, dv = rounds.ring_backward(ac.kv_block(k_BCKD, v_BCKD, pos_BC, seg_BC),
                                              bwd.zeros_dq(), bwd.grads, ring.size,
                                              lambda t: rounds.shift(t, ring))
            return (bwd.finish_dq(dq), ac.from_kv_major(dk).astype(k_BCKD.dtype),
                    ac.from_kv_major(dv).astype(v_BCKD.dtype))
        return local
