"""KV-cache generation (evaluation/kv_cache.py) against generation without a cache
(evaluation/recompute.py) on a random model: the same greedy tokens for every layout and
context-parallel strategy on 4 simulated devices, in fp32 and bf16, for rows of different
prompt lengths in one batch."""
import math

import jax
import numpy as np
import pytest
from flax import nnx

from configs import tiny
from evaluation import recompute
from evaluation.kv_cache import EMPTY, Generator, Sampling
from evaluation.lengths import Buckets
from helpers import initial_params
from model.decoder import single_device_model
from model.pattern import repeat
from parallel.mesh import make_mesh
from training.state import Trainer

VOCAB = 256


def config(layout="striped", impl="ring", dtype="float32", mesh=None, window=0):
    c = tiny.get_config()
    # init_std 0.3: peaked next-token distributions, so greedy picks are not near-ties that
    # bf16 rounding could flip
    c.model.update(vocab_size=VOCAB, d_model=64, num_layers=2, num_heads=8, num_kv_heads=4,
                   ffn_dim=96, dtype=dtype, init_std=0.3, sliding_window=window)
    c.attention.update(layout=layout, impl=impl, block_q=8, block_kv=8,
                       ulysses=2 if impl == "usp" else 1)
    c.mesh.update(**(mesh or dict(data=1, fsdp=1, sequence=4, tensor=1)))
    c.data.update(seq_len=256, batch_size=2)
    return c


def random_params(c, seed):
    """Fresh weights from ``seed`` drawn as the model's initialiser draws them
    (helpers.initial_params: nothing of the initialiser compiles). Parameters depend on neither
    dtype, window, layout nor strategy."""
    return initial_params(np.random.default_rng(seed), c, single_device_model(c)[1])


def on_mesh(c, params):
    mesh = make_mesh(c.mesh, jax.devices()[:4])
    trainer = Trainer(c, mesh)
    return trainer, jax.device_put(params, trainer.param_shardings)


def reference(c, params, prompt, new, eos=-1):
    graphdef, _ = single_device_model(c)
    one = jax.device_put(params, jax.devices()[0])
    return recompute.generate(graphdef, one, prompt, new, seq_len=c.data.seq_len,
                              usable_vocab=VOCAB, eos=eos)


def reference_logits(c, params, prompts, tokens):
    """Per row, the next-token logits before each of its ``tokens`` after its ``prompt``, from
    one jitted forward pass of the batch on one device (dense, natural order; each row padded
    after its sequence, which causal attention keeps from every logit read)."""
    graphdef, _ = single_device_model(c)
    ids = np.zeros((len(prompts), c.data.seq_len), np.int32)
    for row, (p, t) in enumerate(zip(prompts, tokens)):
        ids[row, :len(p) + len(t)] = p + t
    forward = jax.jit(lambda params, ids, pos, seg: nnx.merge(graphdef, params)(ids, pos, seg))
    logits = np.asarray(forward(jax.device_put(params, jax.devices()[0]), ids,
                                np.broadcast_to(np.arange(ids.shape[1]), ids.shape),
                                np.ones(ids.shape, np.int32)), np.float64)
    return [logits[row, len(p) - 1:len(p) + len(t) - 1]
            for row, (p, t) in enumerate(zip(prompts, tokens))]


def agree(got, want, logits16, logits32):
    """``got`` equals ``want`` up to their first difference, where the two picks must be a tie
    that bf16 cannot resolve: in the fp32 model (``logits32``, along ``want``) ``got``'s pick
    trails ``want``'s by at most twice the bf16 reference's own error at that step (the largest
    ``|logits16 - logits32|`` over the vocabulary). A random model's greedy path may fork there,
    and the bf16 reference is as noisy as the cache it checks: it can be the one that picked
    the fp32 runner-up. After the fork nothing can be compared."""
    for k, (g, w) in enumerate(zip(got, want)):
        if g != w:
            gap = logits32[k][w] - logits32[k][g]
            noise = np.abs(logits16[k] - logits32[k]).max()
            return gap <= 2 * noise, (k, gap, noise)
    return len(got) == len(want), None


@pytest.mark.parametrize("dtype,cases", [
    # exactly, in fp32 (each case compiles its own prefill, ~4 s; the decode step reads neither
    # layout nor strategy)
    ("float32", [("striped", "allgather"), ("zigzag", "ulysses")]),
    # the bf16 cache and model, through usp (Ulysses groups in a ring)
    ("bfloat16", [("contiguous", "usp")])])
def test_cached_greedy_tokens_equal_recomputing_the_window(dtype, cases, rng):
    """One random model and two prompts of different lengths in one batch; the reference
    (one device, dense, no cache) depends on neither layout nor strategy. The prefill is the
    run's context-parallel attention, checked in every layout and strategy against float64
    by test_attention, test_allgather and test_usp: here each layout and each strategy once
    leaves the cache's layout order and each strategy's prefill checked end to end, with the
    ring's cases below: the contiguous ring (cut short by a window) in the sliding window's
    test, exact in fp32; the striped ring in the sampling and sharded-batch tests."""
    base = config(dtype=dtype)
    params = random_params(base, int(rng.integers(1 << 30)))
    prompts = [rng.integers(1, VOCAB, int(n)).tolist() for n in rng.integers(5, 60, 2)]
    new = int(rng.integers(6, 14))
    want = [reference(base, params, p, new) for p in prompts]
    if dtype != "float32":
        logits16 = reference_logits(base, params, prompts, want)
        logits32 = reference_logits(config(dtype="float32"), params, prompts, want)
    for layout, impl in cases:
        c = config(layout, impl, dtype)
        trainer, sharded = on_mesh(c, params)
        length = Buckets(c, trainer.mesh, c.data.seq_len)(max(map(len, prompts)))
        got = Generator(trainer, VOCAB).generate(sharded, prompts, new, length=length, eos=-1)
        if dtype == "float32":
            assert got == want, (layout, impl)
        else:
            for g, w, l16, l32 in zip(got, want, logits16, logits32):
                ok, fork = agree(g, w, l16, l32)
                assert ok, (layout, impl, fork, g, w)


def test_sliding_window_and_eos_and_a_stop_rule(rng):
    """The contiguous ring (the prefill stops after the rounds W reaches) and a windowed decode
    give recomputing's greedy tokens; eos (one id or several: an instruct model's ends of
    turn and of text) and a stop rule end rows."""
    c = config("contiguous", "ring", window=12)
    params = random_params(c, int(rng.integers(1 << 30)))
    prompts = [rng.integers(1, VOCAB, int(n)).tolist() for n in (40, 23)]
    want = [reference(c, params, p, 20) for p in prompts]
    trainer, sharded = on_mesh(c, params)
    gen = Generator(trainer, VOCAB)
    got = gen.generate(sharded, prompts, 20, length=64, eos=-1)
    assert got == want
    # eos ends a row where it appears (not included); a stop rule ends a row after a token
    eos = want[0][5]
    cut = [w[:w.index(eos)] if eos in w else w for w in want]
    assert gen.generate(sharded, prompts, 20, length=64, eos=eos) == cut
    ends = [want[0][8], want[1][4]]  # several ids: a row ends at the first of any of them
    cut = [w[:next((i for i, t in enumerate(w) if t in ends), len(w))] for w in want]
    assert gen.generate(sharded, prompts, 20, length=64, eos=ends) == cut
    assert reference(c, params, prompts[1], 20, eos=set(ends)) == cut[1]
    stopped = gen.generate(sharded, prompts, 20, length=64, eos=-1,
                           stop=lambda row, toks: row == 1 and len(toks) == 3)
    assert stopped == [want[0], want[1][:3]]


def test_a_layer_pattern_reads_each_layer_under_its_own_window_and_rope(rng):
    """Gemma's and SmolLM3's blocks (7 layers of sliding, full, full_nope: 2 periods and a
    remainder of 1; the decode step's scan switches to each layer's kind) on the contiguous
    ring: recomputing's greedy tokens."""
    from model.pattern import repeat
    c = config("contiguous", "ring", window=12)
    c.model.update(num_layers=7, layer_types=repeat("sliding,full,full_nope", 7),
                   local_rope_theta=500.0, qk_norm=True, sandwich_norms=True,
                   norm_unit_offset=True, scale_embeddings=True, mlp_activation="gelu_tanh",
                   query_pre_attn_scalar=10.0, final_logit_softcap=20.0)
    params = random_params(c, int(rng.integers(1 << 30)))
    # norm weights drawn away from their start (1 + 0), which would hide a misplaced norm
    params = jax.tree_util.tree_map_with_path(
        lambda path, a: a + 0.3 * rng.standard_normal(a.shape).astype(a.dtype)
        if path[-1].key == "scale" else a, params)
    prompts = [rng.integers(1, VOCAB, int(n)).tolist() for n in (40, 23)]
    want = [reference(c, params, p, 12) for p in prompts]
    trainer, sharded = on_mesh(c, params)
    assert Generator(trainer, VOCAB).generate(sharded, prompts, 12, length=64, eos=-1) == want


def test_sampling_follows_the_seed_as_without_a_cache(rng):
    """Temperature sampling draws each token with the same key as generation without a
    cache, so the same seed gives the same tokens."""
    c = config("striped", "ring")
    params = random_params(c, int(rng.integers(1 << 30)))
    prompt = rng.integers(1, VOCAB, 30).tolist()
    trainer, sharded = on_mesh(c, params)
    hot, seed = Sampling(greedy=False, temperature=3.0, top_k=50), int(rng.integers(1000))
    graphdef, _ = single_device_model(c)
    want = recompute.generate(graphdef, jax.device_put(params, jax.devices()[0]), prompt, 8,
                              seq_len=256, usable_vocab=VOCAB, eos=-1, sampling=hot, seed=seed)
    got = Generator(trainer, VOCAB).generate(sharded, [prompt], 8, length=64, eos=-1,
                                             sampling=hot, seed=seed)
    assert got == [want]
    assert want != reference(c, params, prompt, 8)  # not greedy


def test_recomputing_on_a_device_it_was_restored_to_compiles_its_step_once(rng):
    """Parameters committed to one device (as a checkpoint restores them for generate.py
    --no-cache): the buffer and counter start there too, so every token runs one compiled
    step (before, the first call's uncommitted buffer compiled it a second time)."""
    c = config()
    graphdef, _ = single_device_model(c)
    params = jax.device_put(random_params(c, int(rng.integers(1000))), jax.devices()[1])
    prompt = [int(t) for t in rng.integers(1, VOCAB, 62)]
    got = recompute.generate(graphdef, params, prompt, 4, seq_len=72, usable_vocab=VOCAB, eos=-1)
    window = recompute.window_size(62, 4, 72)
    assert window == 72  # a window of its own: no other test's step in make_step's cache
    step = recompute.make_step(graphdef, window, VOCAB, Sampling())
    assert step._cache_size() == 1
    assert got == reference(c, params, prompt, 4)  # device 0's tokens (its own window's step)


def test_a_sharded_batch_and_the_tensor_axis(rng):
    """data x fsdp x sequence x tensor = 1 x 2 x 2 x 2: rows split over fsdp, heads over
    tensor, the cache over sequence."""
    c = config("striped", "ring", mesh=dict(data=1, fsdp=2, sequence=2, tensor=2))
    params = random_params(c, int(rng.integers(1 << 30)))
    prompts = [rng.integers(1, VOCAB, int(n)).tolist() for n in (9, 33, 17, 50)]
    mesh = make_mesh(c.mesh, jax.devices()[:8])
    trainer = Trainer(c, mesh)
    gen = Generator(trainer, VOCAB)
    got = gen.generate(jax.device_put(params, trainer.param_shardings), prompts, 9, length=64,
                       eos=-1)
    assert got == [reference(c, params, p, 9) for p in prompts]


def test_buckets_are_the_smallest_valid_length_from_the_next_power_of_two(rng):
    from evaluation.lengths import length_problem
    c = config("zigzag")
    mesh = make_mesh(c.mesh, jax.devices()[:4])
    cap = 1000
    buckets = Buckets(c, mesh, cap=cap)
    valid = [n for n in range(8, cap + 1, 8) if length_problem(c, mesh, n) is None]
    assert valid and 1000 not in valid  # zigzag x 4 shards x tiles of 8: not every multiple of 8
    for n in rng.integers(1, cap + 1, 40):
        n = int(n)
        target = max(64, 1 << (n - 1).bit_length())
        want = next((v for v in valid if v >= target), None)
        if want is None:  # past the cap: the tightest fit, if any
            want = next((v for v in valid if v >= n), None)
        assert buckets(n) == want
    assert buckets(cap + 1) is None and EMPTY > 1_000_000
    from evaluation.lengths import next_valid
    for n in rng.integers(1, valid[-1] + 1, 20):
        assert next_valid(c, mesh, int(n)) == next(v for v in valid if v >= n)


def decode_program(c, mesh, prompt_slots=1024, gen_slots=11):
    """The compiled decode step's copies and conversions of the cache larger than one layer of
    it on this device, as (dtype, shape, op); its temporary bytes; and the bytes of the cache
    (keys and values) on this device. The cache is the prefill's, as it holds it (its dtype,
    its shape: a dimension of slots per device, 1035 here, a number nothing else has). A decode
    that carries the cache through its scan over layers gets a copy of the whole cache per
    layer, layers x cache bytes a token, its cost growing with the prompt; one that slices a
    bf16 cache where XLA (on a CPU) cannot gets it converted whole to fp32 and back (what this
    checks is the program, not a time)."""
    import re

    from evaluation.kv_cache import Cache
    trainer = Trainer(c, mesh)
    S, B = int(mesh.shape["sequence"]), c.data.batch_size
    sds = jax.ShapeDtypeStruct
    prompt, slots = S * prompt_slots, S * (prompt_slots + gen_slots)
    rows = lambda n: sds((B, n), np.int32)
    gen = Generator(trainer, VOCAB)
    cache, _ = jax.eval_shape(gen._prefill(gen_slots, Sampling()), trainer.abstract_state.params,
                              rows(prompt), rows(prompt), rows(prompt), rows(slots),
                              sds((B,), np.int32), jax.random.key(0))
    ints = sds((B,), np.int32)
    compiled = gen._decode(prompt_slots, Sampling()).lower(
        trainer.abstract_state.params, cache, ints, ints, sds((), np.int32),
        jax.random.key(0)).compile()
    hlo = compiled.as_text()
    held = {"float32": "f32", "bfloat16": "bf16", "uint16": "u16"}[str(cache.k.dtype)]
    per_device = slots // S
    layer = math.prod(cache.k.shape[1:]) // S
    found = []
    for dtype, shape, op in re.findall(r"= (\w+)\[([\d,]*)\]\{[^}]*\} ([\w-]+)\(", hlo):
        dims = [int(d) for d in shape.split(",") if d]
        if per_device in dims and math.prod(dims) > layer and (
                op in ("copy", "copy-start", "convert") or dtype != held):
            found.append((dtype, shape, op))
    cache_bytes = 2 * layer * cache.k.shape[0] * cache.k.dtype.itemsize
    return sorted(set(found)), compiled.memory_analysis().temp_size_in_bytes, cache_bytes


@pytest.mark.parametrize("layout,sequence,layer_types,dtype", [
    ("striped", 1, "", "float32"), ("striped", 4, "", "float32"),
    ("contiguous", 4, "", "float32"),
    # a pattern of period 3 (2 sliding layers, a full one) over 16 layers: 5 periods and a
    # remainder of 1
    ("striped", 1, "sliding,sliding,full", "float32"),
    # a bf16 cache (the decode step reads neither layout nor strategy)
    ("striped", 1, "", "bfloat16"), ("striped", 4, "", "bfloat16"),
    ("striped", 1, "sliding,sliding,full", "bfloat16")])
def test_a_decode_step_copies_no_more_than_a_layer_of_the_cache(layout, sequence, layer_types,
                                                                dtype):
    """A token reads each layer's cache once and writes one slot: the compiled step holds no
    copy or conversion of the stacked cache (nor of anything larger than one layer of it) and
    needs less temporary memory than half the cache, on one device and with the cache split
    over 4 sequence devices, in fp32 and bf16, and with a layer pattern whose depth is not a
    whole number of periods."""
    c = config(layout, mesh=dict(data=1, fsdp=1, sequence=sequence, tensor=1), dtype=dtype,
               window=8 if layer_types else 0)
    c.model.update(num_layers=16, layer_types=repeat(layer_types, 16) if layer_types else "")
    c.data.update(batch_size=1, seq_len=sequence * 1024)
    copies, temp, cache = decode_program(c, make_mesh(c.mesh, jax.devices()[:sequence]))
    assert copies == [] and temp < cache / 2, (
        f"copies or conversions of the cache: {copies}; temporary memory {temp} bytes against "
        f"a cache of {cache} ({temp / cache:.2f} of it)")
