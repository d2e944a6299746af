"""Token layouts: which positions of a sequence each shard of the sequence axis holds.

A layout is a permutation ``perm`` of ``0..L-1``; shard ``d`` of ``N`` holds
``perm[d*C:(d+1)*C]`` with ``C = L // N``, and ``x_in_layout = x[..., perm]``.

- ``contiguous``: the ring-attention baseline, ``perm = arange(L)``.
- ``striped``: blocks of ``stripe`` consecutive tokens dealt round-robin to the shards
  (``stripe=1`` is the Striped Attention paper: shard ``d`` holds ``d, d+N, d+2N, ...``).
- ``zigzag``: the sequence cut into ``2N`` chunks; shard ``d`` holds chunks ``d`` and ``2N-1-d``.
"""
from __future__ import annotations

import numpy as np

from errors import LayoutError  # also importable as parallel.layouts.LayoutError

LAYOUTS = ("contiguous", "striped", "zigzag")


def check(layout: str, seq_len: int, num_shards: int, stripe: int = 1) -> None:
    """Raises LayoutError with one clear line when the arguments cannot form a layout."""
    if layout not in LAYOUTS:
        raise LayoutError(f"unknown layout {layout!r}; valid layouts: {', '.join(LAYOUTS)}")
    if num_shards < 1:
        raise LayoutError(f"num_shards must be >= 1, got {num_shards}")
    if stripe < 1:
        raise LayoutError(f"stripe width must be >= 1, got {stripe}")
    if seq_len < 1:
        raise LayoutError(f"seq_len must be >= 1, got {seq_len}")
    unit = {"contiguous": num_shards, "striped": num_shards * stripe, "zigzag": 2 * num_shards}[layout]
    if seq_len % unit:
        what = {
            "contiguous": f"the number of shards ({num_shards})",
            "striped": f"shards x stripe width ({num_shards} x {stripe} = {unit})",
            "zigzag": f"2 x shards (2 x {num_shards} = {unit})",
        }[layout]
        raise LayoutError(
            f"seq_len {seq_len} is not divisible by {what} for the {layout} layout; "
            f"use a multiple of {unit}, e.g. {max(unit, seq_len // unit * unit)}"
        )


def permutation(layout: str, seq_len: int, num_shards: int, stripe: int = 1) -> np.ndarray:
    """The layout's permutation of ``0..seq_len-1`` as int32; ``x_in_layout = x[..., perm]``."""
    check(layout, seq_len, num_shards, stripe)
    n = num_shards
    if layout == "contiguous":
        return np.arange(seq_len, dtype=np.int32)
    if layout == "striped":
        # Stripe-blocks laid out as [rounds, shard, stripe]; shard d takes its column.
        blocks = np.arange(seq_len, dtype=np.int32).reshape(seq_len // (n * stripe), n, stripe)
        return np.ascontiguousarray(blocks.transpose(1, 0, 2)).reshape(-1)
    chunks = np.arange(seq_len, dtype=np.int32).reshape(2 * n, seq_len // (2 * n))
    order = [c for d in range(n) for c in (d, 2 * n - 1 - d)]
    return chunks[order].reshape(-1)


def inverse(perm: np.ndarray) -> np.ndarray:
    """The inverse permutation: ``x_in_layout[..., inverse(perm)] == x``."""
    perm = np.asarray(perm)
    inv = np.empty_like(perm)
    inv[perm] = np.arange(perm.size, dtype=perm.dtype)
    return inv
