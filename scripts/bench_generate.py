"""Generation with the KV cache against generation without one: new tokens per second.

The cache (evaluation/kv_cache.py) prefills the prompt once with the config's context-parallel
attention over its mesh and reads a cache sharded over the sequence axis for each new token;
without a cache (evaluation/recompute.py, what scripts/generate.py did before) every new token
runs the whole window (prompt + new tokens, rounded up to 64) again on one device. Both run in
this process over the same simulated devices, greedy, on random parameters and a random
prompt (what is measured is the work per token, not the text); both must produce the same
tokens. Timed in turns (one generation each per round), medians over --repeats rounds after
one untimed warm-up each (compile time excluded). tokens/s counts the new tokens over the
whole call, prefill included; the cache's prefill and per-token times are shown apart.

Run:  python scripts/bench_generate.py [--config configs/tiny.py] [--prompt 2048] [--new 64]
          [--repeats 3] [--json bench_out/generate.json]
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
    p.add_argument("--prompt", type=int, default=2048, help="prompt tokens")
    p.add_argument("--new", type=int, default=64, help="new tokens")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax
    import numpy as np
    from flax import nnx

    from evaluation import recompute
    from evaluation.kv_cache import Generator
    from evaluation.lengths import Buckets
    from model.decoder import Decoder, single_device_model
    from model.layers import AttentionBackend
    from parallel.mesh import batch_shards, make_mesh
    from training.state import Trainer
    config = load(args.config, [])
    config.data.seq_len = max(int(config.data.seq_len), args.prompt + args.new)
    mesh = make_mesh(config.mesh)
    trainer = Trainer(config, mesh)
    vocab = int(config.model.vocab_size)
    params = nnx.to_pure_dict(nnx.split(Decoder(config.model, AttentionBackend(),
                                                nnx.Rngs(args.seed)), nnx.Param)[1])
    rng = np.random.default_rng(args.seed)
    prompt = rng.integers(1, vocab, args.prompt).tolist()
    sharded = jax.device_put(params, trainer.param_shardings)
    one = jax.device_put(params, jax.devices()[0])
    graphdef, _ = single_device_model(config)
    gen = Generator(trainer, vocab)
    rows = batch_shards(mesh)
    length = Buckets(config, mesh, config.data.seq_len)(args.prompt)

    def cached():
        return gen.generate(sharded, [prompt] * rows, args.new, length=length, eos=-1)[0]

    def prefill_only():
        return gen.generate(sharded, [prompt] * rows, 1, length=length, eos=-1)[0]

    def uncached():
        return recompute.generate(graphdef, one, prompt, args.new, seq_len=config.data.seq_len,
                                  usable_vocab=vocab, eos=-1)

    runs = {"cache": cached, "cache_prefill": prefill_only, "no_cache": uncached}
    outputs = {name: fn() for name, fn in runs.items()}  # warm-up: compiles
    times = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    same = outputs["cache"] == outputs["no_cache"]
    med = {name: statistics.median(t) for name, t in times.items()}
    per_token = (med["cache"] - med["cache_prefill"]) / max(args.new - 1, 1)
    a = config.attention
    result = {
        "config": args.config, "prompt": args.prompt, "new": args.new, "repeats": args.repeats,
        "mesh": {k: int(v) for k, v in mesh.shape.items()}, "layout": a.layout,
        "attention": a.impl, "rows": rows, "padded_prompt": length,
        "no_cache_window": recompute.window_size(args.prompt, args.new, config.data.seq_len),
        "seconds": med, "times": times,
        "tokens_per_s": {"cache": args.new / med["cache"], "no_cache": args.new / med["no_cache"]},
        "cache_prefill_s": med["cache_prefill"], "cache_per_token_s": per_token,
        "speedup": med["no_cache"] / med["cache"], "same_tokens": same}
    print(f"{args.prompt}-token prompt, {args.new} new tokens, greedy; {a.impl} {a.layout} over "
          f"mesh {'x'.join(str(v) for v in mesh.shape.values())} ({jax.device_count()} simulated "
          f"devices); medians of {args.repeats}")
    print(f"{'':28s}{'seconds':>10s}{'tokens/s':>10s}")
    print(f"{'no cache (one device)':28s}{med['no_cache']:10.2f}{args.new / med['no_cache']:10.1f}")
    print(f"{'KV cache (the mesh)':28s}{med['cache']:10.2f}{args.new / med['cache']:10.1f}")
    print(f"  of which prefill {med['cache_prefill']:.2f} s, then {per_token * 1e3:.1f} ms a token")
    print(f"speedup {result['speedup']:.1f}x; the same tokens: {same}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
