"""Attention chosen per layer (model/pattern.py) and the blocks of Qwen3 / Gemma 3 / SmolLM3.

One small model has every family difference switched on at once: sliding and full layers with
their own RoPE (local base, scaled global base), q/k norm, a head_dim apart from d_model /
heads, 1 + w norms, sandwich norms, scaled embeddings, GeGLU, query_pre_attn_scalar and final
soft-capping. Its 5 layers repeat (sliding, full) twice and end with one sliding layer, a depth
that is not a whole number of periods (the scan over the layers switches to each one's kind).
Its logits are checked against a float64 decoder written here in numpy (and with NoPE layers),
and its loss and gradients in every layout, strategy and kernel against those of one device.
"""
import functools
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import tiny
from configs.validate import validate
from errors import ConfigError
from helpers import ppermute_hops, random_segments
from model import pattern
from model.decoder import Decoder
from model.layers import AttentionBackend
from parallel.layouts import permutation
from parallel.mesh import make_mesh
from parallel.window import reach

VOCAB, L, W = 61, 32, 6


def family_config(**fields):
    c = tiny.get_config()
    c.model.update(vocab_size=VOCAB, d_model=32, num_layers=5, num_heads=4, num_kv_heads=2,
                   head_dim=12, ffn_dim=40, dtype="float32", remat="none", sliding_window=W,
                   layer_types=pattern.repeat("sliding,full", 5),
                   local_rope_theta=100.0, rope_theta=10000.0, qk_norm=True,
                   norm_unit_offset=True, sandwich_norms=True, scale_embeddings=True,
                   mlp_activation="gelu_tanh", query_pre_attn_scalar=20.0,
                   final_logit_softcap=3.0, tie_embeddings=True, norm_eps=1e-6)
    c.model.rope_scaling.update(type="linear", factor=2.0)
    c.model.update(fields)
    return c


def abstract_model(config, backend=AttentionBackend()):
    """``config``'s decoder with shapes for weights (nothing drawn, placed or compiled): enough
    to trace it (make_jaxpr) or to call it where it stops before reading a weight."""
    return nnx.eval_shape(lambda: Decoder(config.model, backend, nnx.Rngs(0)))


def random_model(rng, config, backend=AttentionBackend(), weights_of=None):
    """``config``'s decoder with random weights: norms' w too (they start at 0 or 1 and
    would hide a mistake), or the weights of the model ``weights_of``."""
    graphdef, state = nnx.split(abstract_model(config, backend))
    if weights_of is not None:
        return nnx.merge(graphdef, nnx.split(weights_of)[1])

    def draw(path, x):
        names = [getattr(p, "key", None) for p in path]
        std = 0.3 if "scale" in names else 1.0 if names[0] == "embed" else 0.25
        return jnp.asarray(std * rng.standard_normal(x.shape), x.dtype)

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(draw, state))


@functools.cache
def _forward(graphdef):
    return jax.jit(lambda state, *args: nnx.merge(graphdef, state)(*args))


def logits(model, *args):
    graphdef, state = nnx.split(model)
    return np.asarray(_forward(graphdef)(state, *args))


# ----------------------------------------------------------------------------- float64 decoder


def _norm(x, w, eps, offset):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (offset + w)


def _rope(x, pos, theta, factor=1.0):
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d) / factor
    ang = pos[..., None, None] * inv  # [B, L, 1, d/2]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang),
                           x2 * np.cos(ang) + x1 * np.sin(ang)], -1)


def reference_logits(params, m, tokens, pos, seg):
    """The decoder of ``m`` in float64 numpy, layer by layer from its layer_types."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    off = 1.0 if m.norm_unit_offset else 0.0
    eps, hd = m.norm_eps, m.head_dim
    x = p["embed"][tokens] * (math.sqrt(m.d_model) if m.scale_embeddings else 1.0)
    for i, kind in enumerate(m.layer_types.split(",")):
        b = jax.tree.map(lambda a, i=i: a[i], p["blocks"])
        a = b["attn"]
        h = _norm(x, b["attn_norm"]["scale"], eps, off)
        q = np.einsum("bld,dhk->blhk", h, a["wq"])
        k = np.einsum("bld,dhk->blhk", h, a["wk"])
        v = np.einsum("bld,dhk->blhk", h, a["wv"])
        q = _norm(q, a["q_norm"]["scale"], eps, off)
        k = _norm(k, a["k_norm"]["scale"], eps, off)
        sliding = kind.startswith("sliding")
        if not kind.endswith("_nope"):
            theta, factor = ((m.local_rope_theta, 1.0) if sliding
                             else (m.rope_theta, m.rope_scaling.factor))
            q, k = _rope(q, pos, theta, factor), _rope(k, pos, theta, factor)
        k, v = (np.repeat(t, m.num_heads // m.num_kv_heads, axis=2) for t in (k, v))
        s = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(m.query_pre_attn_scalar)
        visible = (pos[:, None, :] <= pos[:, :, None]) & (seg[:, None, :] == seg[:, :, None])
        if sliding:
            visible &= pos[:, None, :] > pos[:, :, None] - m.sliding_window
        s = np.where(visible[:, None], s, -np.inf)
        e = np.exp(s - s.max(-1, keepdims=True))
        o = np.einsum("bhqk,bkhd->bqhd", e / e.sum(-1, keepdims=True), v)
        y = np.einsum("blhk,hkd->bld", o, a["wo"])
        x = x + _norm(y, b["attn_post_norm"]["scale"], eps, off)
        h = _norm(x, b["mlp_norm"]["scale"], eps, off)
        g = h @ b["mlp"]["w_gate"]
        gelu = 0.5 * g * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3)))
        y = (gelu * (h @ b["mlp"]["w_up"])) @ b["mlp"]["w_down"]
        x = x + _norm(y, b["mlp_post_norm"]["scale"], eps, off)
    z = _norm(x, p["final_norm"]["scale"], eps, off) @ p["embed"].T
    return np.tanh(z / m.final_logit_softcap) * m.final_logit_softcap


def batch(rng, rows):
    tok = jnp.asarray(rng.integers(0, VOCAB, (rows, L)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (rows, L))
    seg = jnp.asarray(random_segments(rng, rows, L, max_docs=2), jnp.int32)
    return tok, pos, seg


@pytest.mark.parametrize("unit", ["sliding,full", "full,sliding_nope,full_nope"])
def test_mixed_stack_matches_float64(rng, unit):
    c = family_config(layer_types=pattern.repeat(unit, 5))
    model = random_model(rng, c)
    tok, pos, seg = batch(rng, 2)
    got = logits(model, tok, pos, seg)
    params = nnx.to_pure_dict(nnx.split(model, nnx.Param)[1])
    want = reference_logits(params, c.model, np.asarray(tok), np.asarray(pos), np.asarray(seg))
    # soft-capped at 3: the logits span the cap, so a layer gone wrong shows
    assert np.abs(want).max() > 1.5
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 2e-5, err


def _logits_and_grads(model, tok, pos, seg, cot):
    """The logits, and the gradients of their sum weighted by ``cot``."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state):
        logits_of = lambda s: nnx.merge(graphdef, s)(tok, pos, seg)
        out, vjp = jax.vjp(logits_of, state)
        return out, vjp(cot)[0]

    out, grads = run(state)
    return np.asarray(out), jax.tree.map(np.asarray, nnx.to_pure_dict(grads))


def assert_same(got_logits, got_grads, want_logits, want_grads):
    """Logits and every gradient leaf equal within fp32 noise (relative to the leaf's max)."""
    np.testing.assert_allclose(got_logits, want_logits, rtol=0,
                               atol=1e-5 * np.abs(want_logits).max())
    for path, g in jax.tree_util.tree_leaves_with_path(got_grads):
        w = functools.reduce(lambda t, k: t[k.key], path, want_grads)
        assert np.abs(g - w).max() <= 2e-5 * np.abs(w).max() + 1e-7, jax.tree_util.keystr(path)


ROWS = 4  # one_device's batch: split over fsdp = 8 / sequence (2 or 4) devices


@functools.cache
def one_device():
    """The 5-layer stack on one device: its model, a batch of ROWS rows (and the logits'
    cotangent), its logits and gradients; once per process, the reference of every layout,
    strategy and kernel below and of remat. Fresh random data on every run: the seed is
    returned first, for each test that reads these to print (``STRIPEDJAX_SEED`` replays it,
    as the rng fixture's)."""
    seed = int(os.environ.get("STRIPEDJAX_SEED") or np.random.SeedSequence().entropy)
    rng = np.random.default_rng(seed)
    model = random_model(rng, family_config())
    tok, pos, seg = batch(rng, ROWS)
    cot = jnp.asarray(rng.standard_normal((ROWS, L, VOCAB)), jnp.float32)
    return (seed, model, (tok, pos, seg, cot), *_logits_and_grads(model, tok, pos, seg, cot))


def _one_device():
    """one_device(), its seed printed (shown by pytest when the test fails)."""
    seed, *rest = one_device()
    print(f"one_device numpy seed {seed}")
    return rest


def _compare_with_one_device(backend, sequence, layout):
    one, inputs, want_logits, want_grads = _one_device()
    laid = random_model(None, family_config(), backend, weights_of=one)
    perm = permutation(layout, L, sequence, backend.stripe)
    got_logits, got_grads = _logits_and_grads(laid, *(a[:, perm] for a in inputs))
    assert_same(got_logits, got_grads, want_logits[:, perm], want_grads)


@pytest.mark.parametrize("layout,impl,sequence,kernel", [
    ("contiguous", "ring", 4, "xla"), ("striped", "ring", 4, "pallas_gpu"),
    ("zigzag", "ring", 4, "pallas_tpu"), ("contiguous", "ring", 4, "cudnn"),
    ("striped", "allgather", 4, "xla"), ("zigzag", "ulysses", 2, "xla"),
    ("contiguous", "usp", 4, "xla")])
def test_mixed_stack_in_every_layout_strategy_and_kernel(layout, impl, sequence, kernel):
    """The logits and every gradient equal one device's (fp32 noise), packed documents: every
    layout, strategy and kernel at least once (a covering set, as test_kernels' is), each
    kernel on a ring (the fused ones in interpret mode, cuDNN's with its dense stand-in); on the
    contiguous ring the local layers stop after their second round."""
    mesh = make_mesh({"data": 1, "fsdp": 8 // sequence, "sequence": sequence, "tensor": 1})
    block = 4 if kernel == "xla" else 8  # the fused kernels' tiles: 8 rows at the least
    backend = AttentionBackend(impl=impl, layout=layout, mesh=mesh, kernel=kernel, ulysses=2,
                               block_q=block, block_kv=block)
    _compare_with_one_device(backend, sequence, layout)


def _layer_scans(model, rows, rng):
    """[(scan length, the jaxprs of the branches of the switch in its body, if any)] of the
    forward's top-level scans (traced only: ``model`` may be an abstract_model)."""
    graphdef, state = nnx.split(model)
    tok, pos, seg = batch(rng, rows)
    jaxpr = jax.make_jaxpr(lambda s: nnx.merge(graphdef, s).hidden(tok, pos, seg))(state).jaxpr

    def switches(j):
        found = []
        for e in j.eqns:
            if e.primitive.name == "cond":
                found.append([b.jaxpr for b in e.params["branches"]])
                continue
            for param in e.params.values():
                sub = getattr(param, "jaxpr", param)
                if hasattr(sub, "eqns"):
                    found += switches(sub)
        return found

    out = []
    for e in jaxpr.eqns:
        if e.primitive.name == "scan":
            found = switches(e.params["jaxpr"].jaxpr)
            assert len(found) <= 1
            out.append((e.params["length"], found[0] if found else []))
    return out


def test_local_layers_stop_the_contiguous_ring_early(rng):
    """A ring of 4 (chunks of 8): W = 6 reaches one device back, so each sliding layer's K/V
    make 1 hop and each full layer's 3: the scan's switch has a branch per kind, each running
    its own ring."""
    c = family_config()
    mesh = make_mesh({"data": 1, "fsdp": 2, "sequence": 4, "tensor": 1})
    model = abstract_model(c, AttentionBackend(impl="ring", layout="contiguous", mesh=mesh))
    [(length, branches)] = _layer_scans(model, 2, rng)
    kinds = pattern.kinds(c.model)
    distinct = list(dict.fromkeys(kinds))  # the switch's branches, in order
    rounds = [reach(k.window, "contiguous", L // 4, 4) if k.window else 4 for k in distinct]
    assert length == len(kinds) and len(branches) == len(distinct) and sorted(rounds) == [2, 4]
    block = (1, 2, L // 4, 12)  # [B, Hkv, chunk, D] per device
    assert [ppermute_hops(b)[("float32", block)] for b in branches] == [
        2 * (r - 1) for r in rounds]


def test_the_stack_is_one_scan_over_its_layers(rng):
    """5 layers of period 2, 5 of period 3 and Gemma-3-1B's 26 layers (4 x 6 + 2): one scan
    over every layer, each step switching to its layer's kind (a branch per kind); a model
    whose layers are alike scans one layer a step with no switch, as before the pattern."""
    scans = lambda c: [(n, len(b)) for n, b in _layer_scans(abstract_model(c), 1, rng)]
    assert scans(family_config()) == [(5, 2)]
    assert scans(family_config(layer_types="")) == [(5, 0)]
    assert scans(family_config(layer_types=pattern.repeat("full,sliding_nope,full_nope", 5))) \
        == [(5, 3)]
    assert scans(family_config(num_layers=26, layer_types=pattern.repeat(
        "sliding," * 5 + "full", 26))) == [(26, 2)]


def test_explicit_full_layers_equal_the_default_to_the_bit(rng):
    c = family_config(layer_types="", sliding_window=0)
    a = random_model(rng, c)
    b = random_model(rng, family_config(layer_types="full," * 4 + "full", sliding_window=0),
                     weights_of=a)
    tok, pos, seg = batch(rng, 2)
    np.testing.assert_array_equal(logits(a, tok, pos, seg), logits(b, tok, pos, seg))


def test_default_fields_add_no_parameter():
    """A Llama config's parameters are those it had before the families' fields existed."""
    c = tiny.get_config()
    abstract = nnx.eval_shape(lambda: Decoder(c.model, AttentionBackend(), nnx.Rngs(0)))
    names = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(
        nnx.to_pure_dict(nnx.split(abstract, nnx.Param)[1]))}
    assert not {n for n in names if "q_norm" in n or "post_norm" in n}
    assert {n.split("']")[-2].split("['")[-1] for n in names} == {
        "embed", "scale", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "head"}


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_the_gated_mlp_runs_swiglu_and_geglu_where_checkpoints_keep_it(rng, activation):
    """model.layers.GatedMLP is down(act(gate(x)) * up(x)) with SiLU (SwiGLU: Llama, Qwen) or
    tanh GELU (GeGLU: Gemma), against float64; a decoder keeps its weights at the paths
    checkpoints hold (blocks/mlp/w_gate, w_up, w_down), whatever the class is called."""
    from model.layers import GatedMLP
    c = family_config(mlp_activation=activation)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: GatedMLP(c.model, jnp.float32,
                                                                nnx.Rngs(0))))
    state = jax.tree.map(lambda a: jnp.asarray(0.3 * rng.standard_normal(a.shape), a.dtype),
                         state)
    mlp = nnx.merge(graphdef, state)
    x = rng.standard_normal((2, L, c.model.d_model)).astype(np.float32)
    got = np.asarray(jax.jit(lambda x: mlp(x))(x))
    w = {k: np.asarray(getattr(mlp, k)[...], np.float64) for k in ("w_gate", "w_up", "w_down")}
    g = x.astype(np.float64) @ w["w_gate"]
    act = (g / (1 + np.exp(-g)) if activation == "silu" else
           0.5 * g * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3))))
    want = (act * (x.astype(np.float64) @ w["w_up"])) @ w["w_down"]
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    abstract = nnx.eval_shape(lambda: Decoder(tiny.get_config().model, AttentionBackend(),
                                              nnx.Rngs(0)))
    paths = {tuple(k.key for k in p) for p, _ in jax.tree_util.tree_leaves_with_path(
        nnx.to_pure_dict(nnx.split(abstract, nnx.Param)[1]))}
    assert paths == {("embed",), ("head",), ("final_norm", "scale"),
                     ("blocks", "attn_norm", "scale"), ("blocks", "mlp_norm", "scale"),
                     *(("blocks", "attn", w) for w in ("wq", "wk", "wv", "wo")),
                     *(("blocks", "mlp", w) for w in ("w_gate", "w_up", "w_down"))}


@pytest.mark.parametrize("fields,message", [
    ({"layer_types": "sliding,global,full,full"}, "'global'; each layer is one of"),
    ({"layer_types": "full,full,full"}, "lists 3 layers but model.num_layers=4"),
    ({"layer_types": "full,sliding,full,full", "sliding_window": 0}, "sliding layers but "
     "model.sliding_window=0"),
    ({"local_rope_theta": -1.0}, "local_rope_theta=-1 must be >= 0"),
    ({"mlp_activation": "relu"}, "mlp_activation='relu' is not one of silu, gelu_tanh"),
    ({"final_logit_softcap": -30.0}, "final_logit_softcap=-30.0 must be a number >= 0"),
    # a field no layer reads: a local RoPE base without a sliding layer that rotates
    ({"local_rope_theta": 1e4}, "model.local_rope_theta=10000 is the sliding layers' RoPE "
     "base, but no layer slides (model.sliding_window=0); set it to 0"),
    ({"local_rope_theta": 1e4, "sliding_window": 8, "layer_types": "full,sliding_nope,full,full"},
     "model.local_rope_theta=10000 is the sliding layers' RoPE base, but model.layer_types "
     "has no sliding layer with RoPE (full, sliding_nope); set it to 0"),
    # a window without a sliding layer
    ({"sliding_window": 8, "layer_types": "full,full_nope,full,full"}, "model.sliding_window=8 "
     "is the sliding layers' window, but model.layer_types has none (full, full_nope); set it "
     "to 0 or list sliding layers"),
])
def test_a_bad_pattern_stops_in_one_line(fields, message):
    c = tiny.get_config()
    c.model.update(num_layers=4, **fields)
    with pytest.raises(ConfigError) as e:
        validate(c, 8)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_window_or_local_rope_that_some_layer_reads_is_valid():
    """With layer_types empty every layer slides when sliding_window is set (its local RoPE
    base too); with a list, a window and a local base that its sliding layers read."""
    for fields in ({"sliding_window": 8}, {"sliding_window": 8, "local_rope_theta": 1e4},
                   {"sliding_window": 8, "local_rope_theta": 1e4,
                    "layer_types": "full,sliding,full_nope,sliding_nope"},
                   {"sliding_window": 8, "layer_types": "full,full,full,sliding_nope"}):
        c = tiny.get_config()
        c.model.update(num_layers=4, **fields)
        validate(c, 8)
        kinds = pattern.kinds(c.model)
        assert [k.window for k in kinds] == [8 if n.startswith("sliding") else 0
                                             for n in pattern.names(c.model)]
        local = [k.rope.theta for k, n in zip(kinds, pattern.names(c.model)) if n == "sliding"]
        assert local == [fields.get("local_rope_theta") or c.model.rope_theta] * len(local)


def test_a_layer_runs_only_with_its_kind(rng):
    """Attention and Block hold no window or RoPE of their own: called without their layer's
    kind they stop (a missing argument) instead of running the model's one window and RoPE,
    whatever model.layer_types says; with it, a block of a 'full' layer in a model whose
    sliding_window is set attends over the whole row."""
    from model.layers import Attention, Block
    c = family_config()
    m = c.model
    x = jnp.asarray(rng.standard_normal((1, L, m.d_model)), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(L), (1, L))
    seg = jnp.zeros((1, L), jnp.int32)
    graphdef, stacked = nnx.split(random_model(rng, c).blocks)
    one = nnx.merge(graphdef, jax.tree.map(lambda t: t[1], stacked))  # layer 1: a full one
    # shapes for weights: the call stops at its arguments, before any weight is read
    attention = nnx.eval_shape(lambda: Attention(m, AttentionBackend(), jnp.float32,
                                                 nnx.Rngs(0)))
    for call in (lambda: one(x, pos, seg), lambda: one.attend(x, pos, seg),
                 lambda: attention(x, pos, seg), lambda: attention.attend(x, pos, seg)):
        with pytest.raises(TypeError, match="kind"):
            call()
    full = pattern.kinds(m)[1]
    assert full.window == 0 and m.sliding_window == W
    # a token far past the window still moves the last position's output: no window applies
    out, moved = jax.jit(lambda x: [one.attend(y, pos, seg, kind=full)[0]
                                    for y in (x, x.at[:, 0].add(1.0))])(x)
    assert np.abs(np.asarray(out - moved)[:, -1]).max() > 1e-6


def test_repeat_runs_and_describe():
    assert pattern.repeat("sliding,sliding,full", 4) == "sliding,sliding,full,sliding"
    assert pattern.runs("aabcc") == [("a", 0, 2), ("b", 2, 3), ("c", 3, 5)]
    assert pattern.runs(()) == []
    c = family_config(num_layers=12, layer_types=pattern.repeat("sliding," * 5 + "full", 12))
    assert pattern.describe(c.model) == "5 sliding : full (W=6)"
    assert pattern.period(pattern.kinds(c.model)) == 6


def test_remat_and_the_chunked_mlp_keep_the_mixed_stack_exact():
    """remat=full (each layer checkpointed with its own kind) and the MLP over chunks of 8
    tokens (GeGLU inside, the sandwich norm after the chunks) give the plain stack's logits and
    gradients (one_device's: the plain 5-layer stack, its weights and batch)."""
    plain, inputs, want_logits, want_grads = _one_device()
    other = random_model(None, family_config(remat="full", mlp_chunk=8), weights_of=plain)
    got_logits, got_grads = _logits_and_grads(other, *inputs)
    assert_same(got_logits, got_grads, want_logits, want_grads)


def _stack_config(layer_types, remat):
    """7 layers (2 periods of 3 and a remainder of 1 for the pattern below) whose weights
    outweigh a layer's activations, on fsdp x sequence = 2 x 2. Attention is XLA's dense
    attention (each branch's own window): the weights' slices, joins and copies checked below
    are the layer scan's, its switch's and the optimizer's, whatever attends inside a layer (an
    unrolled stack, model.scan_layers=False, shows the same 49 joins and 2.4x the temporary
    memory with the ring as with dense), and the ring's forward and backward would more than
    double each compile (the ring in a mixed stack:
    test_mixed_stack_in_every_layout_strategy_and_kernel)."""
    c = tiny.get_config()
    c.model.update(vocab_size=VOCAB, d_model=64, num_layers=7, num_heads=4, num_kv_heads=2,
                   ffn_dim=512, dtype="float32", remat=remat, layer_types=layer_types,
                   sliding_window=W if layer_types else 0)
    c.attention.update(impl="dense")
    c.mesh.update(data=1, fsdp=2, sequence=2, tensor=1)
    c.data.update(seq_len=48, batch_size=2)
    return c


def _train_step(c):
    """(the compiled train step's HLO text, its temporary bytes, each stacked block weight's
    per-device shape)."""
    from training.state import Trainer
    trainer = Trainer(c, make_mesh(c.mesh, jax.devices()[:c.mesh.fsdp * c.mesh.sequence]))
    compiled = trainer.train_step.lower(trainer.abstract_state,
                                        trainer.abstract_batch()).compile()
    abstract = trainer.abstract_state.params["blocks"]
    shapes = [tuple(a.sharding.shard_shape(a.shape)) for a in jax.tree.leaves(abstract)]
    return compiled.as_text(), compiled.memory_analysis().temp_size_in_bytes, shapes


def test_a_train_step_reads_and_writes_the_weight_stack_in_place():
    """A pattern whose depth is not a whole number of periods (sliding, sliding, full; 7 layers:
    2 periods and a remainder of 1, as Gemma-3-1B's 26 = 4 x 6 + 2): the compiled train step
    holds no array of a part of the stacked weights (k of the 7 layers, or periods x period),
    makes no whole stack by a pad, concatenate or slice (a gradient joined from its pieces),
    and needs less temporary memory than a stack more than the same stack with every layer
    alike (which scans it as its input): no copy of the stack or of its gradient. (What it
    does need more is a layer's worth: the switch between kinds keeps its branch's outputs
    apart before the scan stores them.) Under remat=full, the default; remat=none builds the
    same scan and switch; two more compiles would check it again."""
    n, remat = 7, "full"
    hlo, temp, shapes = _train_step(_stack_config(pattern.repeat("sliding,sliding,full", n),
                                                  remat))
    rests = {s[1:] for s in shapes if len(s) >= 3}  # a layer's weight, rank >= 2
    assert len(rests) >= 4 and all(s[0] == n for s in shapes)
    parts, joined = [], []
    for dims, op in re.findall(r"= f32\[([\d,]*)\]\{[^}]*\} ([\w-]+)\(", hlo):
        d = tuple(int(x) for x in dims.split(",") if x)
        if (len(d) > 1 and d[1:] in rests and 1 < d[0] < n) or (
                len(d) > 2 and d[2:] in rests and min(d[:2]) > 1 and d[0] * d[1] <= n):
            parts.append((op, d))
        if len(d) > 1 and d[0] == n and d[1:] in rests and op in ("pad", "concatenate", "slice"):
            joined.append((op, d))
    stack = 4 * sum(math.prod(s) for s in shapes)
    _, alike, _ = _train_step(_stack_config("", remat))
    extra = (temp - alike) / stack
    assert not parts and not joined and extra < 1, (
        f"{len(parts)} arrays of part of the weight stack {sorted(set(parts))[:3]}..., "
        f"{len(joined)} of the whole stack joined {sorted(set(joined))[:3]}; temporary memory "
        f"{temp} bytes against {alike} with every layer alike: {extra:+.2f} stacks")
