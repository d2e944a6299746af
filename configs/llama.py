"""Shared shape of the LLaMA-style configs (llama_1b/3b/7b, llama3_1b/3b/8b): real runs on GPUs/TPUs."""
from configs import base


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
