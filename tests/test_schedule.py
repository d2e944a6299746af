"""Work accounting: closed forms per layout, and counts equal to a brute-force count."""
import numpy as np
import pytest

from parallel.kernels import predicate
from parallel.layouts import permutation
from parallel.schedule import ideal_speedup, tile_limit_speedup, work


def tri(b):
    return b * (b + 1) // 2


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("b", [1, 2, 4, 6])
def test_contiguous_closed_form(n, b):
    """Round 0: the diagonal block's triangle on every device; round r: a full block on the
    devices d >= r (their past), nothing on the others (all future)."""
    block = 4
    w = work("contiguous", n * b * block, n, block)
    want = np.zeros((n, n), int)
    want[0] = tri(b)
    for r in range(1, n):
        want[r, r:] = b * b
    np.testing.assert_array_equal(w.tiles, want)
    assert w.critical_path == tri(b) + (n - 1) * b * b
    np.testing.assert_array_equal(w.masked[0], b)  # only the diagonal tiles need the mask
    assert w.masked[1:].sum() == 0


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("b", [1, 2, 4, 6])
@pytest.mark.parametrize("block", [1, 3])
def test_striped_closed_form(n, b, block):
    """Every round, every device computes the tiles j <= i of its b x b grid; with one token
    per tile the diagonal tile is skipped when the visiting block comes from a later device."""
    w = work("striped", n * b * block, n, block)
    d = np.arange(n)
    src = (d[None, :] - d[:, None]) % n
    want = np.full((n, n), tri(b))
    if block == 1:
        want = np.where(src > d[None, :], tri(b) - b, tri(b))
    np.testing.assert_array_equal(w.tiles, want)
    assert w.critical_path == n * tri(b)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("h", [1, 2, 3])
def test_zigzag_closed_form(n, h):
    """With h tiles per half chunk (b = 2h): round 0 is the triangle of the chunk, every later
    round exactly half the block (one early half fully visible from one late half)."""
    block, b = 2, 2 * h
    w = work("zigzag", n * b * block, n, block)
    want = np.full((n, n), b * b // 2)
    want[0] = tri(b)
    np.testing.assert_array_equal(w.tiles, want)
    assert w.critical_path == tri(b) + (n - 1) * b * b // 2
    assert w.masked[1:].sum() == 0  # off-diagonal rounds never need a mask


def test_speedup_over_contiguous_matches_tile_grid_cap():
    """Two devices, b tiles per block: contiguous / striped = (3b+1)/(2b+2) (the issue's cap);
    zigzag's later rounds need no diagonal tiles, so its cap is (3b+1)/(2b+1)."""
    for b in (2, 4, 16):
        c = work("contiguous", 2 * b * 8, 2, 8).critical_path
        assert c / work("striped", 2 * b * 8, 2, 8).critical_path == pytest.approx((3 * b + 1) / (2 * b + 2))
        assert c / work("zigzag", 2 * b * 8, 2, 8).critical_path == pytest.approx((3 * b + 1) / (2 * b + 1))


@pytest.mark.parametrize("layout,stripe", [("contiguous", 1), ("striped", 1), ("striped", 2),
                                           ("striped", 4), ("zigzag", 1)])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_counts_equal_brute_force(layout, stripe, n):
    """Per device and round: the kernel's tile_cases on the actual positions it holds, and an
    elementwise count of tile pairs with any visible (query, key) pair, both agree."""
    block, seq_len = 2, 8 * n * stripe
    w = work(layout, seq_len, n, block, stripe)
    perm = permutation(layout, seq_len, n, stripe)
    c = seq_len // n
    for r in range(n):
        for d in range(n):
            q_pos = perm[d * c:(d + 1) * c][None]
            s = (d - r) % n
            k_pos = perm[s * c:(s + 1) * c][None]
            case = predicate.tile_cases(q_pos, k_pos, block_q=block, block_kv=block)
            assert w.tiles[r, d] == np.sum(case != predicate.SKIP)
            assert w.masked[r, d] == np.sum(case == predicate.MASKED)
            visible = 0
            for i in range(c // block):
                for j in range(c // block):
                    qp, kp = q_pos[0, i * block:(i + 1) * block], k_pos[0, j * block:(j + 1) * block]
                    visible += bool(np.any(kp[None, :] <= qp[:, None]))
            assert w.tiles[r, d] == visible


def test_total_work_is_layout_independent():
    """Every layout computes all visible tile pairs: the same total up to diagonal tiles."""
    n, block = 4, 2
    totals = {lay: work(lay, 128, n, block).total for lay in ("contiguous", "zigzag")}
    assert totals["contiguous"] == totals["zigzag"]


def test_ideal_speedups():
    assert ideal_speedup(1) == 1.0 and ideal_speedup(2) == pytest.approx(4 / 3)
    assert tile_limit_speedup(2) == 1.5
    for n in (2, 4, 8, 16, 64):
        assert 1 < ideal_speedup(n) < tile_limit_speedup(n) < 2


def test_large_ring_is_fast():
    w = work("striped", 64 * 2048, 64, 128)
    assert w.tiles.shape == (64, 64) and w.critical_path == 64 * tri(16)


def test_bad_block_is_rejected():
    with pytest.raises(ValueError, match="block=3 does not divide the per-device chunk of 16 tokens"):
        work("striped", 32, 2, 3)


def random_packed_segments(rng, rows, seq_len):
    """Natural-order segment ids as packing makes them: documents 1.. of random lengths, then
    sometimes padding (0) at the end of a row."""
    seg = np.zeros((rows, seq_len), np.int32)
    for row in seg:
        end = seq_len - int(rng.integers(0, seq_len // 4)) * int(rng.integers(0, 2))
        cuts = np.sort(rng.choice(np.arange(1, end), size=int(rng.integers(0, 5)), replace=False))
        row[:end] = np.searchsorted(cuts, np.arange(end), side="right") + 1
    return seg


@pytest.mark.parametrize("layout,stripe", [("contiguous", 1), ("striped", 1), ("striped", 2),
                                           ("zigzag", 1)])
@pytest.mark.parametrize("n", [2, 4])
def test_document_mask_counts_equal_kernel_predicate(layout, stripe, n):
    """With packed documents, the counts are the kernel's own tile_cases on the laid-out
    positions and segment ids (batch rows combined as the kernel combines them), they never
    skip a tile pair with a visible (query, key) pair, and all-ones segment ids change nothing."""
    rng = np.random.default_rng()
    block, seq_len, rows = 2, 16 * n * stripe, 3
    seg = random_packed_segments(rng, rows, seq_len)
    w = work(layout, seq_len, n, block, stripe, segment_ids=seg)
    perm = permutation(layout, seq_len, n, stripe)
    c = seq_len // n
    pos_d = lambda d: np.broadcast_to(perm[d * c:(d + 1) * c], (rows, c))
    seg_d = lambda d: seg[:, perm][:, d * c:(d + 1) * c]
    for r in range(n):
        for d in range(n):
            s = (d - r) % n
            case = predicate.tile_cases(pos_d(d), pos_d(s), seg_d(d), seg_d(s), block_q=block, block_kv=block)
            assert w.tiles[r, d] == np.sum(case != predicate.SKIP)
            assert w.masked[r, d] == np.sum(case == predicate.MASKED)
            vis = predicate.visible(pos_d(d), pos_d(s), seg_d(d), seg_d(s)).any(0)  # [Cq, Ck]
            needed = vis.reshape(c // block, block, c // block, block).any((1, 3))
            assert np.all(case[needed] != predicate.SKIP)
    assert w.total <= work(layout, seq_len, n, block, stripe).total
    ones = work(layout, seq_len, n, block, stripe, segment_ids=np.ones((2, seq_len), np.int32))
    np.testing.assert_array_equal(ones.tiles, work(layout, seq_len, n, block, stripe).tiles)
    np.testing.assert_array_equal(ones.masked, work(layout, seq_len, n, block, stripe).masked)


def test_document_mask_rejects_wrong_shape():
    with pytest.raises(ValueError, match=r"segment_ids must be \[B, 32\], got \(2, 16\)"):
        work("striped", 32, 2, 2, segment_ids=np.ones((2, 16), np.int32))


@pytest.mark.parametrize("layout", ["contiguous", "striped", "zigzag"])
def test_strategy_critical_paths(layout):
    """Each strategy's waits, counted directly from the per-chunk-pair tiles."""
    n, seq_len, block = 8, 512, 8
    w = work(layout, seq_len, n, block)
    pair = np.zeros((n, n))  # [q chunk, kv chunk] tiles, from the rounds: kv chunk (d - r) mod n
    for r in range(n):
        for d in range(n):
            pair[d, (d - r) % n] = w.tiles[r, d]
    assert pair.sum() == w.total
    assert w.strategy_critical_path("ring") == w.critical_path
    assert w.strategy_critical_path("allgather") == pair.sum(axis=1).max()
    assert w.strategy_critical_path("ulysses") == w.total / n == w.strategy_critical_path("usp", n)
    assert w.strategy_critical_path("usp", 1) == w.critical_path
    u, rr = 2, n // 2  # groups {0,1}, {2,3}, ...; round t: group g holds kv of group g - t
    want = sum(max(pair[2 * g:2 * g + 2, 2 * ((g - t) % rr):2 * ((g - t) % rr) + 2].sum() / u
                   for g in range(rr)) for t in range(rr))
    assert w.strategy_critical_path("usp", 2) == want
    with pytest.raises(ValueError, match="ulysses degree 3 does not divide 8 shards"):
        w.strategy_critical_path("usp", 3)


@pytest.mark.parametrize("layout,exact", [("contiguous", True), ("zigzag", True),
                                          ("striped", False)])
def test_window_counts_equal_brute_force(layout, exact):
    """With a sliding window, per device and round: tiles computed = tile pairs with a visible
    (query, key) pair from predicate.visible (tiles of consecutive positions; a striped tile
    spans N positions per token and can straddle the band: there only >=). The contiguous
    ring's hops are 1 + its last round with work; the others keep every round."""
    n, block, seq_len = 4, 2, 64
    c = seq_len // n
    perm = permutation(layout, seq_len, n)
    for window in (1, 3, 7, c, c + 5, 3 * c + 1):
        w = work(layout, seq_len, n, block, window=window)
        for r in range(n):
            for d in range(n):
                q_pos, k_pos = perm[d * c:(d + 1) * c], perm[((d - r) % n) * c:][:c]
                vis = predicate.visible(q_pos, k_pos, window=window)
                some = vis.reshape(c // block, block, c // block, block).any((1, 3)).sum()
                assert w.tiles[r, d] == some if exact else w.tiles[r, d] >= some
        last = max(r for r in range(n) if w.tiles[r].any())
        assert w.hops == (last + 1 if layout == "contiguous" else n)
