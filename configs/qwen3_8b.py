"""Qwen3-8B's shapes: 36 layers, d 4096, ffn 12288, 32 heads of 128, 8 KV heads, vocab 151,936, its
own output head, RMSNorm on each head's q and k, RoPE base 1,000,000, norm eps 1e-6, full
attention on every layer: Qwen/Qwen3-8B's config.json (8.19B params). Trained at its native
32,768 tokens (data.seq_len).

Run on a GPU/TPU host, e.g. 8 devices in a ring of 8 (to train on Qwen's tokenizer add
--config.data.tokenizer=PATH/tokenizer.json):
  python train.py --config configs/qwen3_8b.py --config.mesh.sequence=8 --config.mesh.fsdp=-1 \
      --config.data.batch_size=1 --config.attention.layout=zigzag
Plan it first on this machine (docs/planning.md has this plan):
  python scripts/plan.py --config configs/qwen3_8b.py --mesh sequence=8 --seq-len 32768 --batch 1 --hardware h100
Layout: zigzag, the plan's fastest (439 ms a step, a 70% MFU bound).
Shows: tokens/s and MFU per logged step; compare layouts with scripts/compare_layouts.py.
"""
from configs.llama import qwen3_config


def get_config():
    return qwen3_config("qwen3_8b", layers=36, d_model=4096, ffn_dim=12288, heads=32, tied=False)
