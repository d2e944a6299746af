"""A tiny mixture of experts on the CPU: configs/tiny.py with every layer's MLP 8 SwiGLU experts
of width 176, 2 a token (softmax, then the top 2, renormalised: Mixtral's router), the experts
split over the 8 simulated devices (fsdp x sequence, parallel/mesh.py).

Run:  python train.py --config configs/moe_tiny.py --workdir runs/moe_tiny
Shows: the startup line's parameters, every expert's and those a token reads ("active: 2 of 8
experts a token"), and the FLOPs per token of the active ones (what MFU divides by); each logged
step's load-balancing loss ("aux": transformers' load_balancing_loss_func, 2.0 = top_k when
the picks and the router's probability are spread evenly, up to 8 = num_experts when every
token picks the same two) and the busiest expert's share of the picks ("load", 1.0 even);
held-out loss falling (7.67 to 6.46 in 60 steps, 52 s on 2 shared cores, 6.6k tokens/s).
metrics.jsonl has aux_loss, z_loss, expert_load and dropped_fraction per logged step.
"""
from configs import tiny


def get_config():
    c = tiny.get_config()
    c.name = "moe_tiny"
    # 8 experts of half the dense width, 2 a token: a token's MLP costs what tiny's does
    c.model.moe.update(num_experts=8, top_k=2, expert_dim=176, router="softmax_topk",
                       renormalize=True, aux_loss=0.01, z_loss=0.001)
    # a quarter of tiny's steps: a run in under a minute (a step takes 1.5x tiny's here)
    c.train.update(steps=60, warmup_steps=6, log_every=10, eval_every=20)
    c.checkpoint.update(every=20, keep=2)
    return c
