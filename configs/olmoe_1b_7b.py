"""OLMoE-1B-7B's shapes (allenai/OLMoE-1B-7B-0924): 16 layers, d 2048, 16 heads of 128 (as many KV
heads), vocab 50,304, its own output head, RoPE base 10,000, norm eps 1e-5, and every MLP a
mixture of 64 SwiGLU experts of width 1024, 8 a token: softmax over the 64, the top 8 kept as
they are (norm_topk_prob False), the load-balancing loss at 0.01 (router_aux_loss_coef) and the
router z-loss at 0.001 (the OLMoE paper's; transformers does not compute it). Trained at its
4,096-token context (max_position_embeddings).

q/k norm: OLMoE normalises the whole q and k projections (one RMSNorm over all 16 heads' 2048
dims of q and one over k's, a weight of 2048 each, before the split into heads and RoPE):
model.qk_norm with model.qk_norm_scope=projection. 6,919,161,856 parameters, the release's
(1,282,017,280 active a token). The released weights load into it: scripts/convert_hf.py import
--hf OLMoE-1B-7B-0924 (a local copy of allenai/OLMoE-1B-7B-0924) writes a run directory with
them and these fields (hf/config.py), to train from with configs/from_run.py:RUN_DIR or
--config.checkpoint.restore_from=RUN_DIR --config.checkpoint.restore_weights_only=True; the
import leaves the z-loss at 0, as transformers' OlmoeForCausalLM computes none.

Run on a GPU/TPU host, e.g. 8 devices, the 64 experts 8 to a device over fsdp (to train on
OLMoE's tokenizer add --config.data.tokenizer=PATH/tokenizer.json):
  python train.py --config configs/olmoe_1b_7b.py --config.mesh.fsdp=-1 --config.data.batch_size=8
Plan it first on this machine (17.80 GiB a device on 8 H100s; docs/moe.md):
  python scripts/plan.py --config configs/olmoe_1b_7b.py --mesh fsdp=8 --seq-len 4096 --batch 1 --hardware h100
Shows: the startup line's parameters (every expert) and those a token reads (8 of 64 experts),
tokens/s and MFU on the active FLOPs, the load-balancing loss per logged step.
"""
from configs.llama import moe_config, released_config


def get_config():
    c = released_config("olmoe_1b_7b", vocab=50304, layers=16, d_model=2048, ffn_dim=1024,
                        heads=16, kv_heads=16, head_dim=128, tied=False, rope_theta=10000.0,
                        seq_len=4096, norm_eps=1e-5)
    c.model.update(qk_norm=True, qk_norm_scope="projection")  # over the whole q and k (above)
    return moe_config(c, experts=64, top_k=8, renormalize=False, aux_loss=0.01, z_loss=0.001)
