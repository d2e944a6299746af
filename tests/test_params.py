"""Parameter counts of the paper's model sizes, from abstract shapes (nothing allocated)."""
import importlib

import jax
import pytest
from flax import nnx

from model.decoder import Decoder
from model.flops import param_count
from model.layers import AttentionBackend


def closed_form(layers, d, ffn, heads, kv_heads, vocab):
    hd = d // heads
    per_layer = d * hd * heads * 2 + d * hd * kv_heads * 2 + 3 * d * ffn + 2 * d
    return layers * per_layer + 2 * vocab * d + d


@pytest.mark.parametrize("name,dims,expected", [
    ("llama_1b", (22, 2048, 5504, 16, 16, 32000), 1_244_227_584),
    ("llama_3b", (26, 3200, 8640, 32, 32, 32000), 3_426_473_600),
    ("llama_7b", (32, 4096, 11008, 32, 32, 32000), 6_738_415_616),
])
def test_param_count_matches_closed_form(name, dims, expected):
    config = importlib.import_module(f"configs.{name}").get_config()
    m = config.model
    assert (m.num_layers, m.d_model, m.ffn_dim, m.num_heads, m.num_kv_heads, m.vocab_size) == dims
    abstract = nnx.eval_shape(lambda: Decoder(m, AttentionBackend(), nnx.Rngs(0)))
    counted = sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    assert counted == closed_form(*dims) == param_count(m) == expected


@pytest.mark.parametrize("name,dims,tied,expected", [
    # The counts Meta's checkpoints have (Llama-3.2-1B, Llama-3.2-3B, Llama-3.1-8B).
    ("llama3_1b", (16, 2048, 8192, 32, 8, 128256), True, 1_235_814_400),
    ("llama3_3b", (28, 3072, 8192, 24, 8, 128256), True, 3_212_749_824),
    ("llama3_8b", (32, 4096, 14336, 32, 8, 128256), False, 8_030_261_248),
])
def test_llama3_param_counts_are_the_released_models(name, dims, tied, expected):
    m = importlib.import_module(f"configs.{name}").get_config().model
    assert (m.num_layers, m.d_model, m.ffn_dim, m.num_heads, m.num_kv_heads, m.vocab_size) == dims
    assert m.tie_embeddings == tied and m.head_dim == 0
    assert (m.rope_theta, m.rope_scaling.type, m.rope_scaling.original_max_len) == (500000.0, "llama3", 8192)
    abstract = nnx.eval_shape(lambda: Decoder(m, AttentionBackend(), nnx.Rngs(0)))
    counted = sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    head = 0 if tied else dims[-1] * dims[1]  # closed_form counts an own head; tied has none
    assert counted == closed_form(*dims) - dims[-1] * dims[1] + head == param_count(m) == expected


def test_gqa_shrinks_only_kv_projections():
    config = importlib.import_module("configs.llama_1b").get_config()
    m = config.model
    full = param_count(m)
    m.num_kv_heads = 4
    assert full - param_count(m) == m.num_layers * 2 * m.d_model * 128 * (16 - 4)


def test_qkv_biases_are_counted_sharded_like_their_projections():
    """model.qkv_bias adds bq [H, hd], bk and bv [K, hd] per layer (and nothing to the matmul
    parameters); each splits its heads over the tensor axis as its projection does."""
    from model.flops import matmul_params
    from parallel.mesh import logical_to_spec
    m = importlib.import_module("configs.tiny").get_config().model
    m.update(num_heads=14, num_kv_heads=2, head_dim=8)
    plain, plain_matmul = param_count(m), matmul_params(m)
    m.qkv_bias = True
    abstract = nnx.eval_shape(lambda: Decoder(m, AttentionBackend(), nnx.Rngs(0)))
    counted = sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    assert counted == param_count(m) == plain + m.num_layers * 8 * (14 + 2 * 2)
    assert matmul_params(m) == plain_matmul
    attn = abstract.blocks.attn
    for b, w, heads in ((attn.bq, attn.wq, 14), (attn.bk, attn.wk, 2), (attn.bv, attn.wv, 2)):
        assert b.shape == (m.num_layers, heads, 8)
        assert logical_to_spec(b.get_metadata()["axes"], b.ndim)[1] == "tensor"
        assert b.get_metadata()["axes"][0] == w.get_metadata()["axes"][1]


def _built_count(m) -> int:
    abstract = nnx.eval_shape(lambda: Decoder(m, AttentionBackend(), nnx.Rngs(0)))
    return sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


@pytest.mark.parametrize("name,dims,expected", [
    # (layers, d_model, ffn, heads, kv heads, head_dim, vocab, tied): the released checkpoints'
    # counts (Gemma-3-4B: its text decoder, without the vision tower).
    ("qwen3_0_6b", (28, 1024, 3072, 16, 8, 128, 151936, True), 596_049_920),
    ("qwen3_4b", (36, 2560, 9728, 32, 8, 128, 151936, True), 4_022_468_096),
    ("qwen3_8b", (36, 4096, 12288, 32, 8, 128, 151936, False), 8_190_735_360),
    ("gemma3_1b", (26, 1152, 6912, 4, 1, 256, 262144, True), 999_885_952),
    ("gemma3_4b", (34, 2560, 10240, 8, 4, 256, 262208, True), 3_880_263_168),
    ("smollm3_3b", (36, 2048, 11008, 16, 4, 128, 128256, True), 3_075_098_624),
])
def test_qwen3_gemma3_smollm3_param_counts_are_the_released_models(name, dims, expected):
    """The new families' configs: shapes as their HF config.json give them, and param_count
    (q/k norms, Gemma's sandwich norms) equal to the built decoder's and the released count."""
    from model import pattern
    from model.flops import matmul_params
    m = importlib.import_module(f"configs.{name}").get_config().model
    assert (m.num_layers, m.d_model, m.ffn_dim, m.num_heads, m.num_kv_heads, m.head_dim,
            m.vocab_size, m.tie_embeddings) == dims
    assert _built_count(m) == param_count(m) == expected
    per_layer_norms = 2 * m.d_model * (2 if m.sandwich_norms else 1) + 2 * m.head_dim * m.qk_norm
    assert param_count(m) - matmul_params(m) == (
        m.num_layers * per_layer_norms + m.d_model + (0 if m.tie_embeddings else m.vocab_size * m.d_model))
    assert m.qk_norm == name.startswith(("qwen3", "gemma3"))
    if name.startswith("gemma3"):
        assert m.layer_types.split(",") == ["full" if i % 6 == 5 else "sliding"
                                            for i in range(m.num_layers)]
        assert pattern.describe(m) == f"5 sliding : full (W={m.sliding_window})"
        assert (m.rope_theta, m.local_rope_theta, m.query_pre_attn_scalar) == (1e6, 1e4, 256.0)
    elif name == "smollm3_3b":
        assert m.layer_types.split(",") == ["full_nope" if i % 4 == 3 else "full"
                                            for i in range(36)]
        assert [k.rope is None for k in pattern.kinds(m)] == [i % 4 == 3 for i in range(36)]
    else:
        assert pattern.names(m) == ("full",) * m.num_layers and m.rope_theta == 1e6


def test_qk_norm_sandwich_norms_and_a_mixed_stack_are_counted_exactly():
    """model.qk_norm adds a q and a k norm of head_dim per layer, model.sandwich_norms two more
    d_model norms; neither is a matmul parameter, and the layers' kinds change no count."""
    from model.flops import matmul_params
    m = importlib.import_module("configs.tiny").get_config().model
    m.update(num_layers=5, head_dim=16)
    plain, plain_matmul = param_count(m), matmul_params(m)
    assert _built_count(m) == plain
    m.update(qk_norm=True, sandwich_norms=True, norm_unit_offset=True, sliding_window=8,
             layer_types="sliding,sliding,full,sliding_nope,full_nope", local_rope_theta=1e4)
    counted = _built_count(m)
    assert counted == param_count(m) == plain + m.num_layers * (2 * 16 + 2 * m.d_model)
    assert matmul_params(m) == plain_matmul


@pytest.mark.parametrize("name,dims,expected,active", [
    # (layers, d_model, heads, kv heads, head_dim, vocab, experts, top_k, expert width):
    # Mixtral-8x7B's, Qwen3-30B-A3B's and OLMoE-1B-7B's released counts (46.7B, 12.9B active;
    # 30.5B, 3.3B active; 6.9B, 1.3B active: its q/k norms over the whole projection,
    # model.qk_norm_scope=projection, 2048 weights each a layer).
    ("mixtral_8x7b", (32, 4096, 32, 8, 128, 32000, 8, 2, 14336), 46_702_792_704, 12_879_925_248),
    ("qwen3_30b_a3b", (48, 2048, 32, 4, 128, 151936, 128, 8, 768), 30_532_122_624, 3_353_032_704),
    ("olmoe_1b_7b", (16, 2048, 16, 16, 128, 50304, 64, 8, 1024), 6_919_161_856, 1_282_017_280),
])
def test_moe_param_counts_are_the_released_models(name, dims, expected, active):
    """Every expert in param_count (the built decoder's count), a token's top k in the active
    count and in the matmul parameters (6x: the FLOPs), every expert in total_matmul_params."""
    from model.flops import active_param_count, matmul_params, total_matmul_params
    m = importlib.import_module(f"configs.{name}").get_config().model
    e = m.moe
    assert (m.num_layers, m.d_model, m.num_heads, m.num_kv_heads, m.head_dim, m.vocab_size,
            e.num_experts, e.top_k, e.expert_dim or m.ffn_dim) == dims
    assert not m.tie_embeddings and m.mlp_chunk == 0
    assert _built_count(m) == param_count(m) == expected
    assert active_param_count(m) == active
    layers, d, experts, k, f = dims[0], dims[1], dims[6], dims[7], dims[8]
    idle = layers * (experts - k) * 3 * d * f  # the experts a token does not use
    assert total_matmul_params(m) - matmul_params(m) == idle == param_count(m) - active


def test_moe_counts_a_dense_mlp_of_k_experts_plus_the_router_in_flops():
    """An MoE's FLOPs per token are a dense model's whose MLP is top_k experts wide, plus the
    router's D x E per layer; its parameters a dense model's of every expert, plus the router
    (and its bias); the decoder built holds exactly that many."""
    from model.flops import active_param_count, flops_per_token, matmul_params
    m = importlib.import_module("configs.moe_tiny").get_config().model
    e = m.moe
    e.update(num_experts=6, top_k=3, expert_dim=40, router_bias=True)
    layers, d, n, k, f = m.num_layers, m.d_model, 6, 3, 40
    dense = importlib.import_module("configs.tiny").get_config().model
    dense.ffn_dim = k * f
    router = layers * d * n
    assert matmul_params(m) == matmul_params(dense) + router
    assert flops_per_token(m, 512) == flops_per_token(dense, 512) + 6 * router
    dense.ffn_dim = n * f
    assert _built_count(m) == param_count(m) == param_count(dense) + router + layers * n
    assert active_param_count(m) == param_count(m) - layers * (n - k) * 3 * d * f
    e.num_experts = 0  # the dense MLP of model.ffn_dim again: every count as tiny's
    tiny = importlib.import_module("configs.tiny").get_config().model
    assert (param_count(m), matmul_params(m), active_param_count(m)) == (
        param_count(tiny), matmul_params(tiny), param_count(tiny))


def test_moe_on_some_layers_counts_the_others_dense():
    """model.moe.every / first_dense / dense_layers: 2 of 6 layers a mixture of experts (layers
    3 and 5: every 2nd, the first 2 dense, layer 1 listed), the other 4 the dense MLP of
    model.ffn_dim: the counts are the dense model's plus, on those 2 layers, the experts' in
    place of the dense MLP; the decoder built holds exactly that many, in three stacks."""
    from model.flops import (active_param_count, flops_per_token, matmul_params, moe_layers,
                             total_matmul_params)
    m = importlib.import_module("configs.moe_tiny").get_config().model
    m.num_layers = 6
    m.moe.update(num_experts=6, top_k=3, expert_dim=40, router_bias=True, every=2,
                 first_dense=2, dense_layers="1")
    assert moe_layers(m) == (3, 5)
    dense = importlib.import_module("configs.tiny").get_config().model
    dense.num_layers = 6
    d, f, n, k, mlp = m.d_model, 40, 6, 3, 3 * m.d_model * m.ffn_dim
    every = 2 * (d * n + n * 3 * d * f + n - mlp)  # 2 layers: router, bias, experts, not dense
    assert _built_count(m) == param_count(m) == param_count(dense) + every
    assert active_param_count(m) == param_count(m) - 2 * (n - k) * 3 * d * f
    active = 2 * (d * n + k * 3 * d * f - mlp)
    assert matmul_params(m) == matmul_params(dense) + active
    assert total_matmul_params(m) == matmul_params(dense) + every - 2 * n
    assert flops_per_token(m, 512) == flops_per_token(dense, 512) + 6 * active
    abstract = nnx.eval_shape(lambda: Decoder(m, AttentionBackend(), nnx.Rngs(0)))
    assert "mlp" not in nnx.to_pure_dict(nnx.state(abstract.blocks, nnx.Param))
    assert abstract.moe_mlp.w_gate.shape == (2, n, d, f)
    assert abstract.dense_mlp.w_gate.shape == (4, d, m.ffn_dim)
