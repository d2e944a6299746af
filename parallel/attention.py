"""Context-parallel attention over the mesh's sequence axis, for every token layout: the public
entry, its checks, strategy selection and the custom VJP.

``impl`` picks how the sequence is split over devices (``parallel/strategies``): ``ring``,
``allgather``, ``ulysses`` or ``usp``. All of them are exact, read the same true positions and
segment ids, run on one engine (``parallel/strategies/engine.py``) and call the same per-round
kernel (``parallel/kernels``: ``xla``, ``pallas_gpu``, ``pallas_tpu``).

The layout only changes which positions each chunk holds, so one kernel serves contiguous,
striped and zigzag. Only the Hkv heads travel (GQA: K/V are never repeated).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from parallel import kernels, window as sliding
from parallel.kernels import tiling
from parallel.layouts import check as check_layout
from parallel.layouts import permutation
from parallel.mesh import BATCH_AXES
from parallel.strategies import IMPLS, engine
from parallel.strategies.call import Call
from parallel.strategies.usp import check_heads

HEAD_AXIS = "tensor"


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
                               kernel="auto", impl="ring", ulysses=None, window=0, sinks=None):
    """Exact attention with L split over ``mesh[axis]``, in any token layout.

    q ``[B, L, Hq, D]``, k/v ``[B, L, Hkv, D]`` in layout order along L; ``positions [B, L]``
    int32 are the true (natural) token indices used by the mask (derived from
    ``permutation(layout, L, mesh.shape[axis], stripe)`` when None); ``segment_ids [B, L]``
    restrict attention to the same packed document. Returns ``[B, L, Hq, D]`` in layout
    order and ``q.dtype``. Batch is also split over the mesh's data/fsdp axes and heads over
    its tensor axis when they exist with size > 1. ``block_q``/``block_kv`` are the tile
    sizes inside each device's chunk (clamped to the chunk when larger; None: the kernel's
    default). ``kernel``: ``auto | xla | pallas_gpu | pallas_tpu | cudnn`` (``parallel/kernels``).
    ``impl``: ``ring | allgather | ulysses | usp``; ``ulysses`` is usp's all-to-all degree U
    (it must divide the axis size and the local query and kv head counts; ulysses uses U = N).
    ``window``: a sliding window W (causal only; 0: none): a query at position p sees keys with
    ``p - W < k_pos <= p``. With the contiguous layout's own positions (``positions=None``) a
    ring then stops after the rounds the window reaches (``parallel/window.py``); explicit
    positions keep every round, since nothing bounds how far back they reach.
    ``sinks``: attention sinks (gpt-oss), a logit per query head ``[Hq]`` that joins every row's
    softmax denominator (``softmax([scores, sink])[:-1] @ V``), once, after the last round;
    differentiable.
    """
    window = sliding.check(window, causal)
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
    u = 1  # the ring is usp with U = 1
    if impl in ("ulysses", "usp"):
        nt = mesh.shape[head_axis] if head_axis else 1
        u = n if impl == "ulysses" else ulysses
        check_heads(impl, hq // nt, hkv // nt, n, u)
    chunk = length // n
    platform = kernels.platform_of(mesh)
    kernel = kernels.resolve(kernel, platform, q.dtype, d)
    interpret = kernels.interpret(kernel, platform)
    tiles = tiling.plan(kernel, block_q, block_kv, group=hq // hkv, head_dim=d,
                        dtype=jnp.dtype(q.dtype).name, chunk=chunk, seq_len=length, shards=n,
                        interpret=interpret,
                        arch=tiling.device_arch(kernel, kernels.first_device(mesh)))
    block_q, block_kv = tiles[0][:2]
    # Rounds of the ring that can have work; 0 (every hop) unless the window stops it early, so
    # that programs differing only in that share one compilation.
    rounds = 0
    if impl in ("ring", "usp") and positions is None:
        rounds = sliding.reach(window, layout, u * chunk, n // u) % (n // u)
    call = Call(mesh, axis, batch_axes, head_axis, bool(causal), block_q, block_kv,
                1.0 / math.sqrt(d), kernel, interpret, impl, u, tiles, window, rounds)
    if positions is None:
        positions = jnp.broadcast_to(jnp.asarray(permutation(layout, length, n, stripe)), (b, length))
    elif positions.shape != (b, length):
        raise ValueError(f"positions must be [B, L] = {(b, length)}, got {positions.shape}")
    if segment_ids is not None and segment_ids.shape != (b, length):
        raise ValueError(f"segment_ids must be [B, L] = {(b, length)}, got {segment_ids.shape}")
    positions = positions.astype(jnp.int32)
    if segment_ids is not None:
        segment_ids = segment_ids.astype(jnp.int32)
    if sinks is not None:
        if jnp.shape(sinks) != (hq,):
            raise ValueError(f"sinks must be one logit per query head, [{hq}]; got "
                             f"{jnp.shape(sinks)}")
        sinks = jnp.asarray(sinks, jnp.float32)
    return _attention(q, k, v, positions, segment_ids, sinks, call)


# ----------------------------------------------------------------------------- custom VJP


def _explicit_axes(mesh):
    types = getattr(mesh, "axis_types", ())
    return any(t == jax.sharding.AxisType.Explicit for t in types)


def _reshard(x, spec_or_like, call):
    """On a mesh with Explicit axes, shard_map needs its inputs already laid out as its specs
    say (and callers expect their own sharding back); Auto meshes reshard implicitly."""
    if x is None or not _explicit_axes(call.mesh):
        return x
    spec = spec_or_like if isinstance(spec_or_like, P) else jax.typeof(spec_or_like).sharding.spec
    return jax.sharding.reshard(x, jax.sharding.NamedSharding(call.mesh, spec))


def _one_mesh_context():
    """The abstract mesh in force, named. JAX keys its trace cache on that context as it was
    set, and replays the equations it traced (autodiff's linearize of the layer scan, remat)
    under the empty mesh where the first trace saw none set: without naming it, the custom
    VJP's primal and its forward rule trace the same ring program twice (the tiny train
    step's trace and lowering: 6% fewer Python calls)."""
    return jax.sharding.use_abstract_mesh(jax.sharding.get_abstract_mesh())


def _forward(q, k, v, positions, segment_ids, sinks, call: Call):
    # Positions (often constants) are the same in every layer: without tying them to q/k/v,
    # autodiff through a remat'd layer scan treats everything computed from them alone
    # (tile cases, masks) as known, and would hoist it out of the scan as stacked residuals.
    q, k, v, positions, segment_ids = lax.optimization_barrier((q, k, v, positions, segment_ids))
    has_seg, has_sink = segment_ids is not None, sinks is not None
    args = (q, k, v, positions, segment_ids) + ((sinks,) if has_sink else ())
    # the scope's name is training/profile.py's row
    with jax.named_scope("attention_fwd"), _one_mesh_context():
        return engine.forward_program(call, has_seg, has_sink)(
            *(_reshard(x, s, call) for x, s in zip(args, call.fwd_specs(has_seg, has_sink))))


def _backward(q, k, v, positions, segment_ids, out, lse, dout, sinks, call: Call):
    has_seg, has_sink = segment_ids is not None, sinks is not None
    args = (q, k, v, positions, segment_ids, out, lse, dout) + ((sinks,) if has_sink else ())
    with jax.named_scope("attention_bwd"), _one_mesh_context():
        return engine.backward_program(call, has_seg, has_sink)(
            *(_reshard(x, s, call) for x, s in zip(args, call.bwd_specs(has_seg, has_sink))))


def _cp_fwd_rule(q, k, v, positions, segment_ids, sinks, call):
    out, lse = _forward(q, k, v, positions, segment_ids, sinks, call)
    return _reshard(out, q, call), (q, k, v, positions, segment_ids, sinks, out, lse)


def _cp_bwd_rule(call, res, dout):
    q, k, v, positions, segment_ids, sinks, out, lse = res
    grads = _backward(q, k, v, positions, segment_ids, out, lse, dout, sinks, call)
    dq, dk, dv = grads[:3]
    # The sinks' gradient: its rows summed over batch and sequence (across their shards).
    dsinks = None if sinks is None else jnp.sum(grads[3], axis=(0, 1))
    return (_reshard(dq, q, call), _reshard(dk, k, call), _reshard(dv, v, call), None, None,
            dsinks)


def _cp_primal(q, k, v, positions, segment_ids, sinks, call):
    return _reshard(_forward(q, k, v, positions, segment_ids, sinks, call)[0], q, call)


_attention = jax.custom_vjp(_cp_primal, nondiff_argnums=(6,))
_attention.defvjp(_cp_fwd_rule, _cp_bwd_rule)
