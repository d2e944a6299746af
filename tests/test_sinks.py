"""Attention sinks (gpt-oss: a logit per query head in every row's softmax denominator) in
every kernel, layout and strategy, against float64 attention with the sink as one more column
(``helpers.reference``): the outputs and the gradients of q, k, v and the sinks.

The sink joins once, after the last round (``accumulators.with_sink``), and the backward reads
the sinked output and logsumexp, so what could go wrong is where the per-head sinks meet the
heads a device holds: all of them (ring, all-gather), a Ulysses member's share, a tensor
shard's; and the early-stopped ring of a sliding window. Each case is one row of the table
below; the layouts of a case share its compiled programs (positions are data).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from helpers import B, L, check, inputs, random_segments, reference
from parallel.attention import context_parallel_attention
from parallel.layouts import inverse, permutation

LAYOUTS = ("contiguous", "striped", "zigzag")
TOL = {"float32": 1e-5, "bfloat16": 2e-2}

# (kernel, impl, Ulysses degree, mesh (fsdp, sequence, tensor), heads (Hq, Hkv), mask, window,
# dtype, layouts)
CASES = {
    # every layout on the ring, GQA, packed documents
    "ring-xla": ("xla", "ring", None, (1, 4, 1), (4, 2), "packed", 0, "float32", LAYOUTS),
    # heads over tensor: each tensor shard's sinks; batch over fsdp
    "ring-tensor": ("xla", "ring", None, (2, 2, 2), (4, 2), "causal", 0, "float32", ("striped",)),
    "allgather": ("xla", "allgather", None, (1, 4, 1), (4, 4), "causal", 0, "float32",
                  ("zigzag",)),
    # a Ulysses member's share of the heads, and of a tensor shard's
    "ulysses": ("xla", "ulysses", None, (1, 4, 1), (8, 4), "packed", 0, "float32", ("striped",)),
    "usp-tensor": ("xla", "usp", 2, (1, 4, 2), (8, 4), "causal", 0, "bfloat16", ("zigzag",)),
    # a window that stops the contiguous ring early (its own positions), and striped's full ring
    "window": ("xla", "ring", None, (1, 4, 1), (4, 2), "causal", 12, "float32",
               ("contiguous", "striped")),
    # the fused kernels (interpret mode) and cuDNN's per-round stand-in
    "pallas_gpu": ("pallas_gpu", "ring", None, (1, 2, 1), (4, 2), "causal", 0, "float32",
                   ("striped",)),
    "pallas_tpu": ("pallas_tpu", "ring", None, (1, 2, 1), (4, 4), "packed", 0, "float32",
                   ("zigzag",)),
    "cudnn": ("cudnn", "ring", None, (1, 2, 1), (4, 2), "packed", 0, "bfloat16",
              ("contiguous",)),
}


def run(q, k, v, sinks, dout, *, mesh, layout, seg, dtype, **kw):
    """The attention and its gradients w.r.t. q, k, v and the sinks, inputs and results in
    natural order, as one jitted program (not op by op: a few dozen small programs fewer).
    Without a window the layout's positions go in as data, exactly what the attention derives
    from the layout when given none (the ring runs every round either way), so that the
    layouts of a case lower to one program, compiled once and then read from the run's
    compilation cache (layout is still a static argument: each is traced); with a window the
    attention derives them itself, as the contiguous ring's early stop needs. The derived
    positions of a window-free ring: tests/test_attention.py."""
    n = mesh.shape["sequence"]
    perm = permutation(layout, q.shape[1], n)
    qspec = NamedSharding(mesh, P(("fsdp",), "sequence", "tensor", None))
    put = lambda x: jax.device_put(np.asarray(x[:, perm]).astype(dtype), qspec)
    seg_l = None if seg is None else seg[:, perm]
    pos = None if kw["window"] else np.broadcast_to(perm.astype(np.int32), q.shape[:2])
    got = program(mesh, tuple(sorted(kw.items())))(
        *(put(x) for x in (q, k, v)), np.asarray(sinks, np.float32), put(dout), seg_l, pos,
        layout=layout)
    inv = inverse(perm)
    return [np.asarray(x)[:, inv] for x in got[:4]] + [np.asarray(got[4])]


@functools.cache
def program(mesh, kw):
    """(q, k, v, sinks, dout, segment ids, positions or None, layout=) -> the output and the
    gradients of q, k, v (fp32) and the sinks, jitted once per mesh and options."""
    @functools.partial(jax.jit, static_argnames="layout")
    def attention_and_grads(q, k, v, sinks, dout, seg, pos, *, layout):
        f = lambda q, k, v, sinks: context_parallel_attention(
            q, k, v, mesh=mesh, layout=layout, positions=pos, segment_ids=seg, sinks=sinks,
            **dict(kw))
        out, vjp = jax.vjp(f, q, k, v, sinks)
        return [x.astype(jnp.float32) for x in (out, *vjp(dout))]
    return attention_and_grads


@pytest.mark.parametrize("case", CASES)
def test_sinks_in_every_kernel_layout_and_strategy(rng, case):
    kernel, impl, u, (fsdp, n, tensor), heads, mask, window, dtype, layouts = CASES[case]
    mesh = jax.make_mesh((fsdp, n, tensor), ("fsdp", "sequence", "tensor"),
                         devices=jax.devices()[:fsdp * n * tensor])
    q, k, v, dout = inputs(rng, *heads, dtype=jnp.dtype(dtype))
    # sinks around the rows' own logsumexps (about log L): each takes a real share of the mass
    sinks = rng.normal(2.0, 1.5, heads[0]).astype(np.float32)
    seg = random_segments(rng, B, L) if mask == "packed" else None
    pos = np.broadcast_to(np.arange(L, dtype=np.int32), (B, L))
    want = reference(q, k, v, dout, pos, seg, True, window, sinks=sinks)
    plain = reference(q, k, v, dout, pos, seg, True, window)[0]  # the sinks change the output
    assert np.abs(plain - want[0]).max() > 0.1 * np.abs(want[0]).max()
    for layout in layouts:
        got = run(q, k, v, sinks, dout, mesh=mesh, layout=layout, seg=seg, kernel=kernel,
                  impl=impl, ulysses=u, window=window, block_q=4, block_kv=4,
                  dtype=jnp.dtype(dtype))
        check(got[:4], want[:4], TOL[dtype])
        err = np.abs(got[4] - want[4]).max() / np.abs(want[4]).max()
        assert err < TOL[dtype], f"{layout}: the sinks' gradient is off by {err:.2e}"


def test_sinks_of_the_wrong_shape_are_one_line(rng):
    q, k, v, _ = inputs(rng, 4, 2)
    mesh = jax.make_mesh((2,), ("sequence",), devices=jax.devices()[:2])
    with pytest.raises(ValueError, match=r"one logit per query head, \[4\]; got \(2,\)"):
        context_parallel_attention(q, k, v, mesh=mesh, layout="striped", sinks=np.zeros(2))


# ----------------------------------------------------------------------------- the model


def test_a_model_with_sinks_gives_the_dense_logits_and_sink_gradients_on_any_mesh(rng):
    """``model.attention_sinks``: a parameter ``[Hq]`` per layer reaching every attention path.
    The dense model on one device (XLA's dense attention, natural order) against usp (Ulysses
    groups of 2, a ring of 2) striped over fsdp 2 x sequence 4 with packed documents: the same
    logits and the same gradients of the sinks."""
    from flax import nnx

    from model.layers import AttentionBackend
    from parallel.mesh import make_mesh
    from test_model import L, make_model, random_tokens, small_config
    c = small_config()
    c.model.attention_sinks = True
    natural = make_model(rng, AttentionBackend(impl="dense", layout="contiguous"), config=c)
    assert natural.blocks.attn.sinks[...].shape == (c.model.num_layers, c.model.num_heads)
    mesh = make_mesh({"data": 1, "fsdp": 2, "sequence": 4, "tensor": 1})
    laid = make_model(rng, AttentionBackend(impl="usp", layout="striped", mesh=mesh, ulysses=2,
                                            block_q=4, block_kv=4), config=c,
                      weights_of=natural)
    tok = random_tokens(rng, 2, L)
    pos = jnp.broadcast_to(jnp.arange(L), tok.shape)
    seg = jnp.asarray(np.cumsum(rng.random(tok.shape) < 0.1, axis=1) + 1, jnp.int32)
    weights = jnp.asarray(rng.standard_normal((*tok.shape, c.model.vocab_size)), jnp.float32)
    perm = permutation("striped", L, 4)

    def run(model, tok, pos, seg, weights):
        graphdef, state = nnx.split(model)

        def loss(state):
            logits = nnx.merge(graphdef, state)(tok, pos, seg)
            return jnp.sum(logits * weights), logits
        (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
        return np.asarray(logits), np.asarray(grads["blocks"]["attn"]["sinks"])

    want_logits, want_grad = run(natural, tok, pos, seg, weights)
    got_logits, got_grad = run(laid, *(x[:, perm] for x in (tok, pos, seg, weights)))
    np.testing.assert_allclose(got_logits, want_logits[:, perm], rtol=1e-5, atol=1e-5)
    assert np.abs(want_grad).max() > 0
    np.testing.assert_allclose(got_grad, want_grad, rtol=1e-4, atol=1e-5 * np.abs(want_grad).max())


def test_decoding_with_sinks_gives_the_recomputed_greedy_tokens(rng):
    """The KV cache's decode step adds the sinks (each tensor shard its heads') once, after its
    slots are merged across the sequence devices: greedy tokens equal generating without a
    cache (one device, dense), the striped ring over sequence 2 x tensor 2."""
    from evaluation.kv_cache import Generator
    from evaluation.lengths import Buckets
    from test_kv_cache import VOCAB, config, on_mesh, random_params, reference
    c = config("striped", "ring", mesh=dict(data=1, fsdp=1, sequence=2, tensor=2))
    c.model.attention_sinks = True
    params = random_params(c, int(rng.integers(1 << 30)))
    # sinks that take most of many rows' attention (the initialiser's are near 0): without
    # them in the decode step the greedy tokens differ
    params["blocks"]["attn"]["sinks"] = np.asarray(
        rng.normal(4.0, 2.0, params["blocks"]["attn"]["sinks"].shape), np.float32)
    prompts = [rng.integers(1, VOCAB, int(n)).tolist() for n in rng.integers(5, 40, 2)]
    want = [reference(c, params, p, 10) for p in prompts]
    trainer, sharded = on_mesh(c, params)
    length = Buckets(c, trainer.mesh, c.data.seq_len)(max(map(len, prompts)))
    assert Generator(trainer, VOCAB).generate(sharded, prompts, 10, length=length,
                                              eos=-1) == want


def test_an_export_refuses_sinks_rather_than_dropping_them():
    from errors import ConversionError
    from hf import config as hf_config
    from test_model import small_config
    m = small_config().model
    assert hf_config.architecture(m) == "llama"
    m.attention_sinks = True
    # only GptOssForCausalLM has sinks, and its every layer is a mixture of experts
    with pytest.raises(ConversionError, match="model.attention_sinks with no mixture of experts"):
        hf_config.architecture(m)
