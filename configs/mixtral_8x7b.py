"""Mixtral-8x7B's shapes (mistralai/Mixtral-8x7B-v0.1): 32 layers, d 4096, 32 heads of 128, 8 KV
heads, vocab 32,000, its own output head, RoPE base 1,000,000, norm eps 1e-5, no sliding
window, and every MLP a mixture of 8 SwiGLU experts of width 14,336, 2 a token: softmax over
the 8, the top 2 renormalised to sum 1, the load-balancing loss at 0.02 (its config.json's
router_aux_loss_coef). 46,702,792,704 parameters, 12,879,925,248 active a token. Trained at
its 32,768-token context.

The experts split over fsdp x sequence (parallel/mesh.py) as far as their count divides it:
8 experts split at most 8 ways, and on a larger fsdp x sequence each device holds a whole
expert of every layer (5.7B parameters; parallel/mesh.py fit_spec). The plan of 64 H100s
below: 105.95 GiB a device (63.28 GiB of it parameters and Adam), more than an H100 holds
(docs/moe.md).

Run on GPU hosts, e.g. 64 devices in 8 rings of 8:
  python train.py --config configs/mixtral_8x7b.py --config.mesh.sequence=8 --config.mesh.fsdp=-1 --config.data.batch_size=8
Plan it first on this machine:
  python scripts/plan.py --config configs/mixtral_8x7b.py --mesh fsdp=8,sequence=8 --seq-len 32768 --batch 1 --hardware h100
Shows: tokens/s and MFU on the active FLOPs (2 of 8 experts) per logged step, with the
load-balancing loss.
"""
from configs.llama import moe_config, released_config


def get_config():
    c = released_config("mixtral_8x7b", vocab=32000, layers=32, d_model=4096, ffn_dim=14336,
                        heads=32, kv_heads=8, head_dim=128, tied=False, rope_theta=1e6,
                        seq_len=32768, norm_eps=1e-5)
    return moe_config(c, experts=8, top_k=2, renormalize=True, aux_loss=0.02)
