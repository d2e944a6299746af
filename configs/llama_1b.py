"""LLaMA-style 1B (the Striped Attention paper's sizes): 22 layers, d 2048, ffn 5504, 16 heads.

Run on a GPU/TPU host, e.g. 8 devices in a ring of 8:
  python train.py --config configs/llama_1b.py --config.mesh.sequence=8 --config.mesh.fsdp=-1 \
      --config.data.seq_len=262144 --config.data.batch_size=1 --config.attention.layout=striped
Plan it first on this machine:
  python scripts/plan.py --config configs/llama_1b.py --mesh sequence=8 --seq-len 262144 --batch 1 --hardware h100
Shows: tokens/s and MFU per logged step; compare layouts with scripts/compare_layouts.py.
"""
from configs.llama import llama_config


def get_config():
    return llama_config("llama_1b", layers=22, d_model=2048, ffn_dim=5504, heads=16)
