"""Gemma-3-4B's text decoder: 34 layers, five sliding-window layers (W 1024, local RoPE base
10,000) to one full layer (RoPE base 1,000,000, linear scaling x8), repeated (the last four
layers sliding), d 2560, ffn 10240 (GeGLU, tanh GELU), 8 heads of 256, 4 KV heads, softmax scale
256^-0.5, q/k norms, norms scaling by 1 + w with a norm on each branch's output too, embeddings
times sqrt(2560), vocab 262,208, tied, norm eps 1e-6: google/gemma-3-4b-pt's text_config
(3.88B params; the vision tower is not part of it). Trained at its native 131,072 tokens
(data.seq_len).

Run on a GPU/TPU host, e.g. 8 devices in a ring of 8 (to train on Gemma's tokenizer add
--config.data.tokenizer=PATH/tokenizer.json):
  python train.py --config configs/gemma3_4b.py --config.mesh.sequence=8 --config.mesh.fsdp=-1 \
      --config.data.batch_size=1 --config.attention.impl=usp --config.attention.ulysses=4 \
      --config.attention.layout=zigzag
Plan it first on this machine (docs/planning.md has this plan):
  python scripts/plan.py --config configs/gemma3_4b.py --mesh sequence=8 --seq-len 131072 --batch 1 --hardware h100
Layout: usp with Ulysses groups of 4 over zigzag, the plan's fastest (809 ms a step; the ring:
900 ms zigzag, 945 ms contiguous, 1.02 s striped; docs/layouts.md compares them).
Shows: tokens/s and MFU per logged step; compare layouts with scripts/compare_layouts.py.
"""
from configs.llama import gemma3_config


def get_config():
    return gemma3_config("gemma3_4b", vocab=262208, layers=34, d_model=2560, ffn_dim=10240, heads=8,
                         kv_heads=4, window=1024, seq_len=131072, rope_factor=8.0)
