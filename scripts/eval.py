"""Held-out loss and perplexity of a trained run, and loss by position: does it use long context?

    python scripts/eval.py --run runs/demo [--batches 8] [--buckets 8] [--step N] [--out DIR]
        [--config.FIELD=VALUE ...]

Evaluates the newest complete checkpoint on the run's held-out documents (never trained on).
Each token's loss is bucketed by its position in its document, i.e. how many tokens of context
it had: a model that uses long context has lower loss in later buckets. Writes a table to
stdout, and ``eval.json`` and ``loss_by_position.png`` to --out (default RUN/eval).

Uses the run's own mesh, attention and layout when this machine has the devices for them
(batches then arrive in layout order and are put back in natural order by the layout's
permutation); otherwise one device, dense attention, contiguous layout: the loss is the same.
On a CPU it simulates the run's devices as train.py does (parallel/host_devices.py), unless
XLA_FLAGS already sets a device count.

``--config.FIELD=VALUE`` changes the run's config for this evaluation only (the weights are the
checkpoint's): a longer ``data.seq_len`` with a RoPE scaling (``model.rope_scaling.type=yarn``,
``...factor=2``, ``...original_max_len=8192``) evaluates a context extension without training,
``data.min_doc_tokens`` keeps the long documents, and ``mesh.*`` / ``data.batch_size`` spread a
long row over the sequence axis. For example, SmolLM2-135M (trained at 8k) at 16k with YaRN x2:

    python scripts/eval.py --run runs/smollm2 --batches 4 --buckets 8 --out runs/smollm2/eval_16k_yarn \
        --config.data.seq_len=16384 --config.data.batch_size=1 --config.data.min_doc_tokens=16384 \
        --config.data.heldout_fraction=0.5 --config.mesh.fsdp=1 --config.mesh.sequence=8 \
        --config.model.rope_scaling.type=yarn --config.model.rope_scaling.factor=2 \
        --config.model.rope_scaling.original_max_len=8192
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", required=True, help="run directory (train.py --workdir)")
    p.add_argument("--batches", type=int, default=8, help="held-out batches of the run's shape")
    p.add_argument("--buckets", type=int, default=8, help="position buckets over seq_len")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    p.add_argument("--out", default=None, help="where eval.json and the plot go (default RUN/eval)")
    args, rest = p.parse_known_args(argv)
    args.overrides = []
    for item in rest:
        if not item.startswith("--config."):
            p.error(f"unrecognized argument {item}")
        args.overrides.append(item[len("--config."):])
    return args


def with_overrides(run, overrides):
    """The run with its config changed by ``FIELD=VALUE`` overrides (one line for a bad one)."""
    import dataclasses

    from configs.loading import set_field
    from errors import ConfigError
    from model import rope
    if not overrides:
        return run
    config = run.config.copy_and_resolve_references()
    for item in overrides:
        dotted, eq, text = item.partition("=")
        if not eq:
            raise ConfigError(f"--config.{item} is not --config.FIELD=VALUE")
        set_field(config, dotted, text)
    problem = rope.check(rope.from_config(config.model))
    if problem:
        raise ConfigError(f"model.{problem}")
    return dataclasses.replace(run, config=config)


def context_lengths(segment_ids_BL):
    """Tokens of the same document before each token, from natural-order segment ids."""
    import numpy as np
    B, L = segment_ids_BL.shape
    idx = np.broadcast_to(np.arange(L), (B, L))
    starts = np.ones((B, L), bool)
    starts[:, 1:] = segment_ids_BL[:, 1:] != segment_ids_BL[:, :-1]
    start_idx = np.maximum.accumulate(np.where(starts, idx, 0), axis=1)
    return idx - start_idx


def bucketize(loss_BL, mask_BL, context_BL, seq_len: int, buckets: int) -> list[dict]:
    import numpy as np
    edges = np.linspace(0, seq_len, buckets + 1).round().astype(int)
    rows = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        sel = (context_BL >= lo) & (context_BL < hi)
        n = float(mask_BL[sel].sum())
        loss = float(loss_BL[sel].sum() / n) if n else None
        rows.append({"start": int(lo), "end": int(hi), "tokens": int(n), "loss": loss,
                     "ppl": math.exp(min(loss, 50.0)) if loss is not None else None})
    return rows


def plot(rows: list[dict], result: dict, path: pathlib.Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    xs = [(r["start"] + r["end"]) / 2 for r in rows if r["loss"] is not None]
    ys = [r["loss"] for r in rows if r["loss"] is not None]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, ys, marker="o")
    ax.axhline(result["loss"], color="gray", linestyle="--", linewidth=1,
               label=f"all tokens: {result['loss']:.3f}")
    ax.set_xlabel("position in document (tokens of context)")
    ax.set_ylabel("held-out loss (nats/token)")
    ax.set_title(f"{pathlib.Path(result['run']).name}, step {result['step']}: loss by position")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(rows: list[dict], result: dict) -> str:
    lines = [f"run {result['run']}, step {result['step']}: held-out loss {result['loss']:.4f}, "
             f"perplexity {result['ppl']:.2f} over {result['tokens']} tokens "
             f"({result['batches']} batches)",
             f"{'positions':>13} {'tokens':>9} {'loss':>8} {'ppl':>10}"]
    for r in rows:
        span = f"{r['start']}-{r['end'] - 1}"
        if r["loss"] is None:
            lines.append(f"{span:>13} {0:>9} {'-':>8} {'-':>10}")
        else:
            lines.append(f"{span:>13} {r['tokens']:>9} {r['loss']:>8.4f} {r['ppl']:>10.2f}")
    return "\n".join(lines)


def evaluate(run, args, log) -> dict:
    import jax
    import numpy as np

    from data.pipeline import from_layout, make_pipeline
    from evaluation.setup import eval_setup
    from training.state import Trainer
    config, mesh = eval_setup(run.config, log)
    pipe = make_pipeline(config, mesh)
    if pipe.fingerprint != run.fingerprint:
        from errors import CheckpointError
        raise CheckpointError(f"the data pipeline now gives tokenizer {pipe.fingerprint}, but "
                              f"{run.directory} was trained with {run.fingerprint}")
    try:
        trainer = Trainer(config, mesh)
        got = run.restore_params(trainer.abstract_state.params, step=args.step)
        per_token = jax.jit(trainer.token_losses,
                            in_shardings=(trainer.param_shardings, trainer.batch_shardings))
        a = config.attention
        losses, masks, contexts = [], [], []
        for batch in pipe.heldout_batches(args.batches):
            got_BL = {"loss": per_token(got.params, batch), "mask": batch["loss_mask"],
                      "segments": batch["segment_ids"]}
            nat = from_layout(jax.device_get(got_BL), a.layout, int(mesh.shape["sequence"]),
                              int(a.stripe))
            losses.append(nat["loss"])
            masks.append(nat["mask"])
            contexts.append(context_lengths(nat["segments"]))
    finally:
        pipe.close()
    loss_BL, mask_BL = np.concatenate(losses), np.concatenate(masks)
    tokens = float(mask_BL.sum())
    mean = float(loss_BL.sum() / max(tokens, 1.0))
    result = {"run": str(run.directory), "step": got.step, "checkpoint": str(got.path),
              "batches": args.batches, "tokens": int(tokens), "loss": mean,
              "ppl": math.exp(min(mean, 50.0)),
              "layout": config.attention.layout, "attention": config.attention.impl,
              "mesh": {k: int(v) for k, v in mesh.shape.items()},
              "bucketed_by": "position in document (tokens of context before the token)"}
    result["buckets"] = bucketize(loss_BL, mask_BL, np.concatenate(contexts),
                                  int(config.data.seq_len), args.buckets)
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    from parallel.cluster import one_process_or_exit
    from parallel.host_devices import simulate_for_run
    from training.entry import script_main, stderr
    one_process_or_exit("scripts/eval.py")
    simulate_for_run(args.run, say=stderr, overrides=args.overrides)  # before jax starts

    def run_eval() -> int:
        from checkpoints.rundir import open_run
        from errors import CheckpointError
        if args.batches < 1 or args.buckets < 1:
            raise CheckpointError(f"--batches={args.batches} and --buckets={args.buckets} must "
                                  f"be >= 1")
        run = with_overrides(open_run(args.run, log=stderr), args.overrides)
        result = evaluate(run, args, stderr)
        result["overrides"] = args.overrides
        out = pathlib.Path(args.out) if args.out else run.directory / "eval"
        out.mkdir(parents=True, exist_ok=True)
        (out / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
        plot(result["buckets"], result, out / "loss_by_position.png")
        print(table(result["buckets"], result))
        print(f"wrote {out / 'eval.json'} and {out / 'loss_by_position.png'}")
        return 0

    return script_main(run_eval)

if __name__ == "__main__":
    sys.exit(main())
