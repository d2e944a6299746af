"""LLaMA-style 7B (the Striped Attention paper's sizes): 32 layers, d 4096, ffn 11008, 32 heads.

Run on a GPU/TPU host, e.g. 8 devices in a ring of 8:
  python train.py --config configs/llama_7b.py --config.mesh.sequence=8 --config.mesh.fsdp=-1 \
      --config.data.seq_len=262144 --config.data.batch_size=1 --config.attention.layout=striped
Plan it first on this machine:
  python scripts/plan.py --config configs/llama_7b.py --mesh sequence=8 --seq-len 262144 --batch 1 --hardware h100
Shows: tokens/s and MFU per logged step; compare layouts with scripts/compare_layouts.py.
"""
from configs.llama import llama_config


def get_config():
    return llama_config("llama_7b", layers=32, d_model=4096, ffn_dim=11008, heads=32)
