"""Gemma-3-1B's shapes: 26 layers, five sliding-window layers (W 512, local RoPE base 10,000) to
one full layer (RoPE base 1,000,000), repeated (the last two layers sliding), d 1152, ffn 6912
(GeGLU, tanh GELU), 4 heads of 256, 1 KV head, softmax scale 256^-0.5, q/k norms, norms
scaling by 1 + w with a norm on each branch's output too, embeddings times sqrt(1152), vocab
262,144, tied, norm eps 1e-6: google/gemma-3-1b-pt's config.json (999.9M params). Trained at
its native 32,768 tokens (data.seq_len).

Run on a GPU/TPU host, e.g. 8 devices in a ring of 8 (to train on Gemma's tokenizer add
--config.data.tokenizer=PATH/tokenizer.json):
  python train.py --config configs/gemma3_1b.py --config.mesh.sequence=8 --config.mesh.fsdp=-1 \
      --config.data.batch_size=1 --config.attention.layout=contiguous
Plan it first on this machine (docs/planning.md has this plan):
  python scripts/plan.py --config configs/gemma3_1b.py --mesh sequence=8 --seq-len 32768 --batch 1 --hardware h100
Layout: contiguous, the plan's fastest: its ring stops after 2 of 8 rounds on the 22
sliding layers (46.8 ms a step against zigzag's 48.6 ms and striped's 63.9 ms).
Shows: tokens/s and MFU per logged step; compare layouts with scripts/compare_layouts.py.
"""
from configs.llama import gemma3_config


def get_config():
    return gemma3_config("gemma3_1b", vocab=262144, layers=26, d_model=1152, ffn_dim=6912, heads=4,
                         kv_heads=1, window=512, seq_len=32768)
