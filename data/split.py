"""Held-out split: a fixed, seed-independent set of documents that training never reads."""
from __future__ import annotations

import numpy as np

from errors import DataError

# Fixed, and apart from data.shuffle_seed: changing the shuffle must never move a held-out
# document into training.
HELDOUT_SEED = 20240917


def heldout_split(num_docs: int, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train ids, held-out ids), both sorted int64; at least one document on each side."""
    if not 0.0 <= fraction < 1.0:
        raise DataError(f"data.heldout_fraction={fraction} must be in [0, 1)")
    if num_docs < 2:
        raise DataError(f"the corpus has {num_docs} document(s); training and the held-out split "
                        f"need at least 2 (raise data.max_docs or add documents)")
    n_held = min(num_docs - 1, max(1, int(round(fraction * num_docs))))
    held = np.random.default_rng(HELDOUT_SEED).permutation(num_docs)[:n_held]
    mask = np.zeros(num_docs, bool)
    mask[held] = True
    return np.flatnonzero(~mask).astype(np.int64), np.flatnonzero(mask).astype(np.int64)


def heldout_by_key(keys: np.ndarray, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train ids, held-out ids), both sorted int64, from each unit's key in [0, 1) (a hash of
    the record: data/chat.py ``split_key``): held out when its key is below ``fraction``, so a
    record keeps its side whatever else is read (max_docs, the template, other records) and
    in any run made from it. At least one unit on each side: when the keys put none on a side,
    the unit with the smallest (or largest) key moves."""
    keys = np.asarray(keys, np.float64)
    if not 0.0 <= fraction < 1.0:
        raise DataError(f"data.heldout_fraction={fraction} must be in [0, 1)")
    if keys.size < 2:
        raise DataError(f"the data has {keys.size} record(s) to train; training and the held-out "
                        f"split need at least 2 (raise data.max_docs or add records)")
    held = keys < fraction
    if not held.any():
        held[np.argmin(keys)] = True
    if held.all():
        held[np.argmax(keys)] = False
    return np.flatnonzero(~held).astype(np.int64), np.flatnonzero(held).astype(np.int64)
