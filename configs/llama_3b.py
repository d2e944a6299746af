"""LLaMA-style 3B (the Striped Attention paper's sizes): 26 layers, d 3200, ffn 8640, 32 heads.

Run on a GPU/TPU host, e.g. 8 devices in a ring of 8:
  python train.py --config configs/llama_3b.py --config.mesh.sequence=8 --config.mesh.fsdp=-1 \
      --config.data.seq_len=262144 --config.data.batch_size=1 --config.attention.layout=striped
Plan it first on this machine:
  python scripts/plan.py --config configs/llama_3b.py --mesh sequence=8 --seq-len 262144 --batch 1 --hardware h100
Shows: tokens/s and MFU per logged step; compare layouts with scripts/compare_layouts.py.
"""
from configs.llama import llama_config


def get_config():
    return llama_config("llama_3b", layers=26, d_model=3200, ffn_dim=8640, heads=32)
