"""Per-token work run over chunks of each device's slice of the sequence, one chunk at a time.

The sequence axis is sharded over the mesh's ``sequence`` axis (in layout order), so a
``[B, L, ...]`` array is viewed as ``[B, S, C, ...]`` (S ring devices, C = L / S tokens each;
the sharded dim stays whole) and C is cut into chunks of ``chunk`` tokens, the last one padded.
Chunk i holds tokens ``i*chunk..`` of every device's slice: every chunk is spread over all
devices, and cutting costs no communication.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

BATCH_AXES = ("data", "fsdp")


def num_chunks(local_len: int, chunk: int) -> tuple[int, int]:
    """(chunks, tokens per chunk) for a local slice of ``local_len`` tokens; ``chunk`` 0 = one.

    A chunk that does not divide the slice is kept, and the last chunk padded."""
    if chunk <= 0 or chunk >= local_len:
        return 1, local_len
    return -(-local_len // chunk), chunk


def constrain(a, mesh, spec):
    return a if mesh is None else jax.lax.with_sharding_constraint(a, NamedSharding(mesh, spec))


def slice_spec(ndim: int) -> P:
    """[B, S, c, ...]: rows over (data, fsdp), the S slices over sequence."""
    return P(BATCH_AXES, "sequence", *(None,) * (ndim - 2))


def to_chunks(a_BL, chunk: int, mesh=None):
    """[B, L, ...] -> [n, B, S, c, ...], padded with zeros past the end of each slice."""
    B, L = a_BL.shape[:2]
    S = mesh.shape["sequence"] if mesh is not None else 1
    C = L // S
    n, c = num_chunks(C, chunk)
    a = constrain(a_BL.reshape(B, S, C, *a_BL.shape[2:]), mesh, slice_spec(a_BL.ndim + 1))
    if n * c != C:
        pad = [(0, 0)] * a.ndim
        pad[2] = (0, n * c - C)
        a = jnp.pad(a, pad)
    return jnp.moveaxis(a.reshape(B, S, n, c, *a.shape[3:]), 2, 0)


def from_chunks(a_nBSc, seq_len: int, mesh=None):
    """Inverse of ``to_chunks``: [n, B, S, c, ...] -> [B, L, ...] (padding dropped)."""
    n, B, S, c = a_nBSc.shape[:4]
    C = seq_len // S
    a = jnp.moveaxis(a_nBSc, 0, 2).reshape(B, S, n * c, *a_nBSc.shape[4:])[:, :, :C]
    a = a.reshape(B, seq_len, *a_nBSc.shape[4:])
    return constrain(a, mesh, P(BATCH_AXES, "sequence", *(None,) * (a.ndim - 2)))


def map_chunks(fn, arrays, chunk: int, mesh=None):
    """``fn`` (per-token: [B, S, c, ...] arrays -> [B, S, c, ...]) over chunks of ``arrays``
    ([B, L, ...] each), under remat: the backward recomputes one chunk's insides at a time."""
    seq_len = arrays[0].shape[1]
    body = jax.checkpoint(lambda carry, xs: (carry, fn(*xs)))
    _, out = jax.lax.scan(body, None, tuple(to_chunks(a, chunk, mesh) for a in arrays))
    return from_chunks(out, seq_len, mesh)
