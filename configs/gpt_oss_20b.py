"""gpt-oss-20b's shapes (openai/gpt-oss-20b): 24 layers, d 2880, 64 query heads of 64, 8 KV
heads, vocab 201,088, its own output head, norm eps 1e-5; attention sinks (a logit per query
head in every softmax), biases on q, k, v and o, a 128-token sliding window on the even layers
and full attention on the odd ones; every MLP a mixture of 32 experts of width 2880, 4 a token
(top 4 logits, then a softmax over them, with a router bias), each expert with biases and the
clamped unit (gate <= 7, up in [-7, 7], (up + 1) * gate * sigmoid(1.702 gate)).
RoPE base 150,000 with YaRN (factor 32 of a 4,096-token pretraining context, unrounded ramp):
131,072 tokens, the card's context. 20,914,757,184 parameters; a token reads 4,187,440,704
(3,608,307,264 but the embedding table: the card's 3.6B active).

Run on 8 H100s in a ring of 8 (the plan in docs/moe.md: 58.51 GiB a device, 73% of an H100, a
1.51 s step at a 66.3% MFU bound in zigzag, remat full, the experts gathered; striped 1.73 s,
contiguous 2.32 s: the 12 full layers decide it, though the sliding ones stop a contiguous ring
after 2 rounds), from the released weights (scripts/convert_hf.py import reads their MXFP4
experts):
  python train.py --config configs/gpt_oss_20b.py --config.mesh.sequence=8 --config.mesh.fsdp=-1 --config.data.batch_size=1 --config.attention.layout=zigzag --config.checkpoint.restore_from=<imported run> --config.checkpoint.restore_weights_only=True
Plan it first on this machine (17 s here):
  python scripts/plan.py --config configs/gpt_oss_20b.py --mesh sequence=8 --seq-len 131072 --batch 1 --hardware h100
Shows: tokens/s and MFU on the active FLOPs (4 of 32 experts; the sliding layers' attention
over 128 keys) per logged step, with the load-balancing loss.
"""
from configs.llama import gpt_oss_layers, released_config


def get_config():
    c = released_config("gpt_oss_20b", vocab=201088, layers=24, d_model=2880, ffn_dim=2880,
                        heads=64, kv_heads=8, head_dim=64, tied=False, rope_theta=150000.0,
                        seq_len=131072, norm_eps=1e-5)
    c.model.rope_scaling.update(type="yarn", factor=32.0, original_max_len=4096, beta_fast=32.0,
                                beta_slow=1.0, truncate=False)
    return gpt_oss_layers(c, experts=32, top_k=4, expert_dim=2880, window=128, aux_loss=0.9)
