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
