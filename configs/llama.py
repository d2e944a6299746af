"""Shared shape of the LLaMA-style configs (llama_1b/3b/7b, llama3_1b/3b/8b, and the decoders
that differ from Llama in a few fields: qwen3_*, gemma3_*, smollm3_3b, the mixtures of experts,
gpt_oss_*): real runs on GPUs/TPUs."""
from configs import base
from model.pattern import repeat  # imports no jax: configs load before the device count is set


def llama_config(name: str, *, layers: int, d_model: int, ffn_dim: int, heads: int):
    c = base.get_config()
    c.name = name
    c.model.update(vocab_size=32000, d_model=d_model, num_layers=layers, num_heads=heads,
                   num_kv_heads=heads, ffn_dim=ffn_dim, remat="full", dtype="auto",
                   mlp_chunk=8192)
    c.attention.update(impl="ring", layout="striped", block_q=1024, block_kv=1024)
    c.mesh.update(data=1, fsdp=-1, sequence=1, tensor=1)
    c.data.update(seq_len=32768, batch_size=8)
    c.train.update(steps=10000, lr=3e-4, warmup_steps=500, log_every=10)
    c.checkpoint.update(every=500, keep=3)
    return c


def llama3_config(name: str, *, layers: int, d_model: int, ffn_dim: int, heads: int,
                  tied: bool, rope_factor: float):
    """Meta's Llama 3.x shapes: 128,256 tokens, 8 KV heads, RoPE base 500,000 with the `llama3`
    scaling of an 8,192-token pretraining context (as each model's HF config.json gives it)."""
    c = llama_config(name, layers=layers, d_model=d_model, ffn_dim=ffn_dim, heads=heads)
    c.model.update(vocab_size=128256, num_kv_heads=8, rope_theta=500000.0, tie_embeddings=tied,
                   norm_eps=1e-5)
    c.model.rope_scaling.update(type="llama3", factor=rope_factor, original_max_len=8192,
                                low_freq_factor=1.0, high_freq_factor=4.0)
    return c


def released_config(name: str, *, vocab: int, layers: int, d_model: int, ffn_dim: int, heads: int,
                    kv_heads: int, head_dim: int, tied: bool, rope_theta: float, seq_len: int,
                    norm_eps: float = 1e-6):
    """A released model's shapes on the llama configs' training setup (remat full, MLP chunks of
    8192, striped ring with 1024 tiles), trained at ``seq_len``, its native context."""
    c = llama_config(name, layers=layers, d_model=d_model, ffn_dim=ffn_dim, heads=heads)
    c.model.update(vocab_size=vocab, num_kv_heads=kv_heads, head_dim=head_dim,
                   tie_embeddings=tied, rope_theta=rope_theta, norm_eps=norm_eps)
    c.data.seq_len = seq_len
    return c


def qwen3_config(name: str, *, layers: int, d_model: int, ffn_dim: int, heads: int, tied: bool):
    """Qwen3's dense shapes: 151,936 tokens, 8 KV heads of 128, RMSNorm on each head's q and k
    (qk_norm), RoPE base 1,000,000, full attention on every layer, 32,768-token context."""
    c = released_config(name, vocab=151936, layers=layers, d_model=d_model, ffn_dim=ffn_dim,
                        heads=heads, kv_heads=8, head_dim=128, tied=tied, rope_theta=1e6,
                        seq_len=32768)
    c.model.qk_norm = True
    return c


def gemma3_config(name: str, *, vocab: int, layers: int, d_model: int, ffn_dim: int, heads: int,
                  kv_heads: int, window: int, seq_len: int, rope_factor: float = 1.0):
    """Gemma 3's text decoder: five sliding-window layers (local RoPE base 10,000) to one full
    layer (base 1,000,000, linear scaling by ``rope_factor`` on the 4B and larger), heads of 256
    with softmax scale 256^-0.5, q/k norms, norms scaling by 1 + w, a norm on each branch's output
    too, embeddings times sqrt(d_model), GeGLU (tanh GELU), tied embeddings."""
    c = released_config(name, vocab=vocab, layers=layers, d_model=d_model, ffn_dim=ffn_dim,
                        heads=heads, kv_heads=kv_heads, head_dim=256, tied=True, rope_theta=1e6,
                        seq_len=seq_len)
    c.model.update(layer_types=repeat("sliding,sliding,sliding,sliding,sliding,full", layers),
                   sliding_window=window, local_rope_theta=1e4, qk_norm=True,
                   norm_unit_offset=True, sandwich_norms=True, scale_embeddings=True,
                   mlp_activation="gelu_tanh", query_pre_attn_scalar=256.0)
    if rope_factor != 1.0:
        c.model.rope_scaling.update(type="linear", factor=rope_factor)
    return c


def smollm3_config(name: str, *, layers: int, d_model: int, ffn_dim: int, heads: int, kv_heads: int):
    """SmolLM3: Llama with every 4th layer NoPE (no rotary embedding), RoPE base 5,000,000 on the
    others, tied embeddings, 128,256 tokens, 65,536-token context."""
    c = released_config(name, vocab=128256, layers=layers, d_model=d_model, ffn_dim=ffn_dim,
                        heads=heads, kv_heads=kv_heads, head_dim=d_model // heads, tied=True,
                        rope_theta=5e6, seq_len=65536)
    c.model.layer_types = repeat("full,full,full,full_nope", layers)
    return c


def moe_config(c, *, experts: int, top_k: int, expert_dim: int = 0, renormalize: bool,
               aux_loss: float, z_loss: float = 0.0):
    """``c`` with every layer's MLP a mixture of ``experts`` SwiGLU experts, ``top_k`` a token
    (model/moe.py): softmax over the experts, then the top k (renormalised to sum 1 or not, HF's
    norm_topk_prob), dropless, ``aux_loss`` (router_aux_loss_coef) on transformers' load-balancing
    loss. The MLP runs whole (model.mlp_chunk=0: the chunked MLP is the dense one)."""
    c.model.mlp_chunk = 0
    c.model.moe.update(num_experts=experts, top_k=top_k, expert_dim=expert_dim,
                       router="softmax_topk", renormalize=renormalize, router_bias=False,
                       aux_loss=aux_loss, z_loss=z_loss, capacity=0.0, grouped="auto")
    return c


def gpt_oss_layers(c, *, experts: int, top_k: int, expert_dim: int, window: int,
                   aux_loss: float):
    """``c`` with gpt-oss's blocks: attention sinks, biases on q, k, v and o, a ``window``-token
    sliding window on the even layers (from 0) and full attention on the odd ones, and every MLP
    a mixture of ``experts`` experts, ``top_k`` a token, scored top-k then softmax over the k
    with a router bias, each expert with biases and gpt-oss's clamped unit (limit 7, alpha
    1.702); ``aux_loss`` (router_aux_loss_coef) on transformers' load-balancing loss."""
    c = moe_config(c, experts=experts, top_k=top_k, expert_dim=expert_dim, renormalize=False,
                   aux_loss=aux_loss)
    c.model.update(attention_sinks=True, qkv_bias=True, o_bias=True, sliding_window=window,
                   layer_types=repeat("sliding,full", c.model.num_layers))
    c.model.moe.update(router="topk_softmax", router_bias=True, expert_bias=True, glu="clamped",
                       glu_limit=7.0, glu_alpha=1.702)
    return c
