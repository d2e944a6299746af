"""Does an asynchronous checkpoint save stall training? Step times around saves, tiny config.

Trains the config (default configs/tiny.py: 8 devices, ring attention, striped; on a CPU they are
simulated, see parallel/host_devices.py) and
times every step from dispatch to its result, with the save call inside the step that triggers
it, where train.py makes it (after the step, before the next one is dispatched). A
step that triggers a save must take at most 1.2x the median step time: the verdict uses the
median over the save steps, since on a shared CPU single steps jitter by more than a save
costs; the slowest save step, the save call itself and the step after each save (which runs
while the background write competes for the same CPU cores that are the simulated devices)
are reported too. --sync repeats the measurement with synchronous saves, for comparison.

Run:  python scripts/bench_checkpoint.py [--config configs/tiny.py] [--steps 100] [--every 5]
          [--warmup 3] [--sync] [--json bench_out/checkpoint.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from configs.loading import load  # noqa: E402
from errors import ConfigFileError  # noqa: E402
from parallel.host_devices import simulate_for_mesh  # noqa: E402

LIMIT = 1.2


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/tiny.py")
    p.add_argument("--steps", type=int, default=100, help="timed steps")
    p.add_argument("--every", type=int, default=5, help="steps between saves")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation)")
    p.add_argument("--sync", action="store_true", help="also measure synchronous saves")
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args(argv)


def measure(config, args, async_save: bool) -> dict:
    import jax

    from checkpoints.manager import Checkpoints
    from checkpoints.resume import run_meta
    from data.pipeline import make_pipeline
    from parallel.mesh import make_mesh
    from training.state import Trainer
    config = config.copy_and_resolve_references()
    config.checkpoint.update(every=args.every, keep=2, async_save=async_save)
    mesh = make_mesh(config.mesh)
    pipe = make_pipeline(config, mesh)
    trainer = Trainer(config, mesh)
    state = trainer.init(config.train.seed)
    for _ in range(args.warmup):
        state, _ = trainer.train_step(state, next(pipe.train))
    jax.block_until_ready(state)
    meta = run_meta(config, pipe.fingerprint, mesh)
    with tempfile.TemporaryDirectory(prefix="bench_ckpt_") as tmp:
        ckpts = Checkpoints(os.path.join(tmp, "checkpoints"), config.checkpoint, log=lambda m: None)
        records = []
        try:
            for step in range(1, args.steps + 1):
                t0 = time.perf_counter()
                state, metrics = trainer.train_step(state, next(pipe.train))
                saves = step % args.every == 0
                call = 0.0
                if saves:
                    # A save waits for the step's result anyway; waiting first separates the
                    # save's own cost (the call) from the step's compute.
                    jax.block_until_ready(state)
                    t1 = time.perf_counter()
                    ckpts.save(step, state, pipe.train.state(), meta)
                    call = time.perf_counter() - t1
                jax.block_until_ready(metrics)
                records.append({"step": step, "seconds": time.perf_counter() - t0,
                                "save_call_s": call,
                                "kind": "save" if saves else
                                ("after save" if step > 1 and (step - 1) % args.every == 0
                                 else "plain")})
            ckpts.wait()
            saved = ckpts.steps()
        finally:
            ckpts.close()
            pipe.close()
    median = statistics.median(r["seconds"] for r in records)
    for r in records:
        r["ratio"] = r["seconds"] / median
    saves = [r for r in records if r["kind"] == "save"]
    after = [r for r in records if r["kind"] == "after save"]
    return {"async_save": async_save, "median_step_s": median,
            "save_steps": [r["step"] for r in saves],
            "max_save_ratio": max(r["ratio"] for r in saves),
            "median_save_ratio": statistics.median(r["ratio"] for r in saves),
            "median_save_call_s": statistics.median(r["save_call_s"] for r in saves),
            "median_after_save_ratio":
                statistics.median(r["ratio"] for r in after) if after else None,
            "max_after_save_ratio": max(r["ratio"] for r in after) if after else None,
            "checkpoints_on_disk": saved, "steps": records}


def report(res: dict) -> str:
    mode = "async" if res["async_save"] else "sync"
    lines = [f"{mode} saves: median step {1000 * res['median_step_s']:.1f} ms over "
             f"{len(res['steps'])} steps",
             f"{'step':>6} {'kind':>11} {'ms':>9} {'x median':>9} {'save call ms':>13}"]
    for r in res["steps"]:
        if r["kind"] != "plain":
            call = f"{1000 * r['save_call_s']:.1f}" if r["kind"] == "save" else ""
            lines.append(f"{r['step']:>6} {r['kind']:>11} {1000 * r['seconds']:>9.1f} "
                         f"{r['ratio']:>9.2f} {call:>13}")
    verdict = "PASS" if res["median_save_ratio"] <= LIMIT else "FAIL"
    lines.append(f"save steps: median {res['median_save_ratio']:.2f}x the median step (limit "
                 f"{LIMIT}x): {verdict}; slowest {res['max_save_ratio']:.2f}x; the save call "
                 f"itself: median {1000 * res['median_save_call_s']:.1f} ms")
    if res["max_after_save_ratio"] is not None:
        lines.append(f"steps right after a save (background write running): median "
                     f"{res['median_after_save_ratio']:.2f}x, slowest "
                     f"{res['max_after_save_ratio']:.2f}x")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    from absl import logging as absl_logging
    absl_logging.set_verbosity(absl_logging.ERROR)
    if args.every < 1 or args.steps < args.every:
        print(f"error: need --every >= 1 and --steps >= --every (got {args.every}, {args.steps})",
              file=sys.stderr)
        return 2
    try:
        config = load(args.config)
    except ConfigFileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    simulate_for_mesh(config.mesh)  # before jax is imported
    import jax
    print(f"{args.config}: {jax.device_count()} {jax.default_backend()} devices, mesh "
          f"{dict(config.mesh)}, attention {config.attention.impl}/{config.attention.layout}, "
          f"save every {args.every} steps")
    results = [measure(config, args, async_save=True)]
    if args.sync:
        results.append(measure(config, args, async_save=False))
    for res in results:
        print(report(res))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"config": args.config, "limit": LIMIT, "results": results}, f, indent=2)
    return 0 if results[0]["median_save_ratio"] <= LIMIT else 1


if __name__ == "__main__":
    sys.exit(main())
