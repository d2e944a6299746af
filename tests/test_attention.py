"""Exactness of context-parallel attention (ring: every layout, ring size, GQA, packed
documents; explicit meshes, remat'd scans), its traffic and its input checks, against float64
numpy attention computed in natural order (``helpers.reference``).

Inputs are fresh random data on every run; the seed is printed so a failure can be replayed.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from errors import LayoutError
from helpers import (B, D, L, check, inputs, missing_pairs, ppermute_hops, random_segments,
                     reference, rel_err, ring_mesh, ring_outputs, run_all_layouts)
from parallel.attention import context_parallel_attention
from parallel.kernels.xla import dense_attention
from parallel.layouts import inverse, permutation


# ----------------------------------------------------------------------------- exactness


# (ring size, heads, mask, dtype), each case in every layout (a layout only changes the data:
# the layouts of a case share its one compiled program). Each case compiles a forward and a
# backward program, so instead of the product (24 programs) the table holds every pair of values
# of any two factors (asserted below). The ring sizes are its three paths: N=1 one round (no
# loop, no transfer), N=2 a forward loop of one trip and a backward loop of none, N=4 the
# general loop; larger rings only run the same loops longer (N=8: test_smallest_length_per_device,
# test_window's usp over a ring of 4 groups of 2).
CASES = [(1, "mha", "causal", "float32"), (1, "gqa4", "packed", "bfloat16"),
         (2, "mha", "packed", "bfloat16"), (2, "gqa4", "causal", "float32"),
         (4, "mha", "packed", "float32"), (4, "gqa4", "causal", "bfloat16")]
assert not missing_pairs(CASES)
HEADS = {"mha": (4, 4), "gqa4": (4, 1)}
TOL = {"float32": 1e-5, "bfloat16": 2e-2}
TILES = {"block_q": 4, "block_kv": 8}  # several q and kv tiles per chunk at every N
LAYOUTS = [("contiguous", 1), ("striped", 1), ("zigzag", 1)]
# Stripe widths > 1 deal blocks of tokens: only the data changes, so they ride on one case.
WIDE_STRIPES = [("striped", 2), ("striped", 4)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_ring_matches_reference_in_every_layout(rng, case):
    """Outputs and dQ/dK/dV of the ring against float64 attention (natural order), in every
    layout (and stripe widths 2 and 4 in the N=4 packed fp32 case; a ring of one holds the
    whole row in every layout, each permutation the identity: the same run, made once)."""
    n, heads, mask, dtype = case
    layouts = LAYOUTS + WIDE_STRIPES if case == (4, "mha", "packed", "float32") else LAYOUTS
    if n == 1:
        assert all(np.array_equal(permutation(lay, L, 1, s), np.arange(L)) for lay, s in layouts)
        layouts = layouts[:1]
    run_all_layouts(rng, n, HEADS[heads], mask, dtype=jnp.dtype(dtype), tol=TOL[dtype],
                    layouts=layouts, **TILES)


def test_explicit_positions_reset_per_document(rng):
    """Positions restarting at each packed document (as RoPE ids do) give the same mask. The
    shapes and tiles of test_ring_matches_reference_in_every_layout[4-mha-packed-float32]:
    positions are data, so this reuses that case's compiled program."""
    q, k, v, dout = inputs(rng, *HEADS["mha"])
    seg = random_segments(rng, B, L)
    starts = np.maximum.accumulate(np.where(np.diff(seg, prepend=-1, axis=1) != 0, np.arange(L), 0), axis=1)
    pos = (np.arange(L) - starts).astype(np.int32)
    got = ring_outputs(q, k, v, dout, mesh=ring_mesh(4), layout="zigzag", segment_ids=seg,
                       positions=pos, **TILES)
    check(got, reference(q, k, v, dout, pos, seg), 1e-5)


@pytest.mark.parametrize("layout,length", [("contiguous", 8), ("zigzag", 16)])
def test_smallest_length_per_device(rng, layout, length):
    """1 token per device (2 for zigzag), on a ring of 8, under jit; the default 512 tiles are
    clamped to the chunk. (Striped with one token per device is the contiguous permutation.)"""
    q, k, v, dout = inputs(rng, 4, 2, length=length)
    pos = np.broadcast_to(np.arange(length, dtype=np.int32), (B, length))
    got = ring_outputs(q, k, v, dout, mesh=ring_mesh(8), layout=layout, jit=True)
    check(got, reference(q, k, v, dout, pos, None), 1e-5)


def test_backward_tiles_at_most_256_where_they_divide():
    from parallel.kernels.xla import backward_tile
    got = {b: backward_tile(b) for b in (16, 96, 256, 300, 384, 512, 1024, 307)}
    assert got == {16: 16, 96: 96, 256: 256, 300: 150, 384: 192, 512: 256, 1024: 256, 307: 307}
    from parallel.kernels import tiling  # the plan the rounds read: forward whole, backward half
    fwd, dq, dkv = tiling.plan("xla", 512, 512, group=2, head_dim=16, dtype="float32", chunk=512,
                               seq_len=1024, shards=2, interpret=False)
    assert fwd[:2] == (512, 512) and dq[:2] == dkv[:2] == (256, 256)


def test_default_tiles_backward_on_half_tiles_matches_reference(rng):
    """512-token chunks on a ring of 2 with the default 512 tiles: the forward on one tile a
    chunk, the backward on 256 x 256 tiles (parallel/kernels/xla.py XLA_BWD_TILE), packed
    documents; outputs and gradients against float64."""
    length = 1024
    q, k, v, dout = inputs(rng, 2, 1, length=length, batch=1)
    seg = random_segments(rng, 1, length)
    pos = np.broadcast_to(np.arange(length, dtype=np.int32), (1, length))
    got = ring_outputs(q, k, v, dout, mesh=ring_mesh(2), layout="zigzag", segment_ids=seg)
    check(got, reference(q, k, v, dout, pos, seg), 1e-5)


def test_batch_over_fsdp_heads_over_tensor(rng):
    """Batch split over data/fsdp and heads over tensor gives the same answer."""
    mesh = jax.make_mesh((1, 2, 2, 2), ("data", "fsdp", "sequence", "tensor"),
                         axis_types=(AxisType.Auto,) * 4)
    q, k, v, dout = inputs(rng, 4, 2)
    seg = random_segments(rng, B, L)
    pos = np.broadcast_to(np.arange(L, dtype=np.int32), (B, L))
    spec = NamedSharding(mesh, P(("data", "fsdp"), "sequence", "tensor", None))
    perm = permutation("striped", L, 2)
    place = lambda x: jax.device_put(x[:, perm], spec)

    @jax.jit
    def run(q, k, v, dout, seg):
        f = lambda q, k, v: context_parallel_attention(q, k, v, mesh=mesh, layout="striped",
                                                       segment_ids=seg, block_q=8, block_kv=4)
        out, vjp = jax.vjp(f, q, k, v)
        return (out, *vjp(dout))

    res = run(place(q), place(k), place(v), place(dout), jnp.asarray(seg[:, perm]))
    assert res[0].sharding.spec == spec.spec
    got = [np.asarray(r)[:, inverse(perm)] for r in res]
    check(got, reference(q, k, v, dout, pos, seg), 1e-5)


def test_explicit_mesh_under_scan_and_grad(rng):
    """Inside lax.scan over layers, under jax.grad, on a mesh with Explicit axes."""
    mesh = ring_mesh(4, AxisType.Explicit)
    layers, hq, hkv = 2, 4, 2
    x = rng.standard_normal((B, L, hq * D)).astype(np.float32)
    w = (rng.standard_normal((layers, hq * D, (hq + 2 * hkv) * D)) / math.sqrt(hq * D)).astype(np.float32)
    perm = permutation("zigzag", L, 4)

    def model(x, w, attend):
        def layer(h, w_l):
            qkv = (h @ w_l).reshape(B, L, hq + 2 * hkv, D)
            q, k, v = qkv[:, :, :hq], qkv[:, :, hq:hq + hkv], qkv[:, :, hq + hkv:]
            return h + attend(q, k, v).reshape(B, L, hq * D), None
        return jnp.sum(jnp.tanh(jax.lax.scan(layer, x, w)[0]))

    ring = lambda q, k, v: context_parallel_attention(q, k, v, mesh=mesh, layout="zigzag",
                                                      block_q=4, block_kv=4)
    dense = lambda q, k, v: dense_attention(q, k, v)  # natural order, plain autodiff
    with jax.set_mesh(mesh):
        xs = jax.device_put(x[:, perm], NamedSharding(mesh, P(None, "sequence")))
        got_loss, (gx, gw) = jax.jit(jax.value_and_grad(lambda x, w: model(x, w, ring), (0, 1)))(xs, w)
    want_loss, (wx, ww) = jax.jit(jax.value_and_grad(lambda x, w: model(x, w, dense), (0, 1)))(x, w)
    assert abs(float(got_loss) - float(want_loss)) < 1e-4 * abs(float(want_loss))
    assert rel_err(np.asarray(gx)[:, inverse(perm)], wx) < 1e-5
    assert rel_err(gw, ww) < 1e-5


def ring_layer_stack(mesh, hq, length, layout, block, remat=False):
    """A scan over layers whose attention is the ring: loss(x [1, L, hq*D], w [layers, hq*D,
    3*hq*D]), each layer's q, k, v from one projection, residual added."""
    def model(x, w):
        def layer(h, w_l):
            qkv = (h @ w_l).reshape(1, length, 3 * hq, D)
            o = context_parallel_attention(qkv[:, :, :hq], qkv[:, :, hq:2 * hq], qkv[:, :, 2 * hq:],
                                           mesh=mesh, layout=layout, block_q=block, block_kv=block)
            return h + o.reshape(1, length, hq * D), None
        return jnp.sum(jax.lax.scan(jax.checkpoint(layer) if remat else layer, x, w)[0])
    return model


def test_the_ring_is_traced_once_under_scan_and_grad(monkeypatch):
    """The custom VJP's primal and its forward rule run one ring program: autodiff's replay of
    the layer scan (linearize) hits the first trace's cache instead of tracing the ring again,
    6% of the tiny train step's trace and lowering. Shapes no other test traces, so no earlier
    cache entry counts."""
    from parallel.strategies import engine
    traced = []
    ring_forward = engine.ring_forward
    monkeypatch.setattr(engine, "ring_forward", lambda *a: traced.append(1) or ring_forward(*a))
    hq, length, layers = 3, 40, 2
    model = ring_layer_stack(ring_mesh(4), hq, length, "zigzag", 5)
    x = jax.ShapeDtypeStruct((1, length, hq * D), jnp.float32)
    w = jax.ShapeDtypeStruct((layers, hq * D, 3 * hq * D), jnp.float32)
    jax.make_jaxpr(jax.grad(model, (0, 1)))(x, w)
    assert len(traced) == 1


def test_no_quadratic_residuals_under_remat_scan_grad():
    """Differentiating a remat'd layer scan must not hoist per-tile masks (computed from the
    constant positions alone) out of the scan as residuals: temporaries grow ~linearly in L."""
    mesh = ring_mesh(4)
    hq, layers = 2, 2

    def temporaries(length):
        model = ring_layer_stack(mesh, hq, length, "striped", 8, remat=True)
        x = jax.ShapeDtypeStruct((1, length, hq * D), jnp.float32,
                                 sharding=NamedSharding(mesh, P(None, "sequence")))
        w = jax.ShapeDtypeStruct((layers, hq * D, 3 * hq * D), jnp.float32)
        compiled = jax.jit(jax.grad(model, (0, 1))).lower(x, w).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    assert temporaries(1024) < 2.5 * temporaries(512)


# ----------------------------------------------------------------------------- ring traffic


@pytest.mark.parametrize("n", [2, 4])
def test_ring_traffic(n):
    """Forward: K/V (Hkv heads only, input dtype) make N-1 hops, none wasted after the last
    round. Backward: K/V again N-1 hops, fp32 dK/dV N hops (home)."""
    q = jnp.zeros((1, 8 * n, 4, D), jnp.bfloat16)
    kv = jnp.zeros((1, 8 * n, 1, D), jnp.bfloat16)
    f = lambda q, k, v: context_parallel_attention(q, k, v, mesh=ring_mesh(n), layout="striped", block_q=4)
    fwd = ppermute_hops(jax.make_jaxpr(f)(q, kv, kv).jaxpr)
    both = ppermute_hops(jax.make_jaxpr(lambda q, k, v: jax.vjp(f, q, k, v)[1](q))(q, kv, kv).jaxpr)
    block = (1, 1, 8, D)  # [B, Hkv, chunk, D] per device
    assert fwd == {("bfloat16", block): 2 * (n - 1), ("int32", (1, 8)): n - 1}
    bwd = {key: both[key] - fwd.get(key, 0) for key in both}
    assert bwd == {("bfloat16", block): 2 * (n - 1), ("int32", (1, 8)): n - 1, ("float32", block): 2 * n}


# ----------------------------------------------------------------------------- validation


def test_tile_not_dividing_chunk_is_rejected():
    x = jnp.zeros((1, 64, 2, D))
    with pytest.raises(ValueError, match=r"^block_q=12 does not divide the per-device chunk of 32 "
                       r"tokens \(seq_len 64 / 2 sequence shards\); valid block_q: 1, 2, 4, 8, 16, 32 "):
        context_parallel_attention(x, x, x, mesh=ring_mesh(2), layout="striped", block_q=12)
    with pytest.raises(ValueError, match=r"^block_kv=24 does not divide .* valid block_kv: "):
        context_parallel_attention(x, x, x, mesh=ring_mesh(2), layout="zigzag", block_kv=24)


def test_length_not_divisible_by_layout_is_rejected():
    x = jnp.zeros((1, 36, 2, D))
    with pytest.raises(LayoutError, match=r"seq_len 36 is not divisible by 2 x shards \(2 x 4 = 8\)"):
        context_parallel_attention(x, x, x, mesh=ring_mesh(4), layout="zigzag")


def test_bad_head_counts_are_rejected():
    q, kv = jnp.zeros((1, 16, 4, D)), jnp.zeros((1, 16, 3, D))
    with pytest.raises(ValueError, match="query heads a multiple of kv heads"):
        context_parallel_attention(q, kv, kv, mesh=ring_mesh(2), layout="striped")
