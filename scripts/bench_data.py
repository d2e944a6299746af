"""Host throughput of the data pipeline vs. what a 1B model consumes on one H100.

Measures, on this machine's CPUs, tokens/s of each stage and of the whole pipeline:
  tokenize   read the source + fast batch encoder (cold cache; once per corpus)
  pack       rows of seq_len+1 with segment ids/positions/loss mask + layout permutation (host)
  batch      pack + placement as sharded global jax.Arrays (make_array_from_process_local_data)
  iterator   what the trainer sees: next(pipe.train) with the prefetch thread
  end-to-end a cold run: every token tokenized once and batched once, 1/(1/tokenize + 1/batch)
and compares end-to-end with the 1B model's consumption at 50% MFU of an H100
(0.5 * 989 TFLOP/s bf16 / model.flops.flops_per_token); it must be >= 5x.

Run:  python scripts/bench_data.py [--config configs/tiny.py] [--seq-len 2048] [--batch 8]
          [--vocab 32000] [--batches 200] [--json bench_out/data.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from configs.loading import load  # noqa: E402
from errors import ConfigFileError  # noqa: E402
from parallel.host_devices import simulate_for_mesh  # noqa: E402

H100_BF16_PEAK = 989e12
MFU = 0.5
REQUIRED_RATIO = 5.0


def llama_1b_model():
    """configs/llama_1b.py's model, or the same sizes built here when that file is absent."""
    path = os.path.join(ROOT, "configs", "llama_1b.py")
    if os.path.exists(path):
        return load(path).model, "configs/llama_1b.py"
    from configs import base
    m = base.get_config().model
    m.update(vocab_size=32000, d_model=2048, num_layers=22, num_heads=16, num_kv_heads=16,
             ffn_dim=5504)
    return m, "inline 1B (22 layers, d 2048, ffn 5504, 16 heads, vocab 32000)"


def make_mesh(config):
    import jax
    import numpy as np
    from jax.sharding import Mesh
    axes = ("data", "fsdp", "sequence", "tensor")
    sizes = [int(config.mesh[a]) for a in axes]
    known = int(np.prod([s for s in sizes if s != -1]))
    sizes = [jax.device_count() // known if s == -1 else s for s in sizes]
    n = int(np.prod(sizes))
    return Mesh(np.array(jax.devices()[:n]).reshape(sizes), axes)


def rate(tokens: int, seconds: float) -> float:
    return tokens / max(seconds, 1e-9)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny.py")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=0, help="BPE size (default: the config's)")
    ap.add_argument("--max-docs", type=int, default=-1, help="default: the config's")
    ap.add_argument("--batches", type=int, default=200, help="batches timed per stage")
    ap.add_argument("--cache-dir", default="", help="default: a fresh temporary dir (cold start)")
    ap.add_argument("--json", default="", help="also write the results here")
    args = ap.parse_args(argv)
    try:
        config = load(args.config)
    except ConfigFileError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    simulate_for_mesh(config.mesh)  # before jax is imported (the mesh places the batches)

    from data.pipeline import make_pipeline
    from data import sources, tokens as tokens_lib
    from model.flops import flops_per_token

    config.data.update(seq_len=args.seq_len, batch_size=args.batch)
    if args.vocab:
        config.model.vocab_size = args.vocab
    if args.max_docs >= 0:
        config.data.max_docs = args.max_docs
    tmp = tempfile.TemporaryDirectory(prefix="bench_data_")
    config.data.cache_dir = args.cache_dir or tmp.name
    mesh = make_mesh(config)
    tokens_per_batch = args.batch * args.seq_len

    t = time.perf_counter()
    pipe = make_pipeline(config, mesh)
    setup_s = time.perf_counter() - t

    # Tokenize again into a scratch dir, timed alone (make_pipeline also trained the BPE).
    scratch = tempfile.mkdtemp(dir=tmp.name)
    t = time.perf_counter()
    corpus = tokens_lib.tokenize(sources.documents(pipe.source, int(config.data.max_docs)),
                                 pipe.tokenizer, scratch, pipe.source.description)
    tokenize_s = time.perf_counter() - t
    n_tok = int(corpus.offsets[-1])
    n_bytes = sum(len(d.encode()) for d in sources.documents(pipe.source, int(config.data.max_docs)))

    def timed(fn):
        fn(0)  # warm-up: first pass packing, compile-free device placement paths
        t = time.perf_counter()
        for i in range(args.batches):
            out = fn((i + 1) * args.batch)
        if isinstance(out, dict):
            for v in out.values():
                getattr(v, "block_until_ready", lambda: None)()
        return rate(args.batches * tokens_per_batch, time.perf_counter() - t)

    pack = timed(lambda row: pipe.host_batch(row))
    batch = timed(lambda row: pipe.device_batch(row))
    next(pipe.train)
    t = time.perf_counter()
    for _ in range(args.batches):
        out = next(pipe.train)
    for v in out.values():
        v.block_until_ready()
    iterator = rate(args.batches * tokens_per_batch, time.perf_counter() - t)
    pipe.train.close()

    tokenize = rate(n_tok, tokenize_s)
    end_to_end = 1.0 / (1.0 / tokenize + 1.0 / batch)
    model, model_name = llama_1b_model()
    fpt = flops_per_token(model, args.seq_len)
    consumption = MFU * H100_BF16_PEAK / fpt
    result = {
        "config": args.config, "seq_len": args.seq_len, "batch": args.batch,
        "vocab": int(config.model.vocab_size), "source": pipe.source.description,
        "documents": int(corpus.num_docs), "corpus_tokens": n_tok, "corpus_bytes": n_bytes,
        "setup_s": setup_s, "tokenize_s": tokenize_s, "cpu_cores": os.cpu_count(),
        "tokens_per_s": {"tokenize": tokenize, "pack": pack, "batch": batch, "iterator": iterator,
                         "end_to_end": end_to_end},
        "model": model_name, "flops_per_token": fpt,
        "h100_consumption_tokens_per_s": consumption,
        "ratio_end_to_end": end_to_end / consumption, "ratio_cached": iterator / consumption,
        "required_ratio": REQUIRED_RATIO,
    }
    print_table(result)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    tmp.cleanup()
    return result


def print_table(r: dict) -> None:
    print(f"data pipeline on {r['cpu_cores']} CPU cores: {r['source']}")
    print(f"  {r['documents']} documents, {r['corpus_tokens']:,} tokens "
          f"({r['corpus_bytes'] / max(r['corpus_tokens'], 1):.2f} bytes/token, vocab {r['vocab']}), "
          f"rows {r['batch']} x {r['seq_len']}; setup (BPE training + tokenize) {r['setup_s']:.1f} s")
    print(f"  {'stage':<34}{'tokens/s':>14}")
    names = {"tokenize": "tokenize (read + encode, cold)", "pack": "pack + permute (host)",
             "batch": "pack + permute + place on mesh", "iterator": "iterator with prefetch (cached)",
             "end_to_end": "end-to-end cold (tokenize + batch)"}
    for key, name in names.items():
        print(f"  {name:<34}{r['tokens_per_s'][key]:>14,.0f}")
    print(f"  1B consumption on one H100 at {MFU:.0%} MFU ({r['model']}, seq_len {r['seq_len']}, "
          f"{r['flops_per_token'] / 1e9:.2f} GFLOP/token): {r['h100_consumption_tokens_per_s']:,.0f} tokens/s")
    ok = "OK" if r["ratio_end_to_end"] >= r["required_ratio"] else "TOO SLOW"
    print(f"  ratio end-to-end / consumption: {r['ratio_end_to_end']:.1f}x "
          f"(cached: {r['ratio_cached']:.1f}x; required >= {r['required_ratio']:.0f}x) {ok}")


if __name__ == "__main__":
    main()
