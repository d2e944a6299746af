"""Which tiles a fused kernel visits, from the one tile predicate (``predicate.py``).

For each q tile (forward, dQ) the kv tiles to visit are one range ``[lo, hi)`` with an
unmasked sub-range ``[flo, fhi)``; for each kv tile (dK/dV) the q tiles likewise. Within a
shard every layout keeps its tokens in increasing true position (contiguous, striped with any
stripe, zigzag) and packed segment ids never decrease, so the tiles the predicate computes
form one range and its unmasked tiles one sub-range: the table is then exact work. For any
other order (positions or segment ids from a user) the table stays correct, because every
tile in the range outside ``[flo, fhi)`` runs with the mask, and skipped tiles inside the
range only cost time: ``lo``/``hi`` are the first and last computed tile, ``[flo, fhi)`` the
first run of unmasked ones.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from parallel.kernels import predicate


class Visits(NamedTuple):
    by_q: jax.Array  # [B, nq, 4] int32: per q tile, kv tiles (lo, flo, fhi, hi)
    by_kv: jax.Array  # [B, nk, 4] int32: per kv tile, q tiles (lo, flo, fhi, hi)
    any: jax.Array  # bool scalar: the round computes at least one tile


def _ranges(cases):
    """``cases [..., n_outer, n_inner]`` -> ``[..., n_outer, 4]`` (lo, flo, fhi, hi)."""
    n = cases.shape[-1]
    visit = cases != predicate.SKIP
    full = cases == predicate.FULL
    idx = jnp.arange(n, dtype=jnp.int32)
    has = visit.any(-1)
    lo = jnp.where(has, jnp.argmax(visit, -1), 0).astype(jnp.int32)
    hi = jnp.where(has, n - jnp.argmax(visit[..., ::-1], -1), 0).astype(jnp.int32)
    has_full = full.any(-1)
    flo = jnp.argmax(full, -1).astype(jnp.int32)
    # end of the first run of unmasked tiles: the first tile at or after flo that is not full
    after = (idx >= flo[..., None]) & ~full
    fhi = jnp.where(after.any(-1), jnp.argmax(after, -1), n).astype(jnp.int32)
    flo, fhi = jnp.where(has_full, flo, hi), jnp.where(has_full, fhi, hi)
    return jnp.stack([lo, flo, fhi, hi], -1)


def visits(q_pos, k_pos, q_seg=None, k_seg=None, *, block_q, block_kv, causal=True,
           window=0) -> Visits:
    """Visit tables of one round: ``q_pos [B, Cq]``, ``k_pos [B, Ck]`` (and segment ids)."""
    cases = predicate.tile_cases(q_pos, k_pos, q_seg, k_seg, block_q=block_q, block_kv=block_kv,
                                 causal=causal, window=window, per_row=True)  # [B, nq, nk]
    return Visits(_ranges(cases), _ranges(jnp.swapaxes(cases, -1, -2)),
                  (cases != predicate.SKIP).any())
