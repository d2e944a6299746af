"""The decoder: shapes, causality, RoPE from given positions, layout invariance, packing."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import tiny
from model.decoder import Decoder
from model.layers import AttentionBackend, rope
from parallel.layouts import permutation
from parallel.mesh import make_mesh


def small_config():
    c = tiny.get_config()
    c.model.update(vocab_size=97, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                   ffn_dim=48, dtype="float32", remat="none")
    return c


def make_model(backend=AttentionBackend(), seed=None, config=None):
    c = config or small_config()
    seed = np.random.SeedSequence().entropy % 2**31 if seed is None else seed
    return Decoder(c.model, backend, nnx.Rngs(jax.random.key(seed)))


def random_tokens(rng, B, L, vocab=97):
    return jnp.asarray(rng.integers(0, vocab, (B, L)), jnp.int32)


def test_shapes_and_dtype():
    model = make_model()
    rng = np.random.default_rng()
    tok = random_tokens(rng, 2, 16)
    pos = jnp.broadcast_to(jnp.arange(16), (2, 16))
    logits = model(tok, pos, jnp.ones((2, 16), jnp.int32))
    assert logits.shape == (2, 16, 97) and logits.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(logits)))


def test_causal_later_token_does_not_change_earlier_logits():
    model = make_model()
    rng = np.random.default_rng()
    L, cut = 24, 13
    tok = random_tokens(rng, 1, L)
    changed = tok.at[0, cut].set((tok[0, cut] + 1 + rng.integers(0, 90)) % 97)
    pos = jnp.arange(L)[None]
    seg = jnp.ones((1, L), jnp.int32)
    a, b = model(tok, pos, seg), model(changed, pos, seg)
    np.testing.assert_array_equal(np.asarray(a[0, :cut]), np.asarray(b[0, :cut]))
    assert float(jnp.abs(a[0, cut:] - b[0, cut:]).max()) > 1e-4


def test_rope_matches_float64_rotation():
    rng = np.random.default_rng()
    x = rng.standard_normal((1, 5, 2, 8))
    pos = rng.integers(0, 1000, (1, 5))
    got = np.asarray(rope(jnp.asarray(x, jnp.float32), jnp.asarray(pos), 10000.0))
    freqs = 10000.0 ** (-np.arange(0, 8, 2) / 8)
    ang = pos[..., None, None] * freqs  # [1, 5, 1, 4]
    x1, x2 = x[..., :4], x[..., 4:]
    want = np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], -1)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_rope_reads_given_positions_not_array_index():
    c = small_config()
    c.model.init_std = 0.5  # sharp attention, so positions visibly matter
    model = make_model(config=c)
    rng = np.random.default_rng()
    L = 16
    tok = random_tokens(rng, 1, L)
    seg = jnp.ones((1, L), jnp.int32)
    base = model(tok, jnp.arange(L)[None], seg)
    # RoPE is relative: one shift of every position leaves attention unchanged ...
    shifted = model(tok, jnp.arange(L)[None] + int(rng.integers(1, 500)), seg)
    np.testing.assert_allclose(np.asarray(shifted), np.asarray(base), rtol=2e-3, atol=2e-3)
    # ... but spreading them apart changes it.
    spread = model(tok, 3 * jnp.arange(L)[None], seg)
    assert float(jnp.abs(spread - base).max()) > 0.05


@pytest.mark.parametrize("layout,stripe", [("striped", 1), ("striped", 2), ("zigzag", 1)])
def test_layout_permutation_is_invisible(layout, stripe):
    """Tokens and positions permuted together (as the data pipeline does) permute the logits."""
    seed = int(np.random.SeedSequence().entropy % 2**31)
    natural = make_model(AttentionBackend(impl="dense", layout="contiguous"), seed=seed)
    mesh = make_mesh({"data": 1, "fsdp": 1, "sequence": 4, "tensor": 2})
    laid = make_model(AttentionBackend(impl="dense", layout=layout, stripe=stripe, mesh=mesh), seed=seed)
    rng = np.random.default_rng()
    L = 32
    tok = random_tokens(rng, 2, L)
    pos = jnp.broadcast_to(jnp.arange(L), (2, L))
    seg = jnp.asarray(np.repeat([[1, 2]], L // 2, axis=1).repeat(2, 0), jnp.int32)
    perm = permutation(layout, L, 4, stripe)
    want = np.asarray(natural(tok, pos, seg))[:, perm]
    got = np.asarray(laid(tok[:, perm], pos[:, perm], seg[:, perm]))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_packed_document_sees_only_itself():
    """With segment ids and positions restarting per document, a packed document's logits equal
    the logits of that document alone."""
    model = make_model()
    rng = np.random.default_rng()
    a, b = random_tokens(rng, 1, 10), random_tokens(rng, 1, 14)
    packed = jnp.concatenate([a, b], 1)
    pos = jnp.concatenate([jnp.arange(10), jnp.arange(14)])[None]
    seg = jnp.asarray([[1] * 10 + [2] * 14], jnp.int32)
    got = model(packed, pos, seg)[:, 10:]
    alone = model(b, jnp.arange(14)[None], jnp.ones((1, 14), jnp.int32))
    np.testing.assert_allclose(np.asarray(got), np.asarray(alone), rtol=1e-5, atol=1e-5)


def test_document_mask_off_attends_across_documents():
    """document_mask=False ignores segment ids: the second packed document then sees the first
    (its logits equal those of the row as one segment and differ from the masked ones)."""
    seed = int(np.random.SeedSequence().entropy % 2**31)
    masked = make_model(AttentionBackend(document_mask=True), seed=seed)
    open_ = make_model(AttentionBackend(document_mask=False), seed=seed)
    rng = np.random.default_rng()
    tok = random_tokens(rng, 2, 24)
    pos = jnp.broadcast_to(jnp.concatenate([jnp.arange(10), jnp.arange(14)]), (2, 24))
    seg = jnp.asarray([[1] * 10 + [2] * 14] * 2, jnp.int32)
    got = np.asarray(open_(tok, pos, seg))
    one_doc = np.asarray(masked(tok, pos, jnp.ones_like(seg)))
    np.testing.assert_allclose(got, one_doc, rtol=1e-6, atol=1e-6)
    assert np.abs(got[:, 10:] - np.asarray(masked(tok, pos, seg))[:, 10:]).max() > 1e-3


def test_offload_input_keeps_only_the_layer_inputs_and_on_the_host(monkeypatch):
    """Under offload_input on a GPU/TPU the layer scan's one stacked residual is the layer
    inputs [layers, B, L, D], in host memory; on a CPU it runs as full remat."""
    import model.decoder as dec
    c = small_config()
    c.model.update(remat="offload_input", num_layers=3)
    rng = np.random.default_rng()
    model = make_model(config=c)
    tok = random_tokens(rng, 2, 16)
    pos = jnp.broadcast_to(jnp.arange(16), (2, 16))
    graphdef, params = nnx.split(model)

    def loss(params):
        return (nnx.merge(graphdef, params).hidden(tok, pos, jnp.ones((2, 16), jnp.int32)) ** 2).sum()

    cpu_grads = jax.grad(loss)(params)
    real_policy = dec.remat_policy
    monkeypatch.setattr(dec, "remat_policy", lambda name: real_policy(name, "gpu"))
    jaxpr = str(jax.make_jaxpr(jax.grad(loss))(params))
    stacked = re.findall(r"f32(<host>)?\[3,2,16,32\]", jaxpr)
    assert stacked and all(kind == "<host>" for kind in stacked), stacked
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(cpu_grads))


@pytest.mark.parametrize("impl,sequence", [("allgather", 4), ("ulysses", 2), ("usp", 4)])
def test_every_context_parallel_impl_gives_the_dense_logits(impl, sequence):
    """attention.impl reaches the strategy through the backend: same weights, striped batch,
    packed documents, same logits as dense attention in natural order."""
    seed = int(np.random.SeedSequence().entropy % 2**31)
    natural = make_model(AttentionBackend(impl="dense", layout="contiguous"), seed=seed)
    mesh = make_mesh({"data": 1, "fsdp": 8 // sequence, "sequence": sequence, "tensor": 1})
    laid = make_model(AttentionBackend(impl=impl, layout="striped", mesh=mesh, ulysses=2,
                                       block_q=4, block_kv=4), seed=seed)
    rng = np.random.default_rng()
    L = 32
    tok = random_tokens(rng, 8 // sequence, L)
    pos = jnp.broadcast_to(jnp.arange(L), tok.shape)
    seg = jnp.asarray(np.cumsum(rng.random(tok.shape) < 0.1, axis=1), jnp.int32)
    perm = permutation("striped", L, sequence)
    want = np.asarray(natural(tok, pos, seg))[:, perm]
    got = np.asarray(laid(tok[:, perm], pos[:, perm], seg[:, perm]))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def windowed_config(window):
    c = small_config()
    c.model.sliding_window = window
    return c


def test_sliding_window_attention_matches_float64(rng):
    """model.sliding_window reaches the attention: one layer's output against float64
    attention with the window (helpers.reference), GQA and packed documents."""
    import math
    from helpers import random_segments, reference
    from model.layers import Attention
    w, L = 5, 24
    m = windowed_config(w).model
    attn = Attention(m, AttentionBackend(), jnp.float32, nnx.Rngs(int(rng.integers(2**31))))
    x = jnp.asarray(rng.standard_normal((2, L, m.d_model)), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(L), (2, L))
    seg = random_segments(rng, 2, L)
    got = np.asarray(attn(x, pos, jnp.asarray(seg)))
    q = np.asarray(attn.rope(jnp.einsum("bld,dhk->blhk", x, attn.wq[...]), pos))
    k = np.asarray(attn.rope(jnp.einsum("bld,dhk->blhk", x, attn.wk[...]), pos))
    v = np.asarray(jnp.einsum("bld,dhk->blhk", x, attn.wv[...]))
    out = reference(q, k, v, np.ones_like(q), np.asarray(pos), seg, window=w)[0]
    want = np.einsum("blhk,hkd->bld", out, np.asarray(attn.wo[...], np.float64))
    assert math.isclose(float(np.abs(got - want).max() / np.abs(want).max()), 0, abs_tol=1e-5)


def test_sliding_window_bounds_what_a_token_reaches():
    """With W and two layers, changing token j moves the logits of j .. j + 2 (W - 1) only:
    those past it are equal to the bit, dense and on a contiguous ring of 4 that stops early."""
    w, L, cut = 3, 32, 9
    seed = int(np.random.SeedSequence().entropy % 2**31)
    dense = make_model(seed=seed, config=windowed_config(w))
    mesh = make_mesh({"data": 1, "fsdp": 2, "sequence": 4, "tensor": 1})
    ring = make_model(AttentionBackend(impl="ring", layout="contiguous", mesh=mesh, block_q=4,
                                       block_kv=4), seed=seed, config=windowed_config(w))
    rng = np.random.default_rng()
    tok = random_tokens(rng, 2, L)
    changed = tok.at[:, cut].set((tok[:, cut] + 1 + rng.integers(0, 90)) % 97)
    pos = jnp.broadcast_to(jnp.arange(L), (2, L))
    seg = jnp.ones((2, L), jnp.int32)
    a, b = np.asarray(dense(tok, pos, seg)), np.asarray(dense(changed, pos, seg))
    reach = cut + 2 * (w - 1)
    np.testing.assert_array_equal(a[:, :cut], b[:, :cut])
    np.testing.assert_array_equal(a[:, reach + 1:], b[:, reach + 1:])
    assert np.abs(a[:, reach] - b[:, reach]).max() > 0  # two hops of W - 1: a small change
    np.testing.assert_allclose(np.asarray(ring(tok, pos, seg)), a, rtol=1e-5, atol=1e-5)
