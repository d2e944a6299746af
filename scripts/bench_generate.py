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

With ``--run RUN --against transformers`` it measures a run directory (a trained or imported
model) against transformers on the same machine instead, in this one process, on one device
with the same threads, on the same real text (the standard library's sources): the prefill of
a ``--prompt``-token prompt (tokens/s), greedy decode (ms a token: (the time for ``--new``
tokens - the time for 1) / (``--new`` - 1)) after prompts of ``--short`` and ``--prompt``
tokens, our KV cache against ``model.generate``; and log-likelihoods (requests/s) of
``--requests`` requests of about ``--request-tokens`` tokens, ``--batch`` rows a pass, our
lm_eval model (evaluation/harness.StripedJaxLM) against lm_eval's ``HFLM``. It checks the
greedy tokens and log-likelihoods agree, and reports the share of our scored tokens that is
padding. transformers gets the run exported to float32 (hf/convert.export_hf).

Run:  python scripts/bench_generate.py --run runs/smollm2 --against transformers [--repeats 3]
          [--json bench_out/generate_vs_transformers.json]
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


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/tiny.py")
    p.add_argument("--prompt", type=int, default=None,
                   help="prompt tokens (default 2048; 2000 with --run)")
    p.add_argument("--new", type=int, default=None,
                   help="new tokens (default 64; 33 with --run)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--run", default=None, help="a run directory to measure against --against")
    p.add_argument("--against", default=None, choices=["transformers"],
                   help="with --run: the tool measured beside it")
    p.add_argument("--short", type=int, default=200, help="with --run: the short prompt")
    p.add_argument("--requests", type=int, default=16, help="with --run: log-likelihood requests")
    p.add_argument("--request-tokens", type=int, default=1000,
                   help="with --run: about this many tokens a request")
    p.add_argument("--batch", type=int, default=4, help="with --run: rows a scoring pass")
    args = p.parse_args(argv)
    if (args.run is None) != (args.against is None):
        p.error("--run and --against go together")
    with_run = args.run is not None
    args.prompt = args.prompt or (2000 if with_run else 2048)
    args.new = args.new or (33 if with_run else 64)
    if args.new < 2:
        p.error("--new must be at least 2 (a decode time is the time past the first token)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.run is not None:
        simulate_cpu_devices(1)  # one device, as transformers has; before jax is imported
        return against_transformers(args)
    simulate_cpu_devices(8)  # before jax is imported
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

    got = timed({"cache": cached, "cache_prefill": prefill_only, "no_cache": uncached},
                args.repeats)
    outputs, times, med = got["outputs"], got["times"], got["median"]
    same = outputs["cache"] == outputs["no_cache"]
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


def real_ids(tokenizer, n: int) -> list[int]:
    """The first ``n`` tokens of the standard library's sources (real text, on every machine),
    read in a fixed order."""
    from data.sources import StdlibSource
    ids: list[int] = []
    for path in sorted(StdlibSource().files()):
        with open(path, encoding="utf-8", errors="replace") as f:
            ids += tokenizer.encode(f.read()).ids
        if len(ids) >= n:
            return ids[:n]
    raise SystemExit(f"the standard library has fewer than {n} tokens")


def timed(fns: dict, repeats: int) -> dict:
    """Median seconds of each call over ``repeats`` rounds, after one untimed call each (its
    compile); the calls of a round run in turns, so a slow spell of the machine hits all."""
    outputs = {name: fn() for name, fn in fns.items()}
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {"outputs": outputs, "times": times,
            "median": {name: statistics.median(t) for name, t in times.items()}}


def against_transformers(args) -> int:
    import tempfile

    import numpy as np
    import torch
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from evaluation.harness import StripedJaxLM
    from hf.convert import export_hf
    quiet = lambda msg: None  # noqa: E731
    ours = StripedJaxLM(run=args.run, batch_size=args.batch, log=quiet)
    with tempfile.TemporaryDirectory(prefix="bench_generate_hf_") as hf_dir:
        export_hf(args.run, hf_dir, dtype="float32", log=quiet)
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        hf_tok = AutoTokenizer.from_pretrained(hf_dir)
    theirs = HFLM(pretrained=model, tokenizer=hf_tok, batch_size=args.batch,
                  max_length=ours.max_length, device="cpu")
    text = real_ids(ours.tok, max(args.prompt, args.requests * args.request_tokens // 2 + 2 *
                                  args.request_tokens))
    gen = ours.generator

    def ours_generate(prompt, new):
        length = ours.buckets(len(prompt))
        return lambda: gen.generate(ours.params, [prompt] * ours.batch_shards, new,
                                    length=length, eos=-1)[0]

    def theirs_generate(prompt, new):
        ids = torch.tensor([prompt])

        @torch.no_grad()
        def run():  # min_new_tokens: never stops early, as ours with eos=-1
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                  min_new_tokens=new, do_sample=False,
                                  pad_token_id=ours.eot_token_id)[0, len(prompt):].tolist()
        return run

    result = {"run": args.run, "against": "transformers", "repeats": args.repeats,
              "threads": {"torch": torch.get_num_threads(), "cpus": os.cpu_count()},
              "decode": {}, "same_tokens": {}}
    for n in sorted({args.short, args.prompt}):
        prompt = text[:n]
        got = timed({"ours_1": ours_generate(prompt, 1), "ours_n": ours_generate(prompt, args.new),
                     "theirs_1": theirs_generate(prompt, 1),
                     "theirs_n": theirs_generate(prompt, args.new)}, args.repeats)
        med = got["median"]
        per = {who: (med[f"{who}_n"] - med[f"{who}_1"]) / (args.new - 1) for who in ("ours", "theirs")}
        result["decode"][n] = {"ms_a_token": {w: 1e3 * v for w, v in per.items()},
                               "ratio": per["ours"] / per["theirs"],
                               "prefill_s": {w: med[f"{w}_1"] for w in ("ours", "theirs")},
                               "times": got["times"]}
        result["same_tokens"][n] = got["outputs"]["ours_n"] == got["outputs"]["theirs_n"]
    top = result["decode"][args.prompt]["prefill_s"]
    result["prefill_tokens_per_s"] = {w: args.prompt / v for w, v in top.items()}
    result["prefill_ratio"] = top["ours"] / top["theirs"]

    rng = np.random.default_rng(args.seed)
    requests = []
    for _ in range(args.requests):  # a context, then a continuation of 1 to 20 tokens
        size = int(args.request_tokens * rng.uniform(0.9, 1.0))
        start, cont = int(rng.integers(0, len(text) - size)), int(rng.integers(1, 21))
        whole = text[start:start + size]
        requests.append((None, whole[:-cont], whole[-cont:]))
    ours.scorer.tokens_real = ours.scorer.tokens_run = 0
    got = timed({"ours": lambda: ours._loglikelihood_tokens(requests, True),
                 "theirs": lambda: theirs._loglikelihood_tokens(requests, True)}, args.repeats)
    med = got["median"]
    gap = max(abs(a[0] - b[0]) for a, b in zip(got["outputs"]["ours"], got["outputs"]["theirs"]))
    result["loglikelihood"] = {
        "requests_per_s": {w: args.requests / v for w, v in med.items()},
        "ratio": med["ours"] / med["theirs"], "times": got["times"],
        "largest_difference": gap,
        "same_greedy": [a[1] for a in got["outputs"]["ours"]] == [b[1] for b in
                                                                  got["outputs"]["theirs"]],
        "padding_share": 1 - ours.scorer.tokens_real / max(ours.scorer.tokens_run, 1)}

    print(f"{args.run} against transformers {__import__('transformers').__version__}: one "
          f"process, one device, {os.cpu_count()} CPUs (torch threads "
          f"{torch.get_num_threads()}); greedy; medians of {args.repeats} after a warm-up")
    print(f"{'':38s}{'ours':>12s}{'transformers':>14s}{'ratio':>8s}")
    t = result["prefill_tokens_per_s"]
    print(f"{f'prefill, {args.prompt} tokens (tokens/s)':38s}{t['ours']:12.0f}{t['theirs']:14.0f}"
          f"{result['prefill_ratio']:7.2f}x")
    for n, d in result["decode"].items():
        ms = d["ms_a_token"]
        print(f"{f'decode after {n} tokens (ms a token)':38s}{ms['ours']:12.1f}"
              f"{ms['theirs']:14.1f}{d['ratio']:7.2f}x")
    ll = result["loglikelihood"]
    label = f"log-likelihood, {args.requests} x ~{args.request_tokens} (req/s)"
    print(f"{label:38s}{ll['requests_per_s']['ours']:12.2f}{ll['requests_per_s']['theirs']:14.2f}"
          f"{ll['ratio']:7.2f}x")
    print("ratio: our time over transformers' (below 1: faster)")
    print(f"the same greedy tokens: {result['same_tokens']}; log-likelihoods within "
          f"{gap:.2g} nats, the same greedy flags: {ll['same_greedy']}; padding "
          f"{100 * ll['padding_share']:.1f}% of our scored tokens")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    same = all(result["same_tokens"].values()) and ll["same_greedy"]
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
