"""Continue a prompt with a trained run: the newest complete checkpoint's weights, the run's tokenizer.

    python scripts/generate.py --run runs/demo --prompt "def main(" [--max-new-tokens 200]
        [--temperature 0.8 --top-k 40] [--seed 0] [--step N] [--json [FILE]] [--no-cache]
    python scripts/generate.py --run runs/sft --chat --prompt "What does textwrap.dedent do?"
        [--system "Be brief."]

--chat: the prompt is a user's message: the run's chat template (the one it trained with, or
its tokenizer's; data/chat_template.py) renders it with the generation prompt, and the reply
alone is printed.

Generation ends where transformers' generate would: at any id of an imported model's
generation_config.json eos_token_id (an int or a list: Gemma 3's <end_of_turn> beside <eos>,
Llama 3.1's <|eot_id|>, <|eom_id|> and <|end_of_text|>; without that file, its config.json's),
or at its tokenizer_config.json's eos_token, read from the import's side files (hf/) of the run
or of the runs it started from (checkpoints/rundir.py Run.stop_ids); a run with none of them
ends at its tokenizer's end-of-text. The end token is not printed.

Greedy (the likeliest token every time) unless --temperature is given, which samples at that
temperature among the --top-k likeliest tokens (--greedy is still accepted and wins).
--json alone prints exactly one JSON object {"ids": [...], "text": "..."} of the generated
tokens on stdout (everything else goes to stderr); --json FILE prints the text as usual and
writes a fuller record (prompt, its tokens, settings) to FILE.

Runs on the run's own mesh, attention and layout (on a CPU the script simulates the run's
devices, as train.py does; evaluation/setup.py): the prompt is prefilled once with
context-parallel attention and each new token reads a KV cache sharded over the sequence
axis (evaluation/kv_cache.py). Prompt and new tokens stay within the run's data.seq_len, past
which its RoPE was never trained: a longer prompt keeps its last seq_len - max_new_tokens
tokens, and says so. --no-cache runs the reference instead (evaluation/recompute.py): one
device, every token recomputes the whole window; the same greedy tokens, much slower.
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
    p.add_argument("--no-cache", action="store_true",
                   help="the reference: one device, every token recomputes the window")
    p.add_argument("--chat", action="store_true",
                   help="the prompt is a user's message, rendered with the run's chat template")
    p.add_argument("--system", default=None, help="--chat: a system message first")
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
    if args.system is not None and not args.chat:
        raise CheckpointError("--system is a chat's system message: give --chat too")


def generate(run, trainer, params, ids: list[int], args) -> list[int]:
    """Greedy or sampled tokens after ``ids`` with the KV cache on the trainer's mesh."""
    from evaluation.kv_cache import Generator
    from evaluation.lengths import Buckets
    from parallel.mesh import batch_shards
    config, mesh = trainer.config, trainer.mesh
    seq_len = int(config.data.seq_len)
    gen = Generator(trainer, run.tokenizer.get_vocab_size())
    rows = batch_shards(mesh)  # one prompt in every row
    length = Buckets(config, mesh, seq_len)(len(ids))
    return gen.generate(params, [ids] * rows, args.max_new_tokens, length=length,
                        eos=run.stop_ids, sampling=sampling(args), seed=args.seed, real=1)[0]


def sampling(args):
    from evaluation.kv_cache import Sampling
    return Sampling(greedy=args.greedy, temperature=args.temperature or 1.0, top_k=args.top_k)


def main(argv=None) -> int:
    args = parse_args(argv)
    from parallel.cluster import one_process_or_exit
    from training.entry import script_main, stderr
    one_process_or_exit("scripts/generate.py")
    if not args.no_cache:
        from parallel.host_devices import simulate_for_run
        simulate_for_run(args.run, say=stderr)  # before jax starts

    def run_generate() -> int:
        from checkpoints.rundir import open_run
        check_args(args)
        run = open_run(args.run)
        if args.max_new_tokens >= int(run.config.data.seq_len):
            from errors import CheckpointError
            raise CheckpointError(f"--max-new-tokens={args.max_new_tokens} leaves no room for "
                                  f"a prompt in the run's data.seq_len="
                                  f"{int(run.config.data.seq_len)}; use fewer")
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
                {"role": "user", "content": args.prompt}]
            text = run.chat_template().render(messages, add_generation_prompt=True)
            ids = run.tokenizer.encode(text, add_special_tokens=False).ids
        else:
            ids = run.tokenizer.encode(args.prompt).ids or [run.eos]  # empty: a new document
        keep = int(run.config.data.seq_len) - args.max_new_tokens
        if len(ids) > keep:
            stderr(f"the prompt's {len(ids)} tokens and {args.max_new_tokens} new ones exceed "
                   f"the run's data.seq_len={int(run.config.data.seq_len)}: keeping the "
                   f"prompt's last {keep} tokens")
            ids = ids[-keep:]
        t0 = time.perf_counter()
        if args.no_cache:
            from evaluation import recompute
            from model.decoder import single_device_model
            graphdef, abstract = single_device_model(run.config)
            got = run.restore_params(abstract, step=args.step)
            where = "one device, no cache"
            tokens = recompute.generate(
                graphdef, got.params, ids, args.max_new_tokens,
                seq_len=int(run.config.data.seq_len), usable_vocab=run.tokenizer.get_vocab_size(),
                eos=run.stop_ids, sampling=sampling(args), seed=args.seed)
        else:
            from evaluation.setup import eval_setup
            from training.state import Trainer
            config, mesh = eval_setup(run.config, stderr)
            trainer = Trainer(config, mesh)
            got = run.restore_params(trainer.abstract_state.params, step=args.step)
            where = (f"{config.attention.impl} attention, {config.attention.layout} layout, "
                     f"mesh {'x'.join(str(v) for v in mesh.shape.values())}, KV cache")
            tokens = generate(run, trainer, got.params, ids, args)
        stderr(f"{run.directory}: step {got.step} ({got.path}); {sampling(args).describe()}"
               f"{'' if args.greedy else f', seed {args.seed}'}; {where}")
        text = run.tokenizer.decode(tokens)
        if args.json == "-":
            print(json.dumps({"ids": tokens, "text": text}))
        else:
            print(text if args.chat else args.prompt + text)
        stderr(f"{len(tokens)} tokens in {time.perf_counter() - t0:.1f}s")
        if args.json and args.json != "-":
            with open(args.json, "w") as f:
                json.dump({"run": str(run.directory), "step": got.step, "prompt": args.prompt,
                           "prompt_tokens": ids, "chat": args.chat,
                           "tokens": tokens, "text": text, "greedy": args.greedy,
                           "temperature": args.temperature, "top_k": args.top_k,
                           "seed": args.seed, "cache": not args.no_cache}, f, indent=2)
        return 0

    return script_main(run_generate)

if __name__ == "__main__":
    sys.exit(main())
