"""Does gradient accumulation cost more than the steps it replaces? Tiny config, 8 devices.

A step of ``data.batch_size`` rows run as k microbatches (train.microbatches=k) is timed
against a plain step of the microbatch's size (batch_size / k rows): it must cost at most k of
those (ratio <= 1; the accumulation scan adds one gradient sum per microbatch). The plain step
of the whole batch is shown for reference (what accumulation trades away for 1/k of the
activations). All variants are timed in turns within one run (one step each per round, so
machine load hits them alike), medians over --repeats rounds after --warmup untimed steps;
compile time excluded. Batches are random tokens (the data pipeline is not what is measured).

Run:  python scripts/bench_microbatches.py [--config configs/tiny.py] [--batch 8]
          [--microbatches 2,4] [--repeats 15] [--warmup 2] [--json bench_out/microbatches.json]
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

from configs.loading import load  # noqa: E402
from parallel.distributed import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(8)  # before jax is imported


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/tiny.py")
    p.add_argument("--batch", type=int, default=8, help="global rows of the accumulated step")
    p.add_argument("--microbatches", default="2,4", help="comma list of k")
    p.add_argument("--repeats", type=int, default=15, help="timed rounds")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first")
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args(argv)


def random_batch(config, trainer, rows: int, rng):
    import jax
    import numpy as np
    L, V = config.data.seq_len, config.model.vocab_size
    positions = np.broadcast_to(np.arange(L, dtype=np.int32), (rows, L))
    host = {"tokens": rng.integers(0, V, (rows, L)).astype(np.int32),
            "labels": rng.integers(0, V, (rows, L)).astype(np.int32),
            "positions": np.ascontiguousarray(positions),
            "segment_ids": np.ones((rows, L), np.int32),
            "loss_mask": np.ones((rows, L), np.float32)}
    return {k: jax.device_put(v, trainer.batch_shardings[k]) for k, v in host.items()}


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax
    import numpy as np

    from parallel.mesh import make_mesh
    from training.state import Trainer
    from configs.validate import ConfigError, validate

    base = load(args.config)
    ks = [int(k) for k in args.microbatches.split(",") if k.strip()]
    variants = [(args.batch, 1)] + [v for k in ks for v in ((args.batch, k), (args.batch // k, 1))]
    variants = list(dict.fromkeys(variants))
    rng = np.random.default_rng(0)
    runs = {}
    for rows, k in variants:
        c = base.copy_and_resolve_references()
        c.data.batch_size, c.train.microbatches = rows, k
        try:
            validate(c, jax.device_count())
        except ConfigError as e:
            print(f"error: --batch {args.batch} with k={k}: {e}", file=sys.stderr)
            return 2
        trainer = Trainer(c, make_mesh(c.mesh))
        state = trainer.init(0)
        batch = random_batch(c, trainer, rows, rng)
        for _ in range(args.warmup):
            state, metrics = trainer.train_step(state, batch)
        jax.block_until_ready(metrics)
        runs[(rows, k)] = {"trainer": trainer, "state": state, "batch": batch, "times": []}
    for _ in range(args.repeats):
        for key, r in runs.items():
            t0 = time.perf_counter()
            r["state"], metrics = r["trainer"].train_step(r["state"], r["batch"])
            jax.block_until_ready(metrics)
            r["times"].append(time.perf_counter() - t0)
    med = {key: statistics.median(r["times"]) for key, r in runs.items()}
    L = base.data.seq_len
    rows_out = []
    for k in ks:
        acc, small = med[(args.batch, k)], med[(args.batch // k, 1)]
        rows_out.append({"k": k, "rows": args.batch, "microbatch_rows": args.batch // k,
                         "step_s": acc, "small_step_s": small, "k_small_steps_s": k * small,
                         "ratio": acc / (k * small), "whole_batch_step_s": med[(args.batch, 1)],
                         "tokens_per_s": args.batch * L / acc})
    lines = [f"{args.config}, {jax.device_count()} simulated devices, {L} tokens per row, "
             f"medians of {args.repeats} rounds after {args.warmup} warm-up steps:", "",
             "| k | step of {0} rows as k microbatches | step of {0}/k rows | k x that | ratio "
             "(<= 1) | step of {0} rows at once | tokens/s, accumulated |".format(args.batch),
             "|---|---|---|---|---|---|---|"]
    for r in rows_out:
        lines.append(f"| {r['k']} | {r['step_s'] * 1e3:.0f} ms | {r['small_step_s'] * 1e3:.0f} ms | "
                     f"{r['k_small_steps_s'] * 1e3:.0f} ms | {r['ratio']:.2f} | "
                     f"{r['whole_batch_step_s'] * 1e3:.0f} ms | {r['tokens_per_s']:,.0f} |")
    print("\n".join(lines))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"config": args.config, "devices": jax.device_count(), "repeats": args.repeats,
                       "warmup": args.warmup, "results": rows_out}, f, indent=1)
    return 0 if all(r["ratio"] <= 1.0 for r in rows_out) else 1


if __name__ == "__main__":
    sys.exit(main())
