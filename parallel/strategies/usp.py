"""The ring, Ulysses and their hybrid (Ulysses x ring, "usp"): one strategy, U devices per
all-to-all group.

The sequence axis (N devices) is split into N/U groups of U neighbouring devices (one node on
real hardware). An all-to-all inside each group turns sequence-sharded ``q, k, v [B, C, H, D]``
into head-sharded ``[B, U*C, H/U, D]`` (the group's U chunks, H/U heads); positions and segment
ids are all-gathered in the group, so the mask reads the true positions of every slot. The
tokens stay in layout order (member ``u``'s chunk at ``[u*C, (u+1)*C)``), and the per-round
kernel is called chunk pair by chunk pair (``rounds.py``), so tiles are skipped exactly as in the
ring. Those super-chunks then go round a ring of N/U hops across the groups (device ``i`` sends
to ``i + U``: the same member of the next group), with U x U chunk pairs a round, and an
all-to-all turns the output (and dQ/dK/dV) back.

- U = 1 is the ring: no all-to-all, each device keeps its chunk of queries and the K/V blocks,
  with the true positions and segment ids of their tokens, travel round all N devices.
- U = N is Ulysses: every device attends over the whole row on H/N heads, no ring.

Per device the K/V block that travels has the ring's size (U chunks of H/U heads), but each
round computes U times as much: the ring's transfers hide behind compute at 1/U of the ring's
length, and the all-to-all stays on the fast links.
"""
from __future__ import annotations

import math

import jax
from jax import lax

from parallel.kernels import accumulators as ac
from parallel.strategies import Strategy


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


class Usp(Strategy):
    """``call.ulysses`` = U: 1 for the ring, N for ulysses."""

    def __init__(self, call):
        super().__init__(call)
        self.hops = call.size // call.ulysses
        self.rounds = call.rounds or self.hops  # call.rounds: the window's reach, < hops

    def shift(self, tree, hops=1):
        """``hops`` hops round the ring in one transfer: device d sends to d + hops * U (U = 1
        for the plain ring; the hybrid's ring connects the same member of neighbouring Ulysses
        groups)."""
        n, u = self.call.size, self.call.ulysses
        perm = [(i, (i + hops * u) % n) for i in range(n)]
        return jax.tree.map(lambda x: lax.ppermute(x, self.call.axis, perm), tree)

    def _a2a(self, x, split, concat):
        if self.call.ulysses == 1:
            return x
        return lax.all_to_all(x, self.call.axis, split, concat, tiled=True,
                              axis_index_groups=self.call.groups)

    def to_heads(self, x_BCH_):
        """Sequence-sharded ``[B, C, H, ...]`` -> head-sharded ``[B, U*C, H/U, ...]``."""
        return self._a2a(x_BCH_, 2, 1)

    def to_seq(self, x_BSH_):
        return self._a2a(x_BSH_, 1, 2)

    def heads(self, x_H):
        """Member ``u`` of a group holds heads ``[u H/U, (u+1) H/U)`` after ``to_heads``."""
        u = self.call.ulysses
        if u == 1:
            return x_H
        share = x_H.shape[0] // u
        member = lax.axis_index(self.call.axis) % u
        return lax.dynamic_slice_in_dim(x_H, member * share, share)

    def _gather(self, x_BC):
        if x_BC is None or self.call.ulysses == 1:
            return x_BC
        return lax.all_gather(x_BC, self.call.axis, axis=1, tiled=True,
                              axis_index_groups=self.call.groups)

    def meet(self, q_BCHD, k_BCKD, v_BCKD, pos_BC, seg_BC):
        q, k, v = (self.to_heads(x) for x in (q_BCHD, k_BCKD, v_BCKD))
        pos, seg = self._gather(pos_BC), self._gather(seg_BC)
        return q, pos, seg, ac.kv_block(k, v, pos, seg)

    def home(self, d_BKSD, dtype):
        return self.to_seq(ac.from_kv_major(d_BKSD).astype(dtype))
