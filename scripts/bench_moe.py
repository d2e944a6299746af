"""What a mixture of experts costs on this machine: the grouped matmul's candidates, and a tiny
MoE's train step as the experts grow, dropless against every expert computed densely.

  grouped    one layer's expert matmuls (gate, up, down), forward and backward, for T tokens
             at top-k: jax.lax.ragged_dot, the CPU's scan over padded blocks, and every expert
             on every token (dense; its cost grows with the experts, not with k)
  step       a tiny decoder whose every MLP is an MoE (model/moe.py), one train step on one
             device, at each --experts count with --top-k: model.moe.grouped=auto (dropless:
             blocks on a CPU) against grouped=dense. Dropless cost follows the active experts.

Medians of --repeats after a warm-up (compile excluded), one run. Writes --json.

Run:  python scripts/bench_moe.py [--experts 8,32,128] [--top-k 8] [--tokens 2048]
          [--repeats 5] [--json bench_out/moe.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def timed(fn, repeats: int) -> float:
    import jax
    jax.block_until_ready(fn())  # compile and warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def grouped_rows(tokens: int, top_k: int, experts: int, d: int, f: int, repeats: int) -> list:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from model import moe
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(tokens, d)), jnp.float32)
    w = [jnp.asarray(rng.normal(0, 0.1, s), jnp.float32) for s in
         ((experts, d, f), (experts, d, f), (experts, f, d))]
    logits = jnp.asarray(rng.normal(size=(tokens, experts)), jnp.float32)
    weights, picks, _ = moe.route(logits, top_k)
    rows = []
    for impl in ("ragged", "blocks", "dense"):
        def loss(x, w, impl=impl):
            return moe.experts_forward(x, weights, picks, *w, impl=impl)[0].sum()
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        seconds = timed(lambda: step(x, w), repeats)
        flops = 3 * 2 * 3 * tokens * top_k * d * f  # 3 matmuls, forward + 2x backward
        rows.append({"impl": impl, "tokens": tokens, "experts": experts, "top_k": top_k,
                     "seconds": seconds, "active_gflop_s": flops / seconds / 1e9})
    return rows


def step_rows(experts_list, top_k: int, seq_len: int, repeats: int) -> list:
    import jax
    import numpy as np
    from configs import tiny
    from parallel.mesh import make_mesh
    from training.state import Trainer
    rows = []
    for experts in experts_list:
        for grouped in ("auto", "dense"):
            c = tiny.get_config()
            c.model.update(vocab_size=512, d_model=128, num_layers=2, num_heads=4,
                           num_kv_heads=2, ffn_dim=256, dtype="float32", remat="none")
            c.model.moe.update(num_experts=experts, top_k=top_k, expert_dim=64,
                               grouped=grouped)
            c.data.update(seq_len=seq_len, batch_size=1)
            c.mesh.update(data=1, fsdp=1, sequence=1, tensor=1)
            c.attention.update(impl="dense", layout="contiguous")
            c.train.update(loss_chunk=0)
            trainer = Trainer(c, make_mesh(c.mesh, jax.devices()[:1]))
            state = trainer.init(0)
            rng = np.random.default_rng(0)
            tokens = rng.integers(0, 512, (1, seq_len)).astype(np.int32)
            batch = jax.device_put({
                "tokens": tokens, "labels": np.roll(tokens, -1, 1),
                "positions": np.arange(seq_len, dtype=np.int32)[None],
                "segment_ids": np.ones((1, seq_len), np.int32),
                "loss_mask": np.ones((1, seq_len), np.float32)}, trainer.batch_shardings)
            grads = jax.jit(trainer.gradients)
            seconds = timed(lambda: grads(state.params, batch), repeats)
            rows.append({"experts": experts, "top_k": top_k, "grouped": grouped,
                         "tokens": seq_len, "step_s": seconds})
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", default="8,32,128")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    experts = [int(e) for e in args.experts.split(",")]
    grouped = grouped_rows(args.tokens, min(4, args.top_k), 32, 256, 512, args.repeats)
    print(f"grouped matmul, {args.tokens} tokens x top-{grouped[0]['top_k']} of 32 experts "
          f"(D 256, F 512), forward + backward:")
    for r in grouped:
        print(f"  {r['impl']:7} {r['seconds'] * 1e3:9.1f} ms  {r['active_gflop_s']:7.1f} "
              f"GFLOP/s of active work")
    steps = step_rows(experts, args.top_k, args.tokens, args.repeats)
    print(f"train step gradients, tiny MoE (2 layers, D 128, expert width 64), {args.tokens} "
          f"tokens, top-{args.top_k}:")
    print(f"  {'experts':>7} {'dropless s':>11} {'dense s':>9} {'dense/dropless':>15}")
    for e in experts:
        a = next(r for r in steps if r["experts"] == e and r["grouped"] == "auto")["step_s"]
        d = next(r for r in steps if r["experts"] == e and r["grouped"] == "dense")["step_s"]
        print(f"  {e:>7} {a:11.3f} {d:9.3f} {d / a:15.2f}")
    result = {"grouped": grouped, "steps": steps, "command": " ".join(
        ["python scripts/bench_moe.py", *(argv if argv is not None else sys.argv[1:])])}
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
