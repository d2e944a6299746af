"""Qwen3-4B's shapes: 36 layers, d 2560, ffn 9728, 32 heads of 128, 8 KV heads, vocab 151,936, tied
embeddings, RMSNorm on each head's q and k, RoPE base 1,000,000, norm eps 1e-6, full attention
on every layer: Qwen/Qwen3-4B's config.json (4.02B params). Trained at its native 32,768 tokens
(data.seq_len).

Run on a GPU/TPU host, e.g. 8 devices in a ring of 8 (to train on Qwen's tokenizer add
--config.data.tokenizer=PATH/tokenizer.json):
  python train.py --config configs/qwen3_4b.py --config.mesh.sequence=8 --config.mesh.fsdp=-1 \
      --config.data.batch_size=1 --config.attention.layout=zigzag
Plan it first on this machine (docs/planning.md has this plan):
  python scripts/plan.py --config configs/qwen3_4b.py --mesh sequence=8 --seq-len 32768 --batch 1 --hardware h100
Layout: zigzag, the plan's fastest (322 ms a step, a 68% MFU bound).
Shows: tokens/s and MFU per logged step; compare layouts with scripts/compare_layouts.py.
"""
from configs.llama import qwen3_config


def get_config():
    return qwen3_config("qwen3_4b", layers=36, d_model=2560, ffn_dim=9728, heads=32, tied=True)
