"""Shared shape of the LLaMA-style configs (llama_1b/3b/7b): a real run on GPUs/TPUs."""
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
