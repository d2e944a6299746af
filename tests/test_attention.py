"""Exactness of ring attention (every layout, ring size, GQA, packed documents) and of the
dense reference, against float64 numpy attention computed in natural order.

Inputs are fresh random data on every run; the seed is printed so a failure can be replayed.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from errors import LayoutError
from parallel.attention import context_parallel_attention
from parallel.kernels import accumulators as ac
from parallel.kernels import predicate, xla
from parallel.kernels.xla import dense_attention
from parallel.layouts import LAYOUTS, inverse, permutation

B, L, D = 2, 64, 16


def ring_mesh(n, axis_types=AxisType.Auto):
    return jax.make_mesh((n,), ("sequence",), axis_types=(axis_types,), devices=jax.devices()[:n])


# ----------------------------------------------------------------------------- reference


def reference(q, k, v, dout, positions, segment_ids, causal=True):
    """float64 attention and its gradients (w.r.t. q, k, v for the cotangent ``dout``).

    Written independently of the code under test: K/V are repeated per query head group.
    """
    q, k, v, dout = (np.asarray(x, np.float64) for x in (q, k, v, dout))
    hq, hkv = q.shape[2], k.shape[2]
    g = hq // hkv
    kr, vr = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    scale = 1.0 / math.sqrt(q.shape[-1])
    mask = np.ones((q.shape[0], q.shape[1], q.shape[1]), bool)
    if causal:
        mask &= positions[:, None, :] <= positions[:, :, None]
    if segment_ids is not None:
        mask &= segment_ids[:, None, :] == segment_ids[:, :, None]
    mask = mask[:, None]  # [B, 1, Lq, Lk]
    s = np.einsum("bqhd,bkhd->bhqk", q, kr) * scale
    s = np.where(mask, s, -np.inf)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(m), m, 0.0))
    denom = p.sum(-1, keepdims=True)
    p = p / np.where(denom > 0, denom, 1.0)
    out = np.einsum("bhqk,bkhd->bqhd", p, vr)
    dp = np.einsum("bqhd,bkhd->bhqk", dout, vr)
    ds = p * (dp - np.einsum("bqhd,bqhd->bhq", dout, out)[..., None])
    dq = np.einsum("bhqk,bkhd->bqhd", ds, kr) * scale
    dk = np.einsum("bhqk,bqhd->bkhd", ds, q) * scale
    dv = np.einsum("bhqk,bqhd->bkhd", p, dout)
    group = lambda x: x.reshape(*x.shape[:2], hkv, g, x.shape[-1]).sum(3)
    return out, dq, group(dk), group(dv)


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def random_segments(rng, batch, length, max_docs=5):
    """Packed documents: per row, sorted cut points into segments numbered 0, 1, ..."""
    seg = np.zeros((batch, length), np.int32)
    for b in range(batch):
        cuts = rng.choice(np.arange(1, length), size=rng.integers(1, max_docs), replace=False)
        seg[b, np.sort(cuts)] = 1
    return np.cumsum(seg, axis=1).astype(np.int32)


def inputs(rng, hq, hkv, length=L, batch=B, dtype=np.float32):
    mk = lambda h: rng.standard_normal((batch, length, h, D)).astype(np.float32)
    q, k, v, dout = mk(hq), mk(hkv), mk(hkv), mk(hq)
    if dtype != np.float32:  # the reference sees exactly the rounded values
        q, k, v, dout = (np.asarray(jnp.asarray(x, dtype).astype(jnp.float32)) for x in (q, k, v, dout))
    return q, k, v, dout


def ring_outputs(q, k, v, dout, *, mesh, layout, segment_ids=None, positions=None, dtype=jnp.float32,
                 jit=False, **kw):
    """Runs the ring on layout-ordered copies of natural-order inputs; returns natural order.

    Eager by default: the ring's compiled programs are then shared by every layout with the
    same shapes (positions are runtime data), which keeps this file fast; ``jit=True`` traces
    the whole thing (positions become compile-time constants).
    """
    n = mesh.shape["sequence"]
    perm = permutation(layout, q.shape[1], n, kw.get("stripe", 1))
    inv = inverse(perm)
    lay = lambda x: None if x is None else jnp.asarray(x[:, perm])
    cast = lambda x: lay(x).astype(dtype)

    def run(q, k, v, dout, seg, pos):
        f = lambda q, k, v: context_parallel_attention(
            q, k, v, mesh=mesh, layout=layout, positions=pos, segment_ids=seg, **kw)
        out, vjp = jax.vjp(f, q, k, v)
        return (out, *vjp(dout))

    res = (jax.jit(run) if jit else run)(cast(q), cast(k), cast(v), cast(dout), lay(segment_ids),
                                         lay(positions))
    for r in res:
        assert r.dtype == dtype
    return [np.asarray(r.astype(jnp.float32))[:, inv] for r in res]


def run_all_layouts(rng, n, heads, mask, impl="ring", dtype=jnp.float32, tol=1e-5,
                    layouts=(("contiguous", 1), ("striped", 1), ("zigzag", 1)), causal=True, **kw):
    """One case (ring size, (Hq, Hkv), mask, dtype, causal or not) in every given (layout,
    stripe) against the float64 reference; the layouts reuse one compiled program (positions
    are data). ``mask``: "packed" (documents in every row), "mixed" (in every row but the last,
    which is one document) or anything else (no segment ids)."""
    q, k, v, dout = inputs(rng, *heads, dtype=dtype)
    seg = random_segments(rng, B, L) if mask in ("packed", "mixed") else None
    if mask == "mixed":  # the last row one document: its tiles need no mask
        seg[-1] = 0
    pos = np.broadcast_to(np.arange(L, dtype=np.int32), (B, L))
    want = reference(q, k, v, dout, pos, seg, causal)
    for layout, stripe in layouts:
        got = ring_outputs(q, k, v, dout, mesh=ring_mesh(n), layout=layout, stripe=stripe,
                           segment_ids=seg, dtype=dtype, impl=impl, causal=causal, **kw)
        check(got, want, tol)


def check(got, want, tol):
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert np.all(np.isfinite(g)), f"{name} has non-finite values"
        err = rel_err(g, w)
        assert err < tol, f"{name}: relative error {err:.2e} >= {tol:.0e}"


# ----------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("mask", ["causal", "packed"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 1)], ids=["mha", "gqa4"])
@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_ring_matches_reference_fp32(rng, layout, n, heads, mask):
    q, k, v, dout = inputs(rng, *heads)
    seg = random_segments(rng, B, L) if mask == "packed" else None
    pos = np.broadcast_to(np.arange(L, dtype=np.int32), (B, L))
    got = ring_outputs(q, k, v, dout, mesh=ring_mesh(n), layout=layout, segment_ids=seg,
                       block_q=4, block_kv=8)
    check(got, reference(q, k, v, dout, pos, seg), 1e-5)


@pytest.mark.parametrize("n", [2, 8])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_ring_matches_reference_bf16(rng, layout, n):
    q, k, v, dout = inputs(rng, 4, 1, dtype=jnp.bfloat16)
    seg = random_segments(rng, B, L)
    pos = np.broadcast_to(np.arange(L, dtype=np.int32), (B, L))
    got = ring_outputs(q, k, v, dout, mesh=ring_mesh(n), layout=layout, segment_ids=seg,
                       dtype=jnp.bfloat16, block_q=4, block_kv=4)
    check(got, reference(q, k, v, dout, pos, seg), 2e-2)


@pytest.mark.parametrize("stripe", [2, 4])
def test_striped_stripe_width(rng, stripe):
    q, k, v, dout = inputs(rng, 4, 2)
    seg = random_segments(rng, B, L)
    pos = np.broadcast_to(np.arange(L, dtype=np.int32), (B, L))
    got = ring_outputs(q, k, v, dout, mesh=ring_mesh(4), layout="striped", stripe=stripe,
                       segment_ids=seg, block_q=4, block_kv=8)
    check(got, reference(q, k, v, dout, pos, seg), 1e-5)


def test_explicit_positions_reset_per_document(rng):
    """Positions restarting at each packed document (as RoPE ids do) give the same mask."""
    q, k, v, dout = inputs(rng, 4, 2)
    seg = random_segments(rng, B, L)
    starts = np.maximum.accumulate(np.where(np.diff(seg, prepend=-1, axis=1) != 0, np.arange(L), 0), axis=1)
    pos = (np.arange(L) - starts).astype(np.int32)
    got = ring_outputs(q, k, v, dout, mesh=ring_mesh(4), layout="zigzag", segment_ids=seg,
                       positions=pos, block_q=2, block_kv=4, jit=True)
    check(got, reference(q, k, v, dout, pos, seg), 1e-5)


@pytest.mark.parametrize("layout,length", [("contiguous", 8), ("striped", 8), ("zigzag", 16)])
def test_smallest_length_per_device(rng, layout, length):
    """1 token per device (2 for zigzag); the default 512 tiles are clamped to the chunk."""
    q, k, v, dout = inputs(rng, 4, 2, length=length)
    pos = np.broadcast_to(np.arange(length, dtype=np.int32), (B, length))
    got = ring_outputs(q, k, v, dout, mesh=ring_mesh(8), layout=layout, jit=True)
    check(got, reference(q, k, v, dout, pos, None), 1e-5)


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


def test_no_quadratic_residuals_under_remat_scan_grad():
    """Differentiating a remat'd layer scan must not hoist per-tile masks (computed from the
    constant positions alone) out of the scan as residuals: temporaries grow ~linearly in L."""
    mesh = ring_mesh(4)
    hq, layers = 2, 2

    def temporaries(length):
        def model(x, w):
            def layer(h, w_l):
                qkv = (h @ w_l).reshape(1, length, 3 * hq, D)
                o = context_parallel_attention(qkv[:, :, :hq], qkv[:, :, hq:2 * hq], qkv[:, :, 2 * hq:],
                                               mesh=mesh, layout="striped", block_q=8, block_kv=8)
                return h + o.reshape(1, length, hq * D), None
            return jnp.sum(jax.lax.scan(jax.checkpoint(layer), x, w)[0])

        x = jax.ShapeDtypeStruct((1, length, hq * D), jnp.float32,
                                 sharding=NamedSharding(mesh, P(None, "sequence")))
        w = jax.ShapeDtypeStruct((layers, hq * D, 3 * hq * D), jnp.float32)
        compiled = jax.jit(jax.grad(model, (0, 1))).lower(x, w).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    assert temporaries(1024) < 2.5 * temporaries(512)


# ----------------------------------------------------------------------------- ring traffic


def ppermute_hops(jaxpr, mult=1):
    """{(dtype, shape): transfers} over a jaxpr, loops (scans) counted by their trip count."""
    hops = {}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "ppermute":
            for var in eqn.invars:
                key = (str(var.aval.dtype), tuple(var.aval.shape))
                hops[key] = hops.get(key, 0) + mult
        inner = mult * (eqn.params["length"] if eqn.primitive.name == "scan" else 1)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    for key, count in ppermute_hops(sub, inner).items():
                        hops[key] = hops.get(key, 0) + count
    return hops


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


# ----------------------------------------------------------------------------- rows with no key yet


def test_rows_with_no_visible_key_in_first_blocks(rng):
    """A row whose visible keys all come in a later K/V block stays exact and NaN-free.

    Block A holds keys that every query of tile 1 sees except the first row of each q tile,
    which starts a new document; block B brings that row its keys. The running state after A
    must be harmless, and A∪B must equal the reference; a row that never sees a key gives 0.
    """
    c, hq, hkv = 16, 4, 2
    q = rng.standard_normal((1, c, hq, D)).astype(np.float32)
    kv = [rng.standard_normal((1, c, hkv, D)).astype(np.float32) for _ in range(4)]
    q_pos = np.arange(c, 2 * c, dtype=np.int32)[None]
    q_seg = np.where(np.arange(c) % 8 == 0, 1, 0).astype(np.int32)[None]  # rows 0, 8: doc 1
    a_pos, b_pos = np.arange(c, dtype=np.int32)[None], np.arange(c, dtype=np.int32)[None]
    a_seg, b_seg = np.zeros((1, c), np.int32), np.ones((1, c), np.int32)
    scale = 1.0 / math.sqrt(D)
    q_s = ac.to_q_major(jnp.asarray(q) * scale, hkv)
    block = lambda k, v, pos, seg: ac.KV(ac.to_kv_major(jnp.asarray(k)), ac.to_kv_major(jnp.asarray(v)),
                                         jnp.asarray(pos), jnp.asarray(seg))
    run = lambda acc, blk: xla.attend_block(q_s, blk, jnp.asarray(q_pos), jnp.asarray(q_seg), acc,
                                           block_q=8, block_kv=4)
    assert np.all(np.asarray(predicate.tile_cases(q_pos, a_pos, q_seg, a_seg, block_q=8, block_kv=4)) == predicate.MASKED)
    acc = run(ac.init_acc(q_s), block(kv[0], kv[1], a_pos, a_seg))
    out_a, lse_a = ac.finalize(acc)
    assert np.all(np.isfinite(np.asarray(acc.o))) and np.all(np.isfinite(np.asarray(acc.m)))
    lonely = np.asarray(q_seg[0] == 1)
    assert np.all(np.asarray(ac.from_q_major(out_a))[0, lonely] == 0)
    assert np.all(np.isinf(np.asarray(lse_a)[0, :, lonely]))
    out, _ = ac.finalize(run(acc, block(kv[2], kv[3], b_pos, b_seg)))
    k_all = np.concatenate([kv[0], kv[2]], 1)
    v_all = np.concatenate([kv[1], kv[3]], 1)
    s = np.einsum("qhd,khd->hqk", q[0].astype(np.float64), np.repeat(k_all[0], 2, 1)) * scale
    vis = np.concatenate([a_seg, b_seg], 1)[0][None, :] == q_seg[0][:, None]
    s = np.where(vis[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), np.repeat(v_all[0], 2, 1))
    assert rel_err(ac.from_q_major(out)[0], want) < 1e-5


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


# ----------------------------------------------------------------------------- dense reference


@pytest.mark.parametrize("heads", [(4, 4), (4, 1)], ids=["mha", "gqa4"])
@pytest.mark.parametrize("mask", ["causal", "packed", "bidirectional", "bidirectional-packed"])
def test_dense_attention_matches_reference(rng, heads, mask):
    q, k, v, dout = inputs(rng, *heads)
    seg = random_segments(rng, B, L) if mask.endswith("packed") else None
    pos = np.broadcast_to(np.arange(L, dtype=np.int32), (B, L))
    causal = not mask.startswith("bidirectional")

    @jax.jit
    def run(q, k, v, dout):
        f = lambda q, k, v: dense_attention(q, k, v, positions=jnp.asarray(pos),
                                            segment_ids=None if seg is None else jnp.asarray(seg),
                                            causal=causal)
        out, vjp = jax.vjp(f, q, k, v)
        return (out, *vjp(dout))

    check([np.asarray(r) for r in run(q, k, v, dout)], reference(q, k, v, dout, pos, seg, causal), 1e-5)


def test_dense_attention_bf16_and_default_positions(rng):
    q, k, v, _ = inputs(rng, 4, 2, dtype=jnp.bfloat16)
    out = dense_attention(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)))
    assert out.dtype == jnp.bfloat16
    pos = np.broadcast_to(np.arange(L, dtype=np.int32), (B, L))
    assert rel_err(np.asarray(out.astype(jnp.float32)), reference(q, k, v, q, pos, None)[0]) < 2e-2


# ----------------------------------------------------------------------------- tile predicate


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
        if it < 3:  # the kernel's (jax) evaluation of the same function agrees
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
