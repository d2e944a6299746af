"""Llama-3.2-3B's shapes: 28 layers, d 3072, ffn 8192, 24 heads of 128, 8 KV heads, vocab 128,256,
tied embeddings, RoPE base 500,000 with llama3 scaling (factor 32, low/high freq 1/4, original
8,192): meta-llama/Llama-3.2-3B's config.json as transformers' LlamaConfig reads it (3.21B params).

Run on a GPU/TPU host, e.g. 8 devices in a ring of 8 (to train on Meta's tokenizer add
--config.data.tokenizer=PATH/tokenizer.json; or import the released weights, docs/huggingface.md):
  python train.py --config configs/llama3_3b.py --config.mesh.sequence=8 --config.mesh.fsdp=-1 \
      --config.data.seq_len=131072 --config.data.batch_size=1 --config.attention.layout=striped
Plan it first on this machine:
  python scripts/plan.py --config configs/llama3_3b.py --mesh sequence=8 --seq-len 131072 --batch 1 --hardware h100
Shows: tokens/s and MFU per logged step; compare layouts with scripts/compare_layouts.py.
"""
from configs.llama import llama3_config


def get_config():
    return llama3_config("llama3_3b", layers=28, d_model=3072, ffn_dim=8192, heads=24,
                         tied=True, rope_factor=32.0)
