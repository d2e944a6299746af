"""Ulysses and the hybrid (Ulysses x ring, "usp") context parallelism.

Ulysses: an all-to-all turns sequence-sharded ``q, k, v [B, C, H, D]`` into head-sharded
``[B, N*C, H/N, D]`` (every token of the row, H/N heads), each device attends over the whole
row on its heads, and an all-to-all turns the output back. Positions and segment ids are
all-gathered, so the mask reads the true positions of every slot; the tokens stay in layout
order (member ``u``'s chunk at ``[u*C, (u+1)*C)``), and the per-round kernel is called chunk
pair by chunk pair (``parallel/rounds.py``), so tiles are skipped exactly as in the ring.

usp: the sequence axis (N devices) is split into N/U groups of U neighbouring devices (one node
on real hardware). The all-to-all runs inside each group, so a device holds its group's U chunks
on H/U heads; those super-chunks then go round a ring of N/U hops across the groups (device
``i`` sends to ``i + U``: the same member of the next group), with U x U chunk pairs a round.
U = N is Ulysses, U = 1 the plain ring. Per device the K/V block that travels has the ring's
size (U chunks of H/U heads), but each round computes U times as much: the ring's transfers
hide behind compute at 1/U of the ring's length, and the all-to-all stays on the fast links.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from parallel import rounds
from parallel.kernels import accumulators as ac


def _divisors(n):
    return [x for x in range(1, n + 1) if n % x == 0]


def check_heads(impl: str, q_heads: int, kv_heads: int, axis_size: int, u) -> None:
    """One-line ValueError unless the local query and kv heads split U ways (U = N for ulysses)
    and, for usp, U divides the sequence axis. Names the sizes that would work."""
    g = math.gcd(q_heads, kv_heads)
    if impl == "ulysses":
        if g % axis_size:
            ok = _divisors(g)
            raise ValueError(
                f"ulysses splits heads over the {axis_size}-way sequence axis, but query heads "
                f"({q_heads}) and kv heads ({kv_heads}) per tensor shard are not both divisible "
                f"by {axis_size}; sequence axis sizes that work: {', '.join(map(str, ok))} (or "
                f"usp/ring/allgather)")
        return
    ok = [d for d in _divisors(axis_size) if g % d == 0]
    if u is None or u < 1 or axis_size % u or g % u:
        raise ValueError(
            f"usp ulysses degree {u} must divide the sequence axis ({axis_size}) and both query "
            f"heads ({q_heads}) and kv heads ({kv_heads}) per tensor shard; valid: "
            f"{', '.join(map(str, ok))}")


def _a2a(x, ring, split, concat):
    if ring.ulysses == 1:
        return x
    return lax.all_to_all(x, ring.axis, split, concat, tiled=True, axis_index_groups=ring.groups)


def _to_heads(x_BCH_, ring):
    """Sequence-sharded ``[B, C, H, ...]`` -> head-sharded ``[B, U*C, H/U, ...]``."""
    return _a2a(x_BCH_, ring, 2, 1)


def _to_seq(x_BSH_, ring):
    return _a2a(x_BSH_, ring, 1, 2)


def _gather(x_BC, ring):
    if x_BC is None or ring.ulysses == 1:
        return x_BC
    return lax.all_gather(x_BC, ring.axis, axis=1, tiled=True, axis_index_groups=ring.groups)


def forward_local(ring):
    hops = ring.size // ring.ulysses

    def local(q_BCHD, k_BCKD, v_BCKD, pos_BC, seg_BC):
        chunk = q_BCHD.shape[1]
        q, k, v = (_to_heads(x, ring) for x in (q_BCHD, k_BCKD, v_BCKD))
        pos, seg = _gather(pos_BC, ring), _gather(seg_BC, ring)
        fwd = rounds.Rounds(ring, q, pos, seg, k.shape[2], chunk)
        acc = rounds.ring_forward(ac.kv_block(k, v, pos, seg), fwd.init(), fwd.attend, hops,
                                  lambda t: rounds.shift(t, ring))
        out, lse = fwd.finish(acc)
        return _to_seq(out, ring), lse  # lse stays head-sharded: only this backward reads it
    return local


def backward_local(ring):
    hops = ring.size // ring.ulysses

    def local(q_BCHD, k_BCKD, v_BCKD, pos_BC, seg_BC, out_BCHD, lse_BKSG, dout_BCHD):
        chunk = q_BCHD.shape[1]
        # Row sums of dout * out where the output lives: [B, C, Hq] moves instead of the output.
        delta = jnp.sum(dout_BCHD.astype(jnp.float32) * out_BCHD.astype(jnp.float32), axis=-1)
        q, k, v, dout, delta = (_to_heads(x, ring) for x in (q_BCHD, k_BCKD, v_BCKD, dout_BCHD, delta))
        pos, seg = _gather(pos_BC, ring), _gather(seg_BC, ring)
        bwd = rounds.Rounds(ring, q, pos, seg, k.shape[2], chunk, lse_BKSG, dout, delta)
        dq, dk, dv = rounds.ring_backward(ac.kv_block(k, v, pos, seg), bwd.zeros_dq(), bwd.grads,
                                          hops, lambda t: rounds.shift(t, ring))
        dk = ac.from_kv_major(dk).astype(k_BCKD.dtype)
        dv = ac.from_kv_major(dv).astype(v_BCKD.dtype)
        return _to_seq(bwd.finish_dq(dq), ring), _to_seq(dk, ring), _to_seq(dv, ring)
    return local
