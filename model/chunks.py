"""Per-token work run over chunks of each device's slice of the sequence, one chunk at a time.

The sequence axis is sharded over the mesh's ``sequence`` axis (in layout order), so each
device cuts its own slice of ``C = L / S`` tokens into chunks of ``chunk`` tokens (the last one
padded): every chunk is spread over all devices, and cutting costs no communication.

It runs inside ``jax.shard_map``: the weights are gathered once, made device-varying once
before the loop, and each chunk's weight gradient adds up locally, so the backward reduces the
weight gradients over the devices once after the loop rather than once per chunk (which is
what automatic partitioning of a loop over a replicated weight does).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from parallel.mesh import BATCH_AXES

TOKEN_AXES = ("data", "fsdp", "sequence")  # the axes that split tokens (not tensor)


def cast_before_gather(w, dtype):
    """``w`` in the compute dtype, cast before the FSDP all-gather a chunked map makes of it:
    the barrier stops XLA from moving the cast after the gather (gathering fp32)."""
    return jax.lax.optimization_barrier(w.astype(dtype))


def num_chunks(local_len: int, chunk: int) -> tuple[int, int]:
    """(chunks, tokens per chunk) for a local slice of ``local_len`` tokens; ``chunk`` 0 = one.

    A chunk that does not divide the slice is kept, and the last chunk padded."""
    if chunk <= 0 or chunk >= local_len:
        return 1, local_len
    return -(-local_len // chunk), chunk


def _scan_chunks(fn, weights, arrays, chunk: int, axis, remat_one: bool = True):
    """Local: [b, C, ...] arrays -> fn over [b, c, ...] chunks -> [b, C, ...]."""
    C = arrays[0].shape[1]
    n, c = num_chunks(C, chunk)
    if n == 1 and not remat_one:
        return fn(weights, *arrays, axis=axis)

    def split(a):
        if n * c != C:
            a = jnp.pad(a, [(0, 0), (0, n * c - C)] + [(0, 0)] * (a.ndim - 2))
        return jnp.moveaxis(a.reshape(a.shape[0], n, c, *a.shape[2:]), 1, 0)

    body = jax.checkpoint(lambda carry, xs: (carry, fn(weights, *xs, axis=axis)))
    _, out = jax.lax.scan(body, None, tuple(split(a) for a in arrays))
    out = jnp.moveaxis(out, 0, 1)
    return out.reshape(out.shape[0], n * c, *out.shape[3:])[:, :C]


def map_chunks(fn, weights, weight_specs, arrays, chunk: int, mesh=None, out_rank=None,
               remat_one: bool = True):
    """``fn(weights, *chunks, axis=...)`` over chunks of ``arrays`` ([B, L, ...] each, sharded
    rows over data x fsdp and tokens over sequence), under remat: the backward recomputes one
    chunk's insides at a time. ``fn`` sees the local ``weights`` (sharded by ``weight_specs``,
    i.e. split over tensor at most) and reduces over ``axis`` ("tensor", or None without a
    mesh) whatever the tensor split leaves partial; its output is per token, whole over tensor.
    ``remat_one=False``: a slice that is one chunk runs without remat (for the step's last
    forward op, the loss, whose backward runs first: its insides are alive in between anyway,
    so recomputing them only costs time)."""
    if mesh is None:
        return _scan_chunks(fn, weights, arrays, chunk, None, remat_one)

    def local(weights, *arrays):
        weights = jax.tree.map(lambda w: jax.lax.pcast(w, TOKEN_AXES, to="varying"), weights)
        return _scan_chunks(fn, weights, arrays, chunk, "tensor", remat_one)

    specs = tuple(P(BATCH_AXES, "sequence", *(None,) * (a.ndim - 2)) for a in arrays)
    out_ndim = out_rank or arrays[0].ndim
    return jax.shard_map(local, mesh=mesh, in_specs=(weight_specs, *specs),
                         out_specs=P(BATCH_AXES, "sequence", *(None,) * (out_ndim - 2)))(weights, *arrays)
