"""The sliding window (``window=W``, Mistral's convention ``p - W < k_pos <= p``) through the
attention stack against the float64 reference: every layout, MHA and GQA, packed documents, W
below and above a device's chunk, every strategy and kernel; the early stopping ring
(contiguous layout) sends fewer hops and gives exactly the full ring's values.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import (B, D, L, check, inputs, ppermute_hops, random_segments, reference,
                     ring_mesh, ring_outputs)
from parallel import window as sliding
from parallel.attention import context_parallel_attention
from parallel.kernels import predicate
from parallel.kernels.xla import dense_attention
from parallel.layouts import LAYOUTS, permutation

def run_layouts(rng, n, heads, mask, window, layouts=LAYOUTS, length=L, **kw):
    """Every layout against the float64 reference; where the contiguous ring stops early, also
    the full ring (explicit positions keep every round: the striped/zigzag program) to the bit."""
    q, k, v, dout = inputs(rng, *heads, length=length)
    seg = random_segments(rng, B, length) if mask == "packed" else None
    pos = np.broadcast_to(np.arange(length, dtype=np.int32), (B, length))
    want = reference(q, k, v, dout, pos, seg, window=window)
    mesh = ring_mesh(n)
    for layout in layouts:
        got = ring_outputs(q, k, v, dout, mesh=mesh, layout=layout, segment_ids=seg,
                           window=window, block_q=4, block_kv=8, **kw)
        check(got, want, 1e-5)
        if layout == "contiguous":
            full = ring_outputs(q, k, v, dout, mesh=mesh, layout=layout, segment_ids=seg,
                                positions=pos, window=window, block_q=4, block_kv=8, **kw)
            for g, f in zip(got, full):
                np.testing.assert_array_equal(g, f)


# A ring of 4 (chunks of 16) with W past a device's chunk (25: the contiguous ring stops after 3
# of its 4 rounds, its backward loop runs one trip), MHA, causal: it compiles the early-stopping
# program and the full ring's (striped, zigzag, explicit positions). W inside the block that
# travels, GQA and packed documents, a ring stopped after 2 rounds (a backward loop of no trip):
# usp's case in test_window_in_every_strategy (the same engine: W = 13 in super-chunks of 16,
# round 4 groups); W inside a device's chunk in every layout (the striped rounds all cut by
# it): test_cudnn's ring of 2 (its fallback's rounds run the xla kernel). Every round 0 is a
# ring of one's diagonal block with the window (a ring of one: the fused kernels' test below,
# and test_cudnn's).
def test_window_matches_reference_in_every_layout(rng):
    """Outputs and dQ/dK/dV in every layout against float64 attention with the window; the
    early-stopping contiguous ring equal to the full ring to the bit. 4 devices, MHA, causal,
    W past a device's chunk of c positions (c + c/2 + 1: not a multiple of the tiles)."""
    c = L // 4
    run_layouts(rng, 4, (4, 4), "causal", c + c // 2 + 1)


@pytest.mark.parametrize("impl,n,u,heads", [("usp", 8, 2, (4, 2)), ("allgather", 4, None, (4, 2))])
def test_window_in_every_strategy(rng, impl, n, u, heads):
    """usp with N=8, U=2: super-chunks of 16 positions, W=13 reaches 2 of the 4 groups.
    (ulysses is usp with U = N: one round, the chunk pairs of this usp case.)"""
    run_layouts(rng, n, heads, "packed", 13, layouts=("contiguous", "zigzag"), impl=impl,
                ulysses=u)


@pytest.mark.parametrize("kernel", ["pallas_gpu", "pallas_tpu"])
def test_window_in_the_fused_kernels(rng, kernel):
    """Interpret mode on a CPU: the window masks inside the tiles and prunes the visit tables
    (W=13, 4x4 tiles of one 32-token chunk: skipped, masked and unmasked tiles; one device,
    since the ring around the kernel is the xla kernel's, tested above)."""
    length, w = 32, 13
    q, k, v, dout = inputs(rng, 4, 2, length=length, batch=1)
    seg = random_segments(rng, 1, length, max_docs=3)
    pos = np.arange(length, dtype=np.int32)[None]
    got = ring_outputs(q, k, v, dout, mesh=ring_mesh(1), layout="contiguous", segment_ids=seg,
                       window=w, block_q=4, block_kv=4, kernel=kernel)
    check(got, reference(q, k, v, dout, pos, seg, window=w), 1e-5)


def test_dense_attention_with_a_window(rng):
    q, k, v, dout = inputs(rng, 4, 2)
    pos = np.broadcast_to(np.arange(L, dtype=np.int32), (B, L))
    seg = random_segments(rng, B, L)
    got = jax.jit(lambda q, k, v, pos, seg: dense_attention(q, k, v, positions=pos, segment_ids=seg,
                                                            window=7))(q, k, v, pos, seg)
    check([got], reference(q, k, v, dout, pos, seg, window=7)[:1], 1e-5)


# ----------------------------------------------------------------------------- early stop


def test_window_of_one_runs_one_round(rng):
    """W = 1 (a query sees only itself): no round past the first, no transfer; out = v and no
    gradient reaches q or k (their float64 reference is rounding noise: bounded instead)."""
    length = 32
    q, k, v, dout = inputs(rng, 4, 2, length=length)
    pos = np.broadcast_to(np.arange(length, dtype=np.int32), (B, length))
    got = ring_outputs(q, k, v, dout, mesh=ring_mesh(4), layout="contiguous", window=1,
                       block_q=4, block_kv=8)
    want = reference(q, k, v, dout, pos, None, window=1)
    check(got[::3], want[::3], 1e-5)
    assert max(np.abs(got[1]).max(), np.abs(got[2]).max()) < 1e-5


def test_reach_is_the_last_round_with_a_visible_pair():
    """``window.reach`` against brute force over every round of contiguous rings: the rounds
    it keeps are exactly up to the last one where some query sees some key."""
    for n, block in [(4, 4), (8, 3), (4, 1)]:
        length = n * block
        pos = np.arange(length, dtype=np.int32)
        for w in range(0, length + 3):
            last = 0
            for r in range(n):
                for d in range(n):
                    src = (d - r) % n
                    q, k = pos[d * block:(d + 1) * block], pos[src * block:(src + 1) * block]
                    if predicate.visible(q, k, window=w).any():
                        last = max(last, r)
            want = n if w == 0 else last + 1
            assert sliding.reach(w, "contiguous", block, n) == want, (n, block, w)
            assert sliding.reach(w, "striped", block, n) == n


@pytest.mark.parametrize("layout,w,rounds", [("contiguous", 5, 2), ("contiguous", 12, 3),
                                             ("contiguous", 0, 4), ("striped", 5, 4),
                                             ("zigzag", 5, 4)])
def test_early_stop_sends_fewer_hops(layout, w, rounds):
    """N=4, C=8: forward K/V make rounds - 1 hops; backward K/V again, and fp32 dK/dV
    rounds - 1 hops with their blocks plus ONE transfer home (the full ring: N - 1 and N)."""
    n = 4
    q = jnp.zeros((1, 8 * n, 4, D), jnp.bfloat16)
    kv = jnp.zeros((1, 8 * n, 1, D), jnp.bfloat16)
    f = lambda q, k, v: context_parallel_attention(q, k, v, mesh=ring_mesh(n), layout=layout,
                                                   block_q=4, window=w)
    fwd = ppermute_hops(jax.make_jaxpr(f)(q, kv, kv).jaxpr)
    both = ppermute_hops(jax.make_jaxpr(lambda q, k, v: jax.vjp(f, q, k, v)[1](q))(q, kv, kv).jaxpr)
    block = (1, 1, 8, D)  # [B, Hkv, chunk, D] per device
    hops = {("bfloat16", block): 2 * (rounds - 1), ("int32", (1, 8)): rounds - 1}
    assert fwd == {key: c for key, c in hops.items() if c}
    bwd = {key: both[key] - fwd.get(key, 0) for key in both}
    assert bwd == {key: c for key, c in {**hops, ("float32", block): 2 * rounds}.items() if c}


# ----------------------------------------------------------------------------- predicate


def brute_force(q_pos, k_pos, bq, bk, window):
    """Per tile pair, from ``predicate.visible`` pair by pair: any / every pair visible."""
    vis = predicate.visible(q_pos, k_pos, causal=True, window=window)  # [B, Cq, Ck]
    b, cq, ck = vis.shape
    t = vis.reshape(b, cq // bq, bq, ck // bk, bk)
    return t.any((0, 2, 4)), t.all((0, 2, 4))


def test_tile_cases_with_a_window_match_brute_force(rng):
    """Random positions: skip => no visible pair, unmasked <=> every pair visible. Tiles of
    consecutive positions (contiguous and zigzag chunks): skip <=> no visible pair too."""
    for _ in range(30):
        bq, bk = (int(b) for b in rng.choice([1, 2, 4, 8], 2))
        window = int(rng.integers(1, 40))
        q_pos = rng.integers(0, 64, (2, 16)).astype(np.int32)
        k_pos = rng.integers(0, 64, (2, 16)).astype(np.int32)
        case = predicate.tile_cases(q_pos, k_pos, block_q=bq, block_kv=bk, window=window)
        some, every = brute_force(q_pos, k_pos, bq, bk, window)
        assert not np.any((case == predicate.SKIP) & some)
        np.testing.assert_array_equal(case == predicate.FULL, every)
    n, c = 4, L // 4
    for layout in ("contiguous", "zigzag"):
        pos = permutation(layout, L, n)[None]
        for window in rng.choice(np.arange(1, L + 2), 6, replace=False):
            for d in range(n):
                for s in range(n):
                    qp, kp = pos[:, d * c:(d + 1) * c], pos[:, s * c:(s + 1) * c]
                    case = predicate.tile_cases(qp, kp, block_q=2, block_kv=4, window=int(window))
                    some, every = brute_force(qp, kp, 2, 4, int(window))
                    np.testing.assert_array_equal(case == predicate.SKIP, ~some)
                    np.testing.assert_array_equal(case == predicate.FULL, every)


def test_visible_is_the_mistral_band():
    """Exact: position p sees p - W + 1 .. p (W = 3 on 6 tokens)."""
    pos = np.arange(6, dtype=np.int32)
    want = np.array([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                     [0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1]], bool)
    np.testing.assert_array_equal(predicate.visible(pos, pos, window=3), want)


@pytest.mark.parametrize("window,causal,message", [
    (-1, True, r"^sliding window must be an int >= 0 \(0: full attention\), got -1$"),
    (2.5, True, r"^sliding window must be an int >= 0"),
    (8, False, r"^a sliding window \(8\) needs causal attention"),
])
def test_bad_window_is_one_line(window, causal, message):
    x = jnp.zeros((1, 16, 2, D))
    with pytest.raises(ValueError, match=message):
        context_parallel_attention(x, x, x, mesh=ring_mesh(2), layout="striped", window=window,
                                   causal=causal)
