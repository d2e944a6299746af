"""A Gemma-3-shaped tiny decoder on the CPU: 6 layers, 5 sliding (W=128) : 1 full, with Gemma's
blocks (q/k norm, 1 + w and sandwich norms, scaled embeddings, GeGLU, two RoPE bases).

Run:  python train.py --config configs/gemma3_tiny.py --workdir runs/gemma3_tiny
Shows: the startup line's layer pattern ("5 sliding : full (W=128)"), held-out loss falling as
the tiny config's does. The layout comparison on it (docs/layouts.md, "A local/global model"):
    python scripts/compare_layouts.py --config configs/gemma3_tiny.py --processes 2 \
        --seq-lens 8192,32768 --steps 5 --warmup 2 --out runs/compare_gemma3
(12 min on 2 cores: zigzag 1.16x and 1.28x over contiguous, striped 1.04x and 1.23x)
"""
from configs import tiny
from model.pattern import repeat


def get_config():
    c = tiny.get_config()
    c.name = "gemma3_tiny"
    c.model.update(num_layers=6, head_dim=64, layer_types=repeat("sliding," * 5 + "full", 6),
                   sliding_window=128, rope_theta=1e6, local_rope_theta=1e4, qk_norm=True,
                   norm_unit_offset=True, sandwich_norms=True, scale_embeddings=True,
                   mlp_activation="gelu_tanh", query_pre_attn_scalar=64.0, norm_eps=1e-6,
                   tie_embeddings=True)
    return c
