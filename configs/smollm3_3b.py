"""SmolLM3-3B's shapes: 36 layers, every 4th without RoPE (NoPE: layers 3, 7, ..., 35), d 2048,
ffn 11008, 16 heads of 128, 4 KV heads, vocab 128,256, tied embeddings, RoPE base 5,000,000,
norm eps 1e-6: HuggingFaceTB/SmolLM3-3B's config.json (3.08B params). Trained at its native
65,536 tokens (data.seq_len).

Run on a GPU/TPU host, e.g. 8 devices in a ring of 8 (to train on SmolLM3's tokenizer add
--config.data.tokenizer=PATH/tokenizer.json):
  python train.py --config configs/smollm3_3b.py --config.mesh.sequence=8 --config.mesh.fsdp=-1 \
      --config.data.batch_size=1 --config.attention.layout=zigzag
Plan it first on this machine (docs/planning.md has this plan):
  python scripts/plan.py --config configs/smollm3_3b.py --mesh sequence=8 --seq-len 65536 --batch 1 --hardware h100
Layout: zigzag, the plan's fastest (572 ms a step, a 69% MFU bound).
Shows: tokens/s and MFU per logged step; compare layouts with scripts/compare_layouts.py.
"""
from configs.llama import smollm3_config


def get_config():
    return smollm3_config("smollm3_3b", layers=36, d_model=2048, ffn_dim=11008, heads=16, kv_heads=4)
