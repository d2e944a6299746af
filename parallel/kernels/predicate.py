"""The one tile predicate: which (q tile, kv tile) pairs a kernel skips, computes without a
mask, or computes with the mask, from the true positions (and segment ids) of their tokens.

Every kernel (its visit order: ``xla.py``'s work lists, the fused kernels' visit tables in
``tables.py``), the tests and the work accounting (``parallel/schedule.py``) read it from here.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

SKIP, FULL, MASKED = 0, 1, 2


def tile_case(q_min, q_max, k_min, k_max, qs_min=None, qs_max=None, ks_min=None, ks_max=None,
              *, causal=True, window=0):
    """Case of one (q tile, kv tile) pair from the ranges of its positions and segment ids.

    Works elementwise on numpy or jax arrays (broadcasting). Returns int32 SKIP / FULL / MASKED:
    skip when every key is in the future (causal), every key is older than the sliding
    ``window`` for every query (``k_pos <= q_pos - window``; 0: no window), or the segment
    ranges are disjoint; full (no mask) when every key is visible from every query and both
    tiles hold one and the same segment; masked otherwise.
    """
    never = (q_min != q_min) | (k_min != k_min)  # all False, broadcast to the pair shape
    skip = k_min > q_max if causal else never
    full = k_max <= q_min if causal else ~never
    if window:
        skip = skip | (k_max <= q_min - window)
        full = full & (k_min > q_max - window)
    if qs_min is not None:
        skip = skip | (ks_min > qs_max) | (ks_max < qs_min)
        full = full & (qs_min == qs_max) & (ks_min == ks_max) & (qs_min == ks_min)
    # (1 - skip) * (2 - full): 0 when skipped, else 1 (full) or 2 (masked).
    return ((1 - skip.astype(np.int32)) * (2 - full.astype(np.int32))).astype(np.int32)


def tile_ranges(x, block):
    """min and max of ``x [..., C]`` over consecutive tiles of ``block``: two ``[..., C/block]``."""
    t = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    return t.min(-1), t.max(-1)


def tile_cases(q_pos, k_pos, q_seg=None, k_seg=None, *, block_q, block_kv, causal=True,
               window=0, per_row=False):
    """Case table ``[..., nq, nk]`` for all tile pairs of a chunk of queries and one of keys.

    ``q_pos [..., Cq]``, ``k_pos [..., Ck]`` (and the segment ids, or None) are true positions;
    leading dims (batch rows) are combined unless ``per_row``: a pair is skipped only when it
    is skipped for every row and unmasked only when it is unmasked for every row (a row that
    would skip is then masked to nothing). Numpy in, numpy out; jax in, jax out.
    """
    xp = np if isinstance(q_pos, np.ndarray) and isinstance(k_pos, np.ndarray) else jnp
    q_min, q_max = tile_ranges(q_pos, block_q)
    k_min, k_max = tile_ranges(k_pos, block_kv)
    seg = ()
    if q_seg is not None:
        qs_min, qs_max = tile_ranges(q_seg, block_q)
        ks_min, ks_max = tile_ranges(k_seg, block_kv)
        seg = (qs_min[..., :, None], qs_max[..., :, None], ks_min[..., None, :], ks_max[..., None, :])
    case = tile_case(q_min[..., :, None], q_max[..., :, None], k_min[..., None, :], k_max[..., None, :],
                     *seg, causal=causal, window=window)
    if case.ndim > 2 and not per_row:
        lead = tuple(range(case.ndim - 2))
        all_skip = xp.all(case == SKIP, axis=lead)
        all_full = xp.all(case == FULL, axis=lead)
        case = xp.where(all_skip, SKIP, xp.where(all_full, FULL, MASKED)).astype(np.int32)
    return case


def visible(q_pos, k_pos, q_seg=None, k_seg=None, *, causal=True, window=0):
    """Elementwise mask ``[..., Cq, Ck]``: key visible from query (same segment, k_pos <= q_pos,
    and with a sliding ``window`` W > 0 also ``k_pos > q_pos - W``: Mistral's convention, a
    query sees itself and the W - 1 keys before it)."""
    xp = np if isinstance(q_pos, np.ndarray) and isinstance(k_pos, np.ndarray) else jnp
    mask = xp.ones(q_pos.shape[:-1] + (q_pos.shape[-1], k_pos.shape[-1]), dtype=bool)
    if causal:
        mask = k_pos[..., None, :] <= q_pos[..., :, None]
    if window:
        mask = mask & (k_pos[..., None, :] > q_pos[..., :, None] - window)
    if q_seg is not None:
        mask = mask & (k_seg[..., None, :] == q_seg[..., :, None])
    return mask
