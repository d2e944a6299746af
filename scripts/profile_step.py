"""Where a train step's time goes: trace a few steps with jax.profiler and print a table.

    python scripts/profile_step.py --config configs/llama_1b.py [--steps 3] [--warmup 2]
        [--trace-dir bench_out/profile] [--json bench_out/profile.json] [--config.a.b=v ...]

Builds the config's train step on its mesh (simulated CPU devices on a CPU, as train.py does;
model.remat=auto resolved as train.py resolves it), compiles it once, runs --warmup untimed steps
on a synthetic batch (random tokens, one document per row, positions in the layout's order),
then traces --steps steps. Rows (training/profile.py): attention forward and backward, matmuls,
norms, loss, optimizer, collectives, elementwise and other, host gaps; per row its milliseconds
per step, share of the step and achieved TFLOP/s per device (model FLOPs: the causal half, no
recompute). The rows add up to the traced step, which is checked against the wall clock
measured around each step (median). The trace itself stays in --trace-dir for TensorBoard /
xprof. Exit code 2 with one line for a config that cannot run.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--steps", type=int, default=3, help="traced steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--trace-dir", default="bench_out/profile")
    p.add_argument("--json", default="")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_known_args(argv)


def synthetic_batch(trainer, config, seed):
    import jax
    import numpy as np

    from parallel.layouts import permutation
    c, d = config, config.data
    rng = np.random.default_rng(seed)
    shape = (d.batch_size, d.seq_len)
    perm = permutation(c.attention.layout, d.seq_len, c.mesh.sequence, c.attention.stripe)
    host = {"tokens": rng.integers(0, c.model.vocab_size, shape, dtype=np.int32),
            "labels": rng.integers(0, c.model.vocab_size, shape, dtype=np.int32),
            "positions": np.broadcast_to(perm.astype(np.int32), shape),
            "segment_ids": np.zeros(shape, np.int32), "loss_mask": np.ones(shape, np.float32)}
    return {k: jax.device_put(host[k], s) for k, s in trainer.batch_shardings.items()}


def main(argv=None) -> int:
    args, rest = parse_args(argv)
    from planning.cli import UsageError, load_config
    from parallel.host_devices import simulate_for_mesh
    try:
        config = load_config(args.config, rest)
        if args.steps < 1 or args.warmup < 0:
            raise UsageError("--steps must be >= 1 and --warmup >= 0")
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    simulate_for_mesh(config.mesh)  # before jax is imported
    import jax

    from training.entry import user_errors
    try:
        return run(args, config)
    except user_errors() as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def run(args, config) -> int:
    import jax

    from parallel.mesh import make_mesh
    from training import profile
    from training.state import Trainer
    from configs.validate import validate
    validate(config, jax.device_count())
    mesh = make_mesh(config.mesh)
    trainer = Trainer(config, mesh)
    if trainer.remat_line:
        print(trainer.remat_line)
    config = trainer.config  # model.remat resolved
    state = trainer.init(args.seed)
    batch = synthetic_batch(trainer, config, args.seed)
    # On a GPU, XLA runs most kernels inside command buffers (CUDA graphs), whose kernels the
    # trace names only "command_buffer_N": off while profiling, every kernel names its HLO op
    # (the step then pays each kernel's launch, about 1-2% of a 1B model's step at 32k).
    gpu = mesh.devices.flat[0].platform == "gpu"
    compiled = trainer.train_step.lower(state, batch).compile(
        compiler_options=profile.GPU_TRACE_OPTIONS if gpu else None)
    ops, comps = profile.parse_hlo(compiled.as_text())
    try:
        per_step, walls, newest = profile.trace_steps(compiled, state, batch, args.warmup,
                                                      args.steps, args.trace_dir, ops, comps)
    except profile.EmptyTrace as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    wall = statistics.median(walls)
    devices = mesh.devices.size
    flops = profile.row_flops(config, devices)
    a = config.attention
    print(f"{config.name}: {config.data.batch_size} x {config.data.seq_len} tokens per step on "
          f"{devices} {mesh.devices.flat[0].device_kind} device(s), mesh {dict(mesh.shape)}, "
          f"attention {a.impl}/{a.layout} kernel {trainer.backend.kernel}, remat "
          f"{config.model.remat}; {len(walls)} traced steps"
          f"{', XLA command buffers off' if gpu else ''} (trace: {newest})")
    print(profile.table(per_step, wall, flops))
    if args.json:
        out = {"config": config.name, "devices": devices, "kernel": trainer.backend.kernel,
               "remat": config.model.remat, "wall_s": wall, "walls_s": walls,
               "rows_s": per_step, "flops": flops, "trace": str(newest)}
        pathlib.Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
