"""Qwen3-30B-A3B's shapes (Qwen/Qwen3-30B-A3B): 48 layers, d 2048, 32 query heads of 128, 4 KV
heads, vocab 151,936, its own output head, RMSNorm on each head's q and k, RoPE base 1,000,000,
norm eps 1e-6, and every MLP a mixture of 128 SwiGLU experts of width 768, 8 a token: softmax
over the 128, the top 8 renormalised to sum 1 (norm_topk_prob), the load-balancing loss at
0.001 (router_aux_loss_coef). 30,532,122,624 parameters, 3,353,032,704 a token reads.

Trained at 131,072 tokens, the model card's long context: 4 x its native 32,768 with YaRN
(rope_scaling yarn, factor 4, original 32,768, as the card says to set it).

Run on 8 H200s in a ring of 8 (the plan in docs/moe.md: 72.04 GiB a device, 51% of an H200, a
4.43 s step at a 64.6% MFU bound; on 8 H100s add --config.model.remat=offload_input: 69.10 GiB
and 3 GiB of host memory a device, 0.04 GiB over the 90% line with remat full):
  python train.py --config configs/qwen3_30b_a3b.py --config.mesh.sequence=8 --config.mesh.fsdp=-1 --config.data.batch_size=1 --config.attention.layout=zigzag
Plan it first on this machine (8 s here):
  python scripts/plan.py --config configs/qwen3_30b_a3b.py --mesh sequence=8 --seq-len 131072 --batch 1 --hardware h100
Shows: tokens/s and MFU on the active FLOPs (8 of 128 experts) per logged step, with the
load-balancing loss.
"""
from configs.llama import moe_config, qwen3_config


def get_config():
    c = qwen3_config("qwen3_30b_a3b", layers=48, d_model=2048, ffn_dim=6144, heads=32, tied=False)
    c.model.num_kv_heads = 4
    c.model.rope_scaling.update(type="yarn", factor=4.0, original_max_len=32768)
    c.data.seq_len = 131072
    return moe_config(c, experts=128, top_k=8, expert_dim=768, renormalize=True, aux_loss=0.001)
