"""Where a plan's per-device memory goes: the same train step compiled four ways.

    python scripts/plan_attribution.py --config configs/llama_7b.py --mesh fsdp=8,sequence=8 \
        --seq-len 262144

Rows: the planner as it was (XLA CPU's loop-invariant code motion hoisting an fp32 copy of the
stacked bf16 layer inputs, which GPUs/TPUs never make) with no chunking; the planner now with
no chunking; with the loss chunked (train.loss_chunk=2048); with the MLP chunked too
(model.mlp_chunk=8192). One sequence per data x fsdp group, the config's remat policy.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from planning.cli import parse_mesh, simulate_devices  # noqa: E402  (no jax yet)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--mesh", required=True, help="e.g. fsdp=8,sequence=8")
    p.add_argument("--seq-len", type=int, required=True)
    args = p.parse_args(argv)
    mesh = parse_mesh(args.mesh)
    simulate_devices(math.prod(mesh.values()))
    import jax

    from configs.loading import load
    from planning.program import PLAN_COMPILER_OPTIONS, compile_step, planned_config
    hoisting = {k: v for k, v in PLAN_COMPILER_OPTIONS.items() if k != "xla_disable_hlo_passes"}
    # One config for every row; each row sets both of the fields the rows differ in.
    c = planned_config(load(args.config), args.seq_len, mesh["data"] * mesh["fsdp"], mesh, None)
    print("| config | seq_len | mesh | planner, chunks | memory / device |\n|---|---|---|---|---|")
    for name, opts, loss_chunk, mlp_chunk in [
            ("with the fp32 stack copy, no chunks", hoisting, 0, 0),
            ("without it, no chunks", PLAN_COMPILER_OPTIONS, 0, 0),
            ("without it, loss chunks of 2048", PLAN_COMPILER_OPTIONS, 2048, 0),
            ("without it, loss 2048 + MLP 8192", PLAN_COMPILER_OPTIONS, 2048, 8192)]:
        c.train.loss_chunk, c.model.mlp_chunk = loss_chunk, mlp_chunk
        m = compile_step(c, jax.devices(), compiler_options=opts).memory
        print(f"| {c.name} | {args.seq_len:,} | {args.mesh} | {name} | {m.total / 2**30:.2f} GiB |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
