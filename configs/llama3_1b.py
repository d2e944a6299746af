"""Llama-3.2-1B's shapes: 16 layers, d 2048, ffn 8192, 32 heads of 64, 8 KV heads, vocab 128,256,
tied embeddings, RoPE base 500,000 with llama3 scaling (factor 32, low/high freq 1/4, original
8,192): meta-llama/Llama-3.2-1B's config.json as transformers' LlamaConfig reads it (1.24B params).

Run on a GPU/TPU host, e.g. 8 devices in a ring of 8 (to train on Meta's tokenizer add
--config.data.tokenizer=PATH/tokenizer.json; or import the released weights, docs/huggingface.md):
  python train.py --config configs/llama3_1b.py --config.mesh.sequence=8 --config.mesh.fsdp=-1 \
      --config.data.seq_len=131072 --config.data.batch_size=1 --config.attention.layout=striped
Plan it first on this machine:
  python scripts/plan.py --config configs/llama3_1b.py --mesh sequence=8 --seq-len 131072 --batch 1 --hardware h100
Shows: tokens/s and MFU per logged step; compare layouts with scripts/compare_layouts.py.
"""
from configs.llama import llama3_config


def get_config():
    return llama3_config("llama3_1b", layers=16, d_model=2048, ffn_dim=8192, heads=32,
                         tied=True, rope_factor=32.0)
