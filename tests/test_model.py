"""The decoder: shapes, causality, RoPE from given positions, layout invariance, packing.

Weights are fresh random draws from the ``rng`` fixture (its seed is printed), put into the
model's own structure (``nnx.eval_shape``: nothing of the initialiser compiles), and every
forward pass runs jitted, one program per model structure and input shape, shared by the tests
that use the same ones (eagerly, each pass of the layer scan cost about a second).
"""
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import tiny
from helpers import random_segments, reference
from model.decoder import Decoder
from model.layers import Attention, AttentionBackend, rope
from model.pattern import kinds
from parallel.layouts import permutation
from parallel.mesh import make_mesh

VOCAB, L = 97, 32


def small_config():
    c = tiny.get_config()
    c.model.update(vocab_size=VOCAB, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                   ffn_dim=48, dtype="float32", remat="none")
    return c


def random_weights(rng, abstract, std):
    """``abstract``'s module (``nnx.eval_shape``) with normal weights: norm scales at 1, the
    embedding at std 1, every other weight at ``std``, the output projections too (the model's
    own init draws those at std / sqrt(2 layers): these tests need weights, not its scales)."""
    graphdef, state = nnx.split(abstract)

    def draw(path, x):
        names = [getattr(p, "key", None) for p in path]
        if "scale" in names:
            return jnp.ones(x.shape, x.dtype)
        scale = 1.0 if names[0] == "embed" else std
        return jnp.asarray(scale * rng.standard_normal(x.shape), x.dtype)

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(draw, state))


def make_model(rng, backend=AttentionBackend(), config=None, std=None, weights_of=None):
    """The small decoder with ``backend``; fresh random weights from ``rng`` (``std``: the
    config's init_std by default), or those of the model ``weights_of``."""
    c = config or small_config()
    abstract = nnx.eval_shape(lambda: Decoder(c.model, backend, nnx.Rngs(0)))
    if weights_of is not None:
        return nnx.merge(nnx.split(abstract)[0], nnx.split(weights_of)[1])
    return random_weights(rng, abstract, c.model.init_std if std is None else std)


@functools.cache
def _forward(graphdef):
    return jax.jit(lambda state, *args: nnx.merge(graphdef, state)(*args))


def logits(model, tokens, positions, segment_ids):
    """``model(tokens, positions, segment_ids)`` as numpy, jitted (one program per model
    structure and shape)."""
    graphdef, state = nnx.split(model)
    return np.asarray(_forward(graphdef)(state, tokens, positions, segment_ids))


def random_tokens(rng, B, L, vocab=VOCAB):
    return jnp.asarray(rng.integers(0, vocab, (B, L)), jnp.int32)


def natural_positions(B, L):
    return jnp.broadcast_to(jnp.arange(L), (B, L))


def test_shapes_and_dtype(rng):
    out = logits(make_model(rng), random_tokens(rng, 2, L), natural_positions(2, L),
                 jnp.ones((2, L), jnp.int32))
    assert out.shape == (2, L, VOCAB) and out.dtype == np.float32
    assert np.all(np.isfinite(out))


def test_causal_later_token_does_not_change_earlier_logits(rng):
    model = make_model(rng)
    cut = 13
    tok = random_tokens(rng, 2, L)
    changed = tok.at[:, cut].set((tok[:, cut] + 1 + rng.integers(0, 90)) % VOCAB)
    pos, seg = natural_positions(2, L), jnp.ones((2, L), jnp.int32)
    a, b = logits(model, tok, pos, seg), logits(model, changed, pos, seg)
    np.testing.assert_array_equal(a[:, :cut], b[:, :cut])
    assert np.abs(a[:, cut:] - b[:, cut:]).max() > 1e-4


def test_rope_matches_float64_rotation(rng):
    x = rng.standard_normal((1, 5, 2, 8))
    pos = rng.integers(0, 1000, (1, 5))
    got = np.asarray(rope(jnp.asarray(x, jnp.float32), jnp.asarray(pos), 10000.0))
    freqs = 10000.0 ** (-np.arange(0, 8, 2) / 8)
    ang = pos[..., None, None] * freqs  # [1, 5, 1, 4]
    x1, x2 = x[..., :4], x[..., 4:]
    want = np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], -1)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_rope_reads_given_positions_not_array_index(rng):
    model = make_model(rng, std=0.5)  # sharp attention, so positions visibly matter
    tok = random_tokens(rng, 2, L)
    seg = jnp.ones((2, L), jnp.int32)
    base = logits(model, tok, natural_positions(2, L), seg)
    # RoPE is relative: one shift of every position leaves attention unchanged ...
    shifted = logits(model, tok, natural_positions(2, L) + int(rng.integers(1, 500)), seg)
    np.testing.assert_allclose(shifted, base, rtol=2e-3, atol=2e-3)
    # ... but spreading them apart changes it.
    spread = logits(model, tok, 3 * natural_positions(2, L), seg)
    assert np.abs(spread - base).max() > 0.05


@pytest.mark.parametrize("layout,stripe", [("striped", 1), ("striped", 2), ("zigzag", 1)])
def test_layout_permutation_is_invisible(rng, layout, stripe):
    """Tokens and positions permuted together (as the data pipeline does) permute the logits."""
    natural = make_model(rng, AttentionBackend(impl="dense", layout="contiguous"))
    mesh = make_mesh({"data": 1, "fsdp": 1, "sequence": 4, "tensor": 2})
    laid = make_model(rng, AttentionBackend(impl="dense", layout=layout, stripe=stripe,
                                            mesh=mesh), weights_of=natural)
    tok = random_tokens(rng, 2, L)
    pos = natural_positions(2, L)
    seg = jnp.asarray(np.repeat([[1, 2]], L // 2, axis=1).repeat(2, 0), jnp.int32)
    perm = permutation(layout, L, 4, stripe)
    want = logits(natural, tok, pos, seg)[:, perm]
    got = logits(laid, tok[:, perm], pos[:, perm], seg[:, perm])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_packed_document_sees_only_itself(rng):
    """With segment ids and positions restarting per document, a packed document's logits equal
    the logits of that document alone (row 0: documents a then b; row 1: b, then another one,
    which causal attention keeps from b's logits)."""
    model = make_model(rng)
    a, b, c = (random_tokens(rng, 1, n) for n in (18, 14, 18))
    tok = jnp.concatenate([jnp.concatenate([a, b], 1), jnp.concatenate([b, c], 1)])
    pos = jnp.asarray([list(range(18)) + list(range(14)), list(range(14)) + list(range(18))])
    seg = jnp.asarray([[1] * 18 + [2] * 14, [1] * 14 + [2] * 18], jnp.int32)
    out = logits(model, tok, pos, seg)
    np.testing.assert_allclose(out[0, 18:], out[1, :14], rtol=1e-5, atol=1e-5)


def test_document_mask_off_attends_across_documents(rng):
    """document_mask=False ignores segment ids: the second packed document then sees the first
    (its logits equal those of the row as one segment and differ from the masked ones)."""
    masked = make_model(rng, AttentionBackend(document_mask=True))
    open_ = make_model(rng, AttentionBackend(document_mask=False), weights_of=masked)
    tok = random_tokens(rng, 2, L)
    pos = jnp.broadcast_to(jnp.concatenate([jnp.arange(10), jnp.arange(L - 10)]), (2, L))
    seg = jnp.asarray([[1] * 10 + [2] * (L - 10)] * 2, jnp.int32)
    got = logits(open_, tok, pos, seg)
    one_doc = logits(masked, tok, pos, jnp.ones_like(seg))
    np.testing.assert_allclose(got, one_doc, rtol=1e-6, atol=1e-6)
    assert np.abs(got[:, 10:] - logits(masked, tok, pos, seg)[:, 10:]).max() > 1e-3


def test_offload_input_keeps_only_the_layer_inputs_and_on_the_host(rng, monkeypatch):
    """Under offload_input on a GPU/TPU the layer scan's one stacked residual is the layer
    inputs [layers, B, L, D], in host memory; on a CPU it runs as full remat."""
    import model.decoder as dec
    c = small_config()
    c.model.update(remat="offload_input", num_layers=3)
    model = make_model(rng, config=c)
    tok = random_tokens(rng, 2, 16)
    pos = natural_positions(2, 16)
    graphdef, params = nnx.split(model)

    def loss(params):
        return (nnx.merge(graphdef, params).hidden(tok, pos, jnp.ones((2, 16), jnp.int32)) ** 2).sum()

    cpu_grads = jax.jit(jax.grad(loss))(params)
    real_policy = dec.remat_policy
    monkeypatch.setattr(dec, "remat_policy", lambda name: real_policy(name, "gpu"))
    jaxpr = str(jax.make_jaxpr(jax.grad(loss))(params))
    stacked = re.findall(r"f32(<host>)?\[3,2,16,32\]", jaxpr)
    assert stacked and all(kind == "<host>" for kind in stacked), stacked
    leaves = jax.tree.leaves(cpu_grads)
    assert all(np.all(np.isfinite(g)) for g in leaves) and any(np.abs(g).max() > 0 for g in leaves)


@pytest.mark.parametrize("impl,sequence", [("allgather", 4), ("ulysses", 2), ("usp", 4)])
def test_every_context_parallel_impl_gives_the_dense_logits(rng, impl, sequence):
    """attention.impl reaches the strategy through the backend: same weights, striped batch,
    packed documents, same logits as dense attention in natural order."""
    natural = make_model(rng, AttentionBackend(impl="dense", layout="contiguous"))
    mesh = make_mesh({"data": 1, "fsdp": 8 // sequence, "sequence": sequence, "tensor": 1})
    laid = make_model(rng, AttentionBackend(impl=impl, layout="striped", mesh=mesh, ulysses=2,
                                            block_q=4, block_kv=4), weights_of=natural)
    tok = random_tokens(rng, 8 // sequence, L)
    pos = jnp.broadcast_to(jnp.arange(L), tok.shape)
    seg = jnp.asarray(np.cumsum(rng.random(tok.shape) < 0.1, axis=1), jnp.int32)
    perm = permutation("striped", L, sequence)
    want = logits(natural, tok, pos, seg)[:, perm]
    got = logits(laid, tok[:, perm], pos[:, perm], seg[:, perm])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def windowed_config(window):
    c = small_config()
    c.model.sliding_window = window
    return c


def test_sliding_window_attention_matches_float64(rng):
    """model.sliding_window reaches the attention: one layer's output on a contiguous ring of 4
    (chunks of 4: W = 6 reaches two back, so the ring stops after 3 of 4 rounds) against
    float64 attention with the window (helpers.reference), GQA and packed documents."""
    w, L = 6, 16
    m = windowed_config(w).model
    mesh = make_mesh({"data": 1, "fsdp": 2, "sequence": 4, "tensor": 1})
    ring = AttentionBackend(impl="ring", layout="contiguous", mesh=mesh, block_q=4, block_kv=4)
    # weights of std 0.1: attention between uniform and one-hot, so a key let in or kept out
    # by a wrong window moves the output
    attn = random_weights(rng, nnx.eval_shape(lambda: Attention(m, ring, jnp.float32,
                                                                nnx.Rngs(0))), 0.1)
    x = jnp.asarray(rng.standard_normal((2, L, m.d_model)), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(L), (2, L))
    seg = jnp.asarray(random_segments(rng, 2, L))
    graphdef, state = nnx.split(attn)
    kind = kinds(m)[0]  # every layer alike: sliding by W, the model's RoPE
    assert kind.window == w

    @jax.jit
    def run(state, x, pos, seg):
        attn = nnx.merge(graphdef, state)
        q = kind.rope(jnp.einsum("bld,dhk->blhk", x, attn.wq[...]), pos)
        k = kind.rope(jnp.einsum("bld,dhk->blhk", x, attn.wk[...]), pos)
        return attn(x, pos, seg, kind=kind), q, k, jnp.einsum("bld,dhk->blhk", x, attn.wv[...])

    got, q, k, v = (np.asarray(a) for a in run(state, x, pos, seg))
    out = reference(q, k, v, np.ones_like(q), np.asarray(pos), np.asarray(seg), window=w)[0]
    want = np.einsum("blhk,hkd->bld", out, np.asarray(attn.wo[...], np.float64))
    assert math.isclose(float(np.abs(got - want).max() / np.abs(want).max()), 0, abs_tol=1e-5)


def test_sliding_window_bounds_what_a_token_reaches(rng):
    """With W and two layers (dense attention), changing token j moves the logits of
    j .. j + 2 (W - 1) only: those before and past it are equal to the bit."""
    w, cut = 3, 9
    dense = make_model(rng, config=windowed_config(w))
    tok = random_tokens(rng, 2, L)
    changed = tok.at[:, cut].set((tok[:, cut] + 1 + rng.integers(0, 90)) % VOCAB)
    pos = natural_positions(2, L)
    seg = jnp.ones((2, L), jnp.int32)
    a, b = logits(dense, tok, pos, seg), logits(dense, changed, pos, seg)
    reach = cut + 2 * (w - 1)
    np.testing.assert_array_equal(a[:, :cut], b[:, :cut])
    np.testing.assert_array_equal(a[:, reach + 1:], b[:, reach + 1:])
    assert np.abs(a[:, reach] - b[:, reach]).max() > 0  # two hops of W - 1: a small change


@pytest.mark.parametrize("k", [1, 2])
def test_matmul_rows_is_the_einsum_in_float64(rng, k):
    """model/layers.py matmul_rows: x's last k axes against w's first k, over x's other axes
    merged into rows (the attention's q/k/v projections at k = 1, its output projection at 2)."""
    from model.layers import matmul_rows
    x = rng.standard_normal((2, 5, 3, 4)[:4 - (k == 1)])
    w = rng.standard_normal(x.shape[x.ndim - k:] + (6, 7))
    want = np.tensordot(x, w, axes=k)
    # the weight as given and with its contracted axes last; rows merged, and kept (over a mesh)
    w_t = np.moveaxis(w, tuple(range(k)), tuple(range(w.ndim - k, w.ndim)))
    for weight, transposed in ((w, False), (w_t, True)):
        for merge in (True, False):
            with jax.enable_x64():
                got = np.asarray(jax.jit(functools.partial(
                    matmul_rows, k=k, w_transposed=transposed, merge=merge))(x, weight))
            assert got.shape == want.shape and got.dtype == np.float64, (transposed, merge)
            np.testing.assert_allclose(got, want, rtol=1e-13, err_msg=f"{transposed} {merge}")


def test_the_mlps_weight_gradients_read_their_tokens_as_rows(rng):
    """On one device (rows=True) the gated MLP's weight gradients contract one axis of tokens,
    and XLA's CPU dots read the [tokens, ffn] gradients as they are: no [ffn, tokens] transposed
    copy in the compiled backward (with batch and length as two axes XLA made one of each,
    about a sixth of SmolLM2's step). The same gradients either way, in float64."""
    from model.layers import gated_mlp
    B, T, D, F = 1, 64, 16, 40
    args = [rng.standard_normal(s) for s in ((B, T, D), (D, F), (D, F), (F, D), (B, T, D))]

    def grads(rows):
        def loss(x, wg, wu, wd, dy):
            return jnp.sum(gated_mlp(x, wg, wu, wd, rows=rows) * dy)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))

    with jax.enable_x64():
        for a, b in zip(grads(True)(*args), grads(False)(*args)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-12)
    hlo = grads(True).lower(*(a.astype(np.float32) for a in args)).compile().as_text()
    assert re.search(rf"f32\[{T},{F}\]", hlo)  # the gradients are there, tokens-major
    transposed = re.findall(rf"= f32\[{F},{T}\]\S* (?:fusion|copy|transpose)\(", hlo)
    assert not transposed, transposed


def saved_residuals(f, *args) -> list[str]:
    """``jax.ad_checkpoint.print_saved_residuals``' lines: what f's backward keeps, one a line
    (its type and shape first, then where it comes from)."""
    import contextlib
    import io
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(f, *args)
    return out.getvalue().splitlines()


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_the_gate_gives_autodiffs_gradients_keeping_only_its_inputs(rng, activation):
    """``act(g) * u`` with the backward that recomputes ``act(g)``: JAX's own gradients in
    float64, and only g and u kept for it (JAX's own also keeps act(g) and, for silu,
    sigmoid(g): [tokens, ffn] each, a step's largest activations)."""
    from model.weights import ACTIVATIONS
    from model.weights import gate as _gate
    g, u, dh = (rng.standard_normal((24, 40)) for _ in range(3))

    def ours(g, u):
        return jnp.sum(_gate(activation, g, u) * dh)

    def autodiff(g, u):
        return jnp.sum(ACTIVATIONS[activation](g) * u * dh)

    with jax.enable_x64():
        for a, b in zip(jax.grad(ours, (0, 1))(g, u), jax.grad(autodiff, (0, 1))(g, u)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-13)

    def kept(f):
        return [line for line in saved_residuals(f, *(x.astype(np.float32) for x in (g, u)))
                if line.startswith("f32[24,40]") and "constant" not in line]  # (not dh)

    assert len(kept(ours)) == 2, kept(ours)
    assert len(kept(autodiff)) > 2  # what the gate saves


def test_a_layer_keeps_one_copy_of_each_projections_input_and_three_ffn_activations(rng):
    """On one device the layer scan's backward keeps, a layer: the attention's input once for
    q, k and v, the MLP's once for gate and up, and of [tokens, ffn] only the gate's and up's
    outputs and their product (the down projection's input), all as [tokens, ...] rows. Each
    projection reshaping the input itself kept q/k/v's three times and gate/up's twice, and the
    [tokens, ffn] six times (also as [B, L, ffn], and act(g), sigmoid(g)): SmolLM2's 2,048-token
    step's temporaries 5.04 GiB, 3.59 after (3.49 once the weights were no longer kept
    reshaped)."""
    c = small_config()
    c.model.update(num_layers=3)
    model = make_model(rng, config=c)
    T, D, F = 16, c.model.d_model, c.model.ffn_dim
    tok, pos = random_tokens(rng, 1, T), natural_positions(1, T)
    graphdef, params = nnx.split(model)

    def loss(params):
        return (nnx.merge(graphdef, params).hidden(tok, pos, jnp.ones((1, T), jnp.int32))
                ** 2).sum()

    lines = saved_residuals(loss, params)
    kept = [line.split()[0] for line in lines]
    assert kept.count(f"f32[3,{T},{F}]") == 3 and f"f32[3,1,{T},{F}]" not in kept, kept
    # rows of D: the attention's input and the MLP's; the attention's output for wo as
    # [tokens, heads, head_dim]
    H, K = c.model.num_heads, D // c.model.num_heads
    assert kept.count(f"f32[3,{T},{D}]") == 2 and kept.count(f"f32[3,{T},{H},{K}]") == 1, kept
    # Every weight is read back from the stack, none saved again reshaped (q/k/v/o's were, as
    # [D, heads x head_dim]: a copy of the attention's weights each step).
    weights = {line.split("['")[-1].split("']")[0] for line in lines if "from the argument" in line}
    assert weights >= {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"}, lines
    kv = c.model.num_kv_heads * K
    assert not {f"f32[3,{D},{D}]", f"f32[3,{D},{kv}]"} & set(kept), kept
