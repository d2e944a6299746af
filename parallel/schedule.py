"""Work accounting of ring attention: tiles computed per device per round, per layout.

Uses the kernel's own tile predicate (``parallel.kernels.predicate.tile_case``) on the true positions
each device holds, so these counts are exactly the (q tile, kv tile) pairs the kernel computes
for causal attention, with or without the packed-document mask and a sliding window. A ring
round takes as long as its busiest device, so the critical path is the sum over rounds of the
per-round maximum.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from parallel.kernels.predicate import FULL, MASKED, SKIP, tile_case
from parallel.layouts import check, permutation
from parallel.window import reach


@dataclasses.dataclass(frozen=True)
class Work:
    layout: str
    seq_len: int
    num_shards: int
    block: int
    stripe: int
    tiles: np.ndarray  # [rounds, devices] tile pairs computed (masked or not)
    masked: np.ndarray  # [rounds, devices] of which computed with the mask
    window: int = 0  # sliding window W (0: full causal attention)

    @property
    def tiles_per_chunk(self) -> int:
        return self.seq_len // self.num_shards // self.block

    @property
    def critical_path(self) -> int:
        """Sum over rounds of the busiest device's tiles: the ring's time in tile units."""
        return int(self.tiles.max(axis=1).sum())

    def strategy_critical_path(self, impl: str = "ring", ulysses: int = 1) -> float:
        """Attention time in tile units of a context-parallel strategy (``parallel/strategies``)
        from the same tile pairs: what waits for what differs, the pairs computed do not.

        ring: the sum over rounds of the busiest device. allgather: nothing waits between
        chunks, so the busiest device's total. ulysses: every device computes all chunk pairs
        on 1/N of the heads, the total / N. usp (U-device groups, a ring of N/U across them):
        per ring round, the busiest group's U x U chunk pairs / U.
        """
        return float(strategy_rounds(self.tiles, impl, ulysses).sum())

    @property
    def hops(self) -> int:
        """Rounds the ring runs: all N, or with a window in the contiguous layout only those it
        reaches (``parallel/window.py``; the rounds after it hold no tile: asserted)."""
        n = self.num_shards
        run = reach(self.window, self.layout, self.seq_len // n, n)
        assert not self.tiles[run:].any(), "a round the early-stopping ring drops has work"
        return run

    @property
    def total(self) -> int:
        return int(self.tiles.sum())

    @property
    def balance(self) -> float:
        """Average work per device over the critical path (1.0 = no device ever waits)."""
        return self.total / self.num_shards / self.critical_path


def work(layout: str, seq_len: int, num_shards: int, block: int, stripe: int = 1,
         segment_ids=None, block_kv: int | None = None, window: int = 0) -> Work:
    """Per-device, per-round tile counts of causal ring attention with square tiles of ``block``
    (rectangular ``block`` x ``block_kv`` tiles when ``block_kv`` is given: q x kv), with a
    sliding ``window`` W when > 0 (keys ``p - W < k_pos <= p``).

    Round ``r``: device ``d`` holds its own queries and the K/V block of device ``d - r mod N``.
    ``segment_ids [B, L]`` (natural order, as packed) restrict attention to each document, as
    the kernel does with the document mask on; the batch's rows share one tile schedule, so a
    pair is skipped only when it is skipped in every row. None: plain causal attention.
    """
    check(layout, seq_len, num_shards, stripe)
    n, chunk = num_shards, seq_len // num_shards
    block_kv = block if block_kv is None else block_kv
    for name, b in (("block", block), ("block_kv", block_kv)):
        if b < 1 or chunk % b:
            raise ValueError(f"{name}={b} does not divide the per-device chunk of {chunk} tokens "
                             f"(seq_len {seq_len} / {n} shards)")
    perm = permutation(layout, seq_len, n, stripe)
    lo, hi = _ranges(perm, n, block)  # [device, q tile]
    klo, khi = _ranges(perm, n, block_kv)  # [device, kv tile]
    d = np.arange(n)
    src = (d[None, :] - d[:, None]) % n  # [round, device] -> device whose K/V block it holds
    seg = () if segment_ids is None else _segment_ranges(segment_ids, perm, src, n, block, block_kv)
    case = tile_case(lo[None, :, :, None], hi[None, :, :, None],
                     klo[src][:, :, None, :], khi[src][:, :, None, :], *seg, causal=True,
                     window=window)
    if case.ndim == 5:  # [row, round, device, q tile, kv tile]: combine the rows
        case = np.where((case == SKIP).all(0), SKIP, np.where((case == FULL).all(0), FULL, MASKED))
    tiles = (case != SKIP).sum(axis=(-2, -1))
    masked = (case == MASKED).sum(axis=(-2, -1))
    return Work(layout, seq_len, n, block, stripe, tiles, masked, window)


def strategy_rounds(tiles: np.ndarray, impl: str = "ring", ulysses: int = 1) -> np.ndarray:
    """Per synchronised round of a strategy, the busiest device's tiles (fractional where a
    device computes chunk pairs on 1/U of the heads), from the ring's ``tiles [rounds, devices]``
    (round ``r``, device ``d``: its queries against chunk ``d - r``). ring: N rounds;
    allgather: one (nothing waits between chunks); usp: N/U ring rounds of U x U chunk pairs
    per group split over its U devices by heads; ulysses: usp with U = N, one round."""
    n = tiles.shape[1]
    if impl == "ring":
        return tiles.max(axis=1).astype(float)
    if impl == "allgather":
        return np.array([tiles.sum(axis=0).max()], float)
    u = n if impl == "ulysses" else ulysses
    if u < 1 or n % u:
        raise ValueError(f"ulysses degree {u} does not divide {n} shards")
    a = np.arange(n)
    pair = tiles[(a[:, None] - a[None, :]) % n, a[:, None]]  # [q chunk, kv chunk]
    r = n // u
    groups = pair.reshape(r, u, r, u).sum(axis=(1, 3)) / u  # [q group, kv group]
    g = np.arange(r)
    return groups[g[None, :], (g[None, :] - g[:, None]) % r].max(axis=1)  # [round]


def _ranges(x, n, block):
    """min and max of ``x [..., L]`` over the tiles of ``block`` of each of ``n`` chunks:
    two ``[..., n, tiles]``."""
    t = x.reshape(*x.shape[:-1], n, -1, block)
    return t.min(-1), t.max(-1)


def _segment_ranges(segment_ids, perm, src, n, block, block_kv):
    """Per-row segment id ranges of the query tiles ``[B, 1, device, tile, 1]`` and of the
    kv tiles held in each round ``[B, round, device, 1, tile]``."""
    seg = np.asarray(segment_ids)
    if seg.ndim != 2 or seg.shape[1] != perm.size:
        raise ValueError(f"segment_ids must be [B, {perm.size}], got {seg.shape}")
    lo, hi = _ranges(seg[:, perm], n, block)  # [row, device, q tile]
    klo, khi = _ranges(seg[:, perm], n, block_kv)  # [row, device, kv tile]
    return (lo[:, None, :, :, None], hi[:, None, :, :, None],
            klo[:, src][:, :, :, None, :], khi[:, src][:, :, :, None, :])


def ideal_speedup(num_shards: int) -> float:
    """2N/(N+1): the issue's ideal speedup of a balanced layout over contiguous.

    In that model a contiguous round costs a full block on the busiest device, while a balanced
    layout pays a full block only in its first (diagonal) round and half a block afterwards.
    With tiles skipped inside the diagonal block too (as this kernel does), the limit for
    many tiles per block is (2N-1)/N instead: see :func:`tile_limit_speedup`.
    """
    return 2 * num_shards / (num_shards + 1)


def tile_limit_speedup(num_shards: int) -> float:
    """(2N-1)/N: contiguous's (N - 1/2) blocks over a balanced layout's N/2, as tiles shrink."""
    return (2 * num_shards - 1) / num_shards
