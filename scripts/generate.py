"""Continue a prompt with a trained run: the newest complete checkpoint's weights, the run's tokenizer.

    python scripts/generate.py --run runs/demo --prompt "def main(" [--max-new-tokens 200]
        [--temperature 0.8 --top-k 40] [--seed 0] [--step N] [--json [FILE]]

Greedy (the likeliest token every time) unless --temperature is given, which samples at that
temperature among the --top-k likeliest tokens (--greedy is still accepted and wins).
--json alone prints exactly one JSON object {"ids": [...], "text": "..."} of the generated
tokens on stdout (everything else goes to stderr); --json FILE prints the text as usual and
writes a fuller record (prompt, its tokens, settings) to FILE.

Runs on one device with dense attention in the contiguous layout, whatever mesh and layout the
run trained with: the parameters depend on neither. Each token recomputes the whole window (no
KV cache) in a fixed buffer, so one compiled program serves every token. The buffer is the
smallest multiple of 64 that holds the prompt and the new tokens, capped at the run's
data.seq_len: a short prompt to an imported model trained at 128k tokens then costs a few
hundred slots per token, not 128k, and at most the length the run trained at, past which
its RoPE was never trained (a window that fills up slides left by one token). Slots past the
current length n get position 0, so the largest position in the pass is n - 1, as it is for
an unpadded prompt (a dynamic RoPE scaling reads it); causal masking by slot keeps them unseen.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", required=True, help="run directory (train.py --workdir)")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=None,
                   help="sample at this temperature (default: greedy)")
    p.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest (0: all)")
    p.add_argument("--greedy", action="store_true",
                   help="always the likeliest token (the default without --temperature)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    p.add_argument("--json", nargs="?", const="-", default=None,
                   help="alone: print only {ids, text} as JSON on stdout; with FILE: also "
                        "write prompt, tokens and text there")
    args = p.parse_args(argv)
    args.greedy = args.greedy or args.temperature is None
    return args


def check_args(args):
    from errors import CheckpointError
    if args.max_new_tokens < 1:
        raise CheckpointError(f"--max-new-tokens={args.max_new_tokens} must be >= 1")
    if args.temperature is not None and args.temperature <= 0:
        raise CheckpointError(f"--temperature={args.temperature} must be > 0 (leave it out "
                              f"for greedy decoding)")
    if args.top_k < 0:
        raise CheckpointError(f"--top-k={args.top_k} must be >= 0 (0 samples among all tokens)")


def make_step(graphdef, window: int, usable_vocab: int, greedy: bool, temperature: float,
              top_k: int):
    """step(params, buf [window], n, key) -> (buf, n + 1, token): appends one sampled token."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    slots = jnp.arange(window, dtype=jnp.int32)
    segments = jnp.ones((1, window), jnp.int32)

    @jax.jit
    def step(params, buf, n, key):
        full = n >= window
        buf = jnp.where(full, jnp.roll(buf, -1), buf)
        n = jnp.where(full, window - 1, n)
        positions = jnp.where(slots < n, slots, 0)[None]
        logits = nnx.merge(graphdef, params)(buf[None], positions, segments)[0, n - 1]
        # Embedding rows past the tokenizer's vocabulary were never trained on: never pick them.
        logits = jnp.where(jnp.arange(logits.shape[-1]) < usable_vocab, logits, -jnp.inf)
        if greedy:
            token = jnp.argmax(logits)
        else:
            logits = logits / temperature
            if top_k:
                kth = jax.lax.top_k(logits, min(top_k, usable_vocab))[0][-1]
                logits = jnp.where(logits < kth, -jnp.inf, logits)
            token = jax.random.categorical(key, logits)
        token = token.astype(buf.dtype)
        return buf.at[n].set(token), n + 1, token

    return step


def window_size(prompt_len: int, max_new_tokens: int, seq_len: int) -> int:
    """The smallest multiple of 64 holding prompt and new tokens, at most the run's seq_len."""
    return min(seq_len, -(-(prompt_len + max_new_tokens) // 64) * 64)


def generate(run, params, graphdef, prompt: str, args) -> list[int]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from data.tokenizer import eos_id
    ids = run.tokenizer.encode(prompt).ids
    window = window_size(max(len(ids), 1), args.max_new_tokens, int(run.config.data.seq_len))
    if not ids:
        ids = [eos_id(run.tokenizer)]  # an empty prompt starts a new document
    ids = ids[-window:]
    buf = np.zeros(window, np.int32)
    buf[:len(ids)] = ids
    step = make_step(graphdef, window, run.tokenizer.get_vocab_size(), args.greedy,
                     args.temperature, args.top_k)
    buf, n, key = jnp.asarray(buf), jnp.int32(len(ids)), jax.random.key(args.seed)
    eos, out = eos_id(run.tokenizer), []
    for _ in range(args.max_new_tokens):
        key, sub = jax.random.split(key)
        buf, n, token = step(params, buf, n, sub)
        token = int(token)
        if token == eos:
            break
        out.append(token)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    from parallel.cluster import one_process_or_exit
    from training.entry import script_main, stderr
    one_process_or_exit("scripts/generate.py")

    def run_generate() -> int:
        from checkpoints.rundir import open_run
        from model.decoder import single_device_model
        check_args(args)
        run = open_run(args.run)
        graphdef, abstract = single_device_model(run.config)
        got = run.restore_params(abstract, step=args.step)
        mode = ("greedy" if args.greedy else
                f"temperature {args.temperature}, top-k {args.top_k or 'all'}, seed {args.seed}")
        stderr(f"{run.directory}: step {got.step} ({got.path}); {mode}")
        t0 = time.perf_counter()
        tokens = generate(run, got.params, graphdef, args.prompt, args)
        text = run.tokenizer.decode(tokens)
        if args.json == "-":
            print(json.dumps({"ids": tokens, "text": text}))
        else:
            print(args.prompt + text)
        stderr(f"{len(tokens)} tokens in {time.perf_counter() - t0:.1f}s")
        if args.json and args.json != "-":
            with open(args.json, "w") as f:
                json.dump({"run": str(run.directory), "step": got.step, "prompt": args.prompt,
                           "prompt_tokens": run.tokenizer.encode(args.prompt).ids,
                           "tokens": tokens, "text": text, "greedy": args.greedy,
                           "temperature": args.temperature, "top_k": args.top_k,
                           "seed": args.seed}, f, indent=2)
        return 0

    return script_main(run_generate)

if __name__ == "__main__":
    sys.exit(main())
