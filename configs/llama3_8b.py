"""Llama-3.1-8B's shapes: 32 layers, d 4096, ffn 14336, 32 heads of 128, 8 KV heads, vocab 128,256,
its own output head, RoPE base 500,000 with llama3 scaling (factor 8, low/high freq 1/4, original
8,192): meta-llama/Llama-3.1-8B's config.json as transformers' LlamaConfig reads it (8.03B params).

Run on a GPU/TPU host, e.g. 8 devices in a ring of 8 (to train on Meta's tokenizer add
--config.data.tokenizer=PATH/tokenizer.json; or import the released weights, docs/huggingface.md):
  python train.py --config configs/llama3_8b.py --config.mesh.sequence=8 --config.mesh.fsdp=-1 \
      --config.data.seq_len=131072 --config.data.batch_size=1 --config.attention.layout=striped
Plan it first on this machine (docs/planning.md has this plan and the 1M-token one on 64 H100s):
  python scripts/plan.py --config configs/llama3_8b.py --mesh sequence=8 --seq-len 131072 --batch 1 --hardware h100
Shows: tokens/s and MFU per logged step; compare layouts with scripts/compare_layouts.py.
"""
from configs.llama import llama3_config


def get_config():
    return llama3_config("llama3_8b", layers=32, d_model=4096, ffn_dim=14336, heads=32,
                         tied=False, rope_factor=8.0)
