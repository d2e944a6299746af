"""Qwen3-0.6B's shapes: 28 layers, d 1024, ffn 3072, 16 heads of 128, 8 KV heads, vocab 151,936,
tied embeddings, RMSNorm on each head's q and k, RoPE base 1,000,000, norm eps 1e-6, full
attention on every layer: Qwen/Qwen3-0.6B's config.json (596.0M params, 0.44B without the
embedding). Trained at its native 32,768 tokens (data.seq_len).

Run on a GPU/TPU host, e.g. 8 devices in a ring of 8 (to train on Qwen's tokenizer add
--config.data.tokenizer=PATH/tokenizer.json):
  python train.py --config configs/qwen3_0_6b.py --config.mesh.sequence=8 --config.mesh.fsdp=-1 \
      --config.data.batch_size=1 --config.attention.layout=zigzag
Plan it first on this machine (docs/planning.md has this plan):
  python scripts/plan.py --config configs/qwen3_0_6b.py --mesh sequence=8 --seq-len 32768 --batch 1 --hardware h100
Layout: zigzag, the plan's fastest (94 ms a step, a 65% MFU bound).
Shows: tokens/s and MFU per logged step; compare layouts with scripts/compare_layouts.py.
"""
from configs.llama import qwen3_config


def get_config():
    return qwen3_config("qwen3_0_6b", layers=28, d_model=1024, ffn_dim=3072, heads=16, tied=True)
