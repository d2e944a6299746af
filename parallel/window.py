"""The sliding window (Mistral's convention): a query at position p sees keys with
``p - W < k_pos <= p`` (itself and the W - 1 tokens before it); W = 0 is full causal attention.

The mask itself lives in the one tile predicate (``parallel/kernels/predicate.py``); this module
holds what follows from it for a whole ring: how many rounds can have work at all.
"""
from __future__ import annotations

import math


def check(window, causal: bool = True) -> int:
    """The window as an int, or a one-line ValueError naming what would be valid."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"sliding window must be an int >= 0 (0: full attention), got {window!r}")
    if window and not causal:
        raise ValueError(f"a sliding window ({window}) needs causal attention: a window is "
                         f"measured back from each query; use window=0 or causal=True")
    return window


def reach(window: int, layout: str, block: int, hops: int) -> int:
    """Ring rounds that can have work, out of ``hops``, when each hop moves ``block``
    consecutive positions (the contiguous layout; U x C for usp's super-chunks).

    Round r holds the block that started r hops back: its newest key is (r - 1) * block + 1
    positions before the oldest query here, visible only when that distance is < W, so rounds
    ``0 .. ceil((W - 1) / block)`` can see something and no later one can. Striped and zigzag
    spread every device's positions over the whole row: every round has work there.
    """
    if not window or layout != "contiguous":
        return hops
    return min(hops, 1 + math.ceil((window - 1) / block))
