"""LLaMA-style 3B (the Striped Attention paper's sizes): 26 layers, d 3200, ffn 8640, 32 heads.

Run on a GPU/TPU host, e.g. 8 devices in a ring of 8:
  python train.py --config configs/llama_3b.py --config.mesh.sequence=8 --config.mesh.fsdp=-1 \
      --config.data.seq_len=262144 --config.attention.layout=striped
Plan it first on this machine: python scripts/plan.py --config configs/llama_3b.py ...
Shows: tokens/s and MFU per logged step; compare layouts with scripts/compare_layouts.py.
"""
from configs import base


def get_config():
    c = base.get_config()
    c.name = "llama_3b"
    c.model.update(vocab_size=32000, d_model=3200, num_layers=26, num_heads=32, num_kv_heads=32,
                   ffn_dim=8640, remat="full", dtype="auto")
    c.attention.update(impl="ring", layout="striped", block_q=1024, block_kv=1024)
    c.mesh.update(data=1, fsdp=-1, sequence=1, tensor=1)
    c.data.update(seq_len=32768, batch_size=8)
    c.train.update(steps=10000, lr=3e-4, warmup_steps=500, log_every=10)
    c.checkpoint.update(every=500, keep=3)
    return c
