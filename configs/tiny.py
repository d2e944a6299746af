"""The CPU demo: a tiny decoder on the stdlib corpus, 8 simulated devices, striped ring attention.

Run:  make demo
  or  python train.py --config configs/tiny.py
(on a CPU, train.py simulates the 8 devices itself; see parallel/host_devices.py)
Shows: held-out loss falling well below its first value in a few minutes on a 2-core CPU,
with tokens/s, MFU and a checkpoint in the run directory.
"""
from configs import base


def get_config():
    c = base.get_config()
    c.name = "tiny"
    c.model.update(vocab_size=2048, d_model=128, num_layers=2, num_heads=4, num_kv_heads=2,
                   ffn_dim=352, remat="none")
    c.attention.update(block_q=64, block_kv=64)
    c.mesh.update(data=1, fsdp=2, sequence=4, tensor=1)
    c.data.update(seq_len=512, batch_size=8, max_docs=0)
    c.train.update(steps=240, lr=3e-3, warmup_steps=24, log_every=20, eval_every=80,
                   eval_batches=4)
    c.checkpoint.update(every=80, keep=2)
    return c
