"""Benchmark fwd+bwd of context-parallel attention per token layout (and per implementation:
``--impls ring,allgather,ulysses,usp``).

One process per CPU core (the honest comparison on a CPU: a ring round then waits for the
busiest device, as on a GPU ring):

    python scripts/bench_attention.py --processes 2 --seq-len 16384

spawns 2 copies of itself, each pinned to one core (``taskset -c i``) with one XLA thread,
joined by ``jax.distributed`` with gloo CPU collectives, over a mesh with axis "sequence".
Simulated devices in one process (measures total work, not the critical path):

    python scripts/bench_attention.py --processes 1 --devices 8 --seq-len 4096

On a GPU host, ``--processes 1`` uses every local accelerator (or the first ``--devices``).
Times are medians of ``--repeats`` after a warm-up call (compile excluded), with the layouts
interleaved inside each repeat so that machine noise hits them alike.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from parallel.cluster import place_or_exit  # noqa: E402
from parallel.distributed import initialize, simulate_cpu_devices, spawn_local  # noqa: E402



def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--processes", type=int, default=2, help="one process per CPU core (gloo)")
    p.add_argument("--devices", type=int, default=0,
                   help="with --processes 1: simulated CPU devices (or first N accelerators); 0 = all")
    p.add_argument("--layouts", default="contiguous,striped,zigzag")
    p.add_argument("--impls", default="ring", help="comma list: ring, allgather, ulysses, usp")
    p.add_argument("--ulysses", type=int, default=2, help="usp: Ulysses degree")
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block", type=int, default=128, help="block_q = block_kv tile size")
    p.add_argument("--stripe", type=int, default=1)
    p.add_argument("--window", type=int, default=0,
                   help="sliding window W (0: full causal): a query at p sees p - W < k <= p")
    p.add_argument("--sinks", default="off", choices=("off", "on", "both"),
                   help="attention sinks (gpt-oss: a logit per head, its gradient taken too); "
                        "both: each layout timed with and without them, interleaved")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--mode", default="fwd+bwd", choices=("fwd+bwd", "fwd"))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--verbose", action="store_true", help="per-process wall and CPU times")
    p.add_argument("--json", default="", help="write {'rows': [...]} here")
    # Set by parallel.distributed.spawn_local on the processes it starts.
    p.add_argument("--coordinator", help=argparse.SUPPRESS)
    p.add_argument("--num_processes", type=int, help=argparse.SUPPRESS)
    p.add_argument("--process_id", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.worker = -1 if args.process_id is None else args.process_id
    return args


def run(args):
    if args.worker < 0 and args.processes == 1 and args.devices:
        simulate_cpu_devices(args.devices)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from parallel.attention import context_parallel_attention

    if args.worker >= 0:
        initialize(place_or_exit(args.coordinator, args.num_processes, args.process_id))
        devices = jax.devices()
    else:
        devices = jax.devices()[: args.devices or None]
    n = len(devices)
    mesh = jax.make_mesh((n,), ("sequence",), axis_types=(jax.sharding.AxisType.Auto,), devices=devices)
    dtype = jnp.dtype(args.dtype)
    sinks_on = {"off": (False,), "on": (True,), "both": (False, True)}[args.sinks]
    keys = [(impl, layout, sink) for impl in args.impls.split(",") if impl
            for layout in args.layouts.split(",") if layout for sink in sinks_on]
    layouts = [(layout if impl == "ring" else f"{impl} {layout}") + (" +sinks" if sink else "")
               for impl, layout, sink in keys]
    b, length = args.batch, args.seq_len
    shapes = {"q": (b, length, args.heads, args.head_dim), "k": (b, length, args.kv_heads, args.head_dim)}
    sharding = NamedSharding(mesh, P(None, "sequence"))

    def make(shape, seed):
        # Each process fills only its own shards (deterministic per index, so no host transfer).
        def block(index):
            rng = np.random.default_rng([seed, index[1].start or 0])
            shp = tuple(len(range(*s.indices(d))) for s, d in zip(index, shape))
            return rng.standard_normal(shp, dtype=np.float32).astype(dtype)
        return jax.make_array_from_callback(shape, sharding, block)

    q, k, v, dout = make(shapes["q"], 0), make(shapes["k"], 1), make(shapes["k"], 2), make(shapes["q"], 3)
    sinks_H = jax.device_put(np.random.default_rng(5).normal(0, 1, args.heads).astype(np.float32),
                             NamedSharding(mesh, P()))

    def step_fn(impl, layout, sink):
        def loss(q, k, v, dout, sinks_H):
            out = context_parallel_attention(q, k, v, mesh=mesh, layout=layout, stripe=args.stripe,
                                             block_q=args.block, block_kv=args.block, impl=impl,
                                             ulysses=args.ulysses, window=args.window,
                                             sinks=sinks_H if sink else None)
            return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))
        wrt = (0, 1, 2, 4) if sink else (0, 1, 2)  # the sinks' gradient is part of their cost
        fn = jax.jit(loss if args.mode == "fwd" else jax.grad(loss, argnums=wrt))
        return lambda q, k, v, dout: fn(q, k, v, dout, sinks_H)

    # A tiny collective before each timed call lines the processes up, so a call's time is
    # not inflated by another process still finishing its previous call.
    sync = jax.jit(lambda x: jnp.sum(x), out_shardings=NamedSharding(mesh, P()))
    token = make((1, n), 4)
    fns = {label: step_fn(*key) for label, key in zip(layouts, keys)}
    t0 = time.perf_counter()
    for layout in layouts:
        for _ in range(max(args.warmup, 1)):
            jax.block_until_ready(fns[layout](q, k, v, dout))
    warm_s = time.perf_counter() - t0
    times = {layout: [] for layout in layouts}
    cpu = {layout: [] for layout in layouts}
    for _ in range(args.repeats):
        for layout in layouts:
            jax.block_until_ready(sync(token))
            t, c = time.perf_counter(), time.process_time()
            jax.block_until_ready(fns[layout](q, k, v, dout))
            times[layout].append(time.perf_counter() - t)
            cpu[layout].append(time.process_time() - c)
    if args.verbose:  # per process: wall time, and CPU time (the work this device did)
        print(f"process {max(args.worker, 0)}: " + ", ".join(
            f"{lay} wall {np.median(times[lay]):.3f} s cpu {np.median(cpu[lay]):.3f} s" for lay in layouts),
            file=sys.stderr, flush=True)

    if args.worker > 0:
        return
    med = {layout: float(np.median(ts)) for layout, ts in times.items()}
    base = med.get("contiguous")
    impl_of = dict(zip(layouts, (impl for impl, _, _ in keys)))
    rows = [{"layout": layout, "impl": impl_of[layout], "processes": max(args.processes, 1), "devices": n, "seq_len": length,
             "median_s": med[layout], "min_s": float(np.min(times[layout])),
             "speedup_vs_contiguous": (base / med[layout]) if base else None} for layout in layouts]
    platform = devices[0].platform
    print(f"\n{args.mode} of context_parallel_attention: {platform} x {n} devices in "
          f"{max(args.processes, 1)} process(es), batch {b}, seq_len {length}, heads {args.heads}/"
          f"{args.kv_heads}, head_dim {args.head_dim}, tile {args.block}, {args.dtype}"
          + (f", sliding window {args.window}" if args.window else "")
          + (", attention sinks" if args.sinks == "on" else "")
          + f"; median of {args.repeats} (warm-up + compile {warm_s:.1f} s excluded)\n")
    both = args.sinks == "both"
    for r in rows:  # a sinked row's time over the same layout's without sinks, measured alike
        plain = r["layout"].removesuffix(" +sinks")
        r["vs_without_sinks"] = med[r["layout"]] / med[plain] if both and plain != r["layout"] \
            else None
    print("| layout | devices | seq_len | median s | min s | speedup vs contiguous |"
          + (" time vs without sinks |" if both else ""))
    print("|---|---|---|---|---|---|" + ("---|" if both else ""))
    for r in rows:
        sp = f"{r['speedup_vs_contiguous']:.2f}x" if r["speedup_vs_contiguous"] else "-"
        extra = (f" {r['vs_without_sinks']:.3f} |" if r["vs_without_sinks"] else " - |") \
            if both else ""
        print(f"| {r['layout']} | {n} | {length} | {r['median_s']:.3f} | {r['min_s']:.3f} | {sp} |"
              + extra)
    sys.stdout.flush()
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "args": vars(args)}, f, indent=2)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.processes > 1 and args.worker < 0:
        sys.exit(spawn_local([os.path.abspath(__file__), *argv], args.processes,
                             quiet_followers=not args.verbose))
    else:
        run(args)


if __name__ == "__main__":
    main()
