"""The one tile predicate (parallel/kernels/predicate.py) against brute force, on arbitrary
positions and on every layout's."""
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import B, L, random_segments
from parallel.kernels import predicate
from parallel.layouts import permutation


def brute_force(q_pos, k_pos, q_seg, k_seg, bq, bk, causal):
    """Per tile pair: does any / every (query, key) pair of every batch row see each other?"""
    batch, cq = q_pos.shape
    ck = k_pos.shape[1]
    some = np.zeros((cq // bq, ck // bk), bool)
    every = np.ones((cq // bq, ck // bk), bool)
    for b in range(batch):
        for i in range(cq // bq):
            for j in range(ck // bk):
                qp, kp = q_pos[b, i * bq:(i + 1) * bq], k_pos[b, j * bk:(j + 1) * bk]
                vis = np.ones((bq, bk), bool)
                if causal:
                    vis &= kp[None, :] <= qp[:, None]
                if q_seg is not None:
                    vis &= k_seg[b, j * bk:(j + 1) * bk][None, :] == q_seg[b, i * bq:(i + 1) * bq][:, None]
                some[i, j] |= vis.any()
                every[i, j] &= vis.all()
    return some, every


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("segments", [False, True])
def test_tile_predicate_matches_brute_force(rng, causal, segments):
    """On arbitrary positions: skip => no visible pair, unmasked <=> every pair visible, and
    without segment ids skip <=> no visible pair (the predicate loses nothing)."""
    for it in range(20):
        bq, bk = (int(b) for b in rng.choice([1, 2, 4, 8], 2))
        q_pos = rng.integers(0, 64, (2, 16)).astype(np.int32)
        k_pos = rng.integers(0, 64, (2, 16)).astype(np.int32)
        q_seg = rng.integers(0, 3, (2, 16)).astype(np.int32) if segments else None
        k_seg = rng.integers(0, 3, (2, 16)).astype(np.int32) if segments else None
        case = predicate.tile_cases(q_pos, k_pos, q_seg, k_seg, block_q=bq, block_kv=bk, causal=causal)
        if it == 0:  # the kernel's (jax) evaluation of the same function agrees (once: the
            # same code as numpy's, each evaluation a few dozen small compiled ops)
            case_jax = predicate.tile_cases(*(None if x is None else jnp.asarray(x) for x in (q_pos, k_pos, q_seg, k_seg)),
                                     block_q=bq, block_kv=bk, causal=causal)
            np.testing.assert_array_equal(case, np.asarray(case_jax))
        some, every = brute_force(q_pos, k_pos, q_seg, k_seg, bq, bk, causal)
        assert not np.any((case == predicate.SKIP) & some)
        np.testing.assert_array_equal(case == predicate.FULL, every)
        if not segments:
            np.testing.assert_array_equal(case == predicate.SKIP, ~some)


def test_tile_predicate_exact_on_layout_positions(rng):
    """With true positions of a layout whose tiles hold consecutive tokens, and sorted packed
    documents, skip <=> nothing visible. (A striped tile can straddle a short document without
    holding any of its tokens: there the predicate is only sound, checked above.)"""
    for layout in ("contiguous", "zigzag"):
        n = 4
        perm = permutation(layout, L, n)
        seg = random_segments(rng, B, L)[:, perm]
        pos = np.broadcast_to(perm, (B, L))
        c = L // n
        for d in range(n):
            for s in range(n):
                sl_q, sl_k = slice(d * c, (d + 1) * c), slice(s * c, (s + 1) * c)
                case = predicate.tile_cases(pos[:, sl_q], pos[:, sl_k], seg[:, sl_q], seg[:, sl_k],
                                     block_q=2, block_kv=4)
                some, every = brute_force(pos[:, sl_q], pos[:, sl_k], seg[:, sl_q], seg[:, sl_k], 2, 4, True)
                np.testing.assert_array_equal(case == predicate.SKIP, ~some)
                np.testing.assert_array_equal(case == predicate.FULL, every)
