"""Passkey retrieval accuracy of a trained run, by prompt length and needle depth.

    python scripts/eval_passkey.py --run RUN_DIR --lengths 256,512 --depths 0,0.25,0.5,0.75,1
        [--trials 5] [--json F] [--png F] [--step N] [--seed 0]

Each prompt (data/passkey.py) is filler text with "The pass key is 71432. Remember it. 71432
is the pass key." at the given depth, then "What is the pass key? The pass key is" and the
answer " 71432". A length is the number of tokens of the run's tokenizer in the whole row,
answer included. Scoring is one forward pass per row with the answer teacher-forced: a trial
is correct iff every answer token is the model's argmax at the token before it. Also reported:
the mean next-token loss over the prompt (the answer excluded) at each length.

Rows run through the run's own mesh, attention and layout when this machine has the devices
(evaluation/setup.py; else one device, dense; on a CPU the script simulates the run's
devices, as train.py does, unless XLA_FLAGS sets a count): each row is permuted into the layout's
order with its true positions, so a length must be one the layout can split (a multiple of
the sequence axis, or of 2x it for zigzag, and of the attention tiles); other lengths stop
with one line listing valid ones. Trials are rows of a batch: up to the run's
data.batch_size rows per pass, a multiple of the data x fsdp axes.

Prints a length x depth table; writes JSON (--json, default RUN/eval/passkey.json) and a
heatmap (--png, default RUN/eval/passkey.png).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEPTHS = "0,0.25,0.5,0.75,1"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run", required=True, help="run directory (train.py --workdir)")
    p.add_argument("--lengths", default="", help="comma list of row lengths in tokens "
                   "(default: the run's data.seq_len)")
    p.add_argument("--depths", default=DEPTHS, help="comma list of needle depths in [0, 1]")
    p.add_argument("--trials", type=int, default=5, help="random pass keys per cell")
    p.add_argument("--seed", type=int, default=0, help="seed of the pass keys")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    p.add_argument("--json", default=None, help="results file (default RUN/eval/passkey.json)")
    p.add_argument("--png", default=None, help="heatmap (default RUN/eval/passkey.png)")
    return p.parse_args(argv)


def parse_list(text: str, kind, flag: str) -> list:
    from errors import ConfigError
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"{flag}={text!r}: expected a comma list of "
                          f"{'integers' if kind is int else 'numbers'}") from None
    if not values:
        raise ConfigError(f"{flag} is empty")
    return values


def check_lengths(config, mesh, lengths: list[int], shortest: int) -> None:
    """One line naming the first bad length and the valid lengths around it."""
    from errors import ConfigError
    from evaluation.lengths import length_problem, nearby_valid, unit
    a = config.attention
    where = (f"the {a.layout} layout over {int(mesh.shape['sequence'])} sequence shards "
             f"({a.impl} attention)")
    for length in lengths:
        if length < shortest:
            raise ConfigError(f"--lengths: {length} is shorter than the needle, question and "
                              f"answer ({shortest} tokens); use lengths >= {shortest}")
        why = length_problem(config, mesh, length)
        if why is None:
            continue
        step = unit(config, mesh)
        below = nearby_valid(config, mesh, length, shortest, -step)
        above = nearby_valid(config, mesh, length, shortest, step)
        raise ConfigError(f"--lengths: {length} cannot run on {where}: {why}; valid lengths "
                          f"near it: {', '.join(map(str, below + above)) or 'none'}")


class Scorer:
    """One forward pass over a batch of passkey rows on ``mesh``: per-row prompt loss and the
    logits at the token before each answer token."""

    def __init__(self, config, mesh):
        from parallel.mesh import batch_shards
        from training.state import Trainer
        self.config, self.mesh = config, mesh
        self.trainer = Trainer(config, mesh)
        self.batch_shards = batch_shards(mesh)
        self._forward = None

    def rows_per_pass(self, wanted: int) -> int:
        """At most the run's batch (what fits its memory at its seq_len), a multiple of the
        batch shards."""
        rows = min(wanted, int(self.config.data.batch_size))
        return -(-rows // self.batch_shards) * self.batch_shards

    def forward(self):
        if self._forward is None:
            import jax
            import jax.numpy as jnp
            from flax import nnx

            from model.loss import chunked_token_losses
            trainer, chunk, mesh = self.trainer, int(self.config.train.loss_chunk), self.mesh

            def forward(params, batch, slots_BA):
                model = nnx.merge(trainer.graphdef, params)
                x_BLD = model.hidden(batch["tokens"], batch["positions"], batch["segment_ids"])
                loss_BL = chunked_token_losses(
                    x_BLD, batch["labels"], batch["loss_mask"], **model.head_args(),
                    chunk=chunk, mesh=mesh, compute_dtype=model.dtype)
                # Only the answer's predecessors need the head: [B, A, V], never [B, L, V].
                x_BAD = jnp.take_along_axis(x_BLD, slots_BA[..., None], axis=1)
                logits_BAV = model.cap(jnp.einsum("bad,dv->bav", model.final_norm(x_BAD),
                                                  model.head_DV().astype(model.dtype),
                                                  preferred_element_type=jnp.float32))
                return loss_BL.sum(axis=1), logits_BAV

            self._forward = jax.jit(forward, in_shardings=(trainer.param_shardings,
                                                           trainer.batch_shardings, None))
        return self._forward

    def __call__(self, params, examples: list, usable_vocab: int) -> dict:
        """Per example: ``loss`` (mean over the prompt's next-token predictions), ``logits``
        [A, V] at the answer tokens' predecessors, ``token_correct`` [A] and ``correct``."""
        import jax
        import numpy as np

        from data.pipeline import to_layout
        from parallel.layouts import inverse, permutation
        L = len(examples[0].tokens)
        a = self.config.attention
        shards = int(self.mesh.shape["sequence"])
        slot_of = inverse(permutation(a.layout, L, shards, int(a.stripe)))
        rows = self.rows_per_pass(len(examples))
        A = max(L - e.answer_start for e in examples)
        out = []
        for first in range(0, len(examples), rows):
            chunk = examples[first:first + rows]
            padded = chunk + [chunk[-1]] * (rows - len(chunk))  # filler rows, dropped below
            tokens_BL = np.stack([e.tokens for e in padded])
            labels_BL = np.zeros_like(tokens_BL)
            labels_BL[:, :-1] = tokens_BL[:, 1:]
            mask_BL = np.zeros(tokens_BL.shape, np.float32)
            predecessors_BA = np.zeros((rows, A), np.int64)
            for i, e in enumerate(padded):
                mask_BL[i, :e.answer_start - 1] = 1.0  # targets 1 .. answer_start-1: the prompt
                answer = np.arange(e.answer_start - 1, L - 1)
                predecessors_BA[i, :answer.size] = answer
            natural = {"tokens": tokens_BL, "labels": labels_BL, "loss_mask": mask_BL,
                       "positions": np.broadcast_to(np.arange(L, dtype=np.int32), (rows, L)),
                       "segment_ids": np.ones((rows, L), np.int32)}
            batch = {k: jax.device_put(v, self.trainer.batch_shardings[k])
                     for k, v in to_layout(natural, a.layout, shards, int(a.stripe)).items()}
            loss_sum_B, logits_BAV = jax.device_get(self.forward()(
                params, batch, slot_of[predecessors_BA].astype(np.int32)))
            for i, e in enumerate(chunk):
                n = L - e.answer_start
                logits_AV = logits_BAV[i, :n]
                predicted = logits_AV[:, :usable_vocab].argmax(-1)
                token_correct = predicted == e.tokens[e.answer_start:]
                out.append({"loss": float(loss_sum_B[i] / mask_BL[i].sum()), "logits": logits_AV,
                            "predicted": predicted, "token_correct": token_correct,
                            "correct": bool(token_correct.all())})
        return out


def evaluate(run, lengths, depths, trials: int, seed: int, step, log) -> dict:
    import numpy as np

    from data import passkey
    from evaluation.setup import eval_setup
    config, mesh = eval_setup(run.config, log)
    rng = np.random.default_rng(seed)
    tok = run.tokenizer
    shortest = max(passkey.fixed_tokens(tok, passkey.random_key(rng)) for _ in range(20))
    check_lengths(config, mesh, lengths, shortest)
    scorer = Scorer(config, mesh)
    got = run.restore_params(scorer.trainer.abstract_state.params, step=step)
    vocab = tok.get_vocab_size()
    grid, token_grid, losses = [], [], []
    for length in lengths:
        cells = [(d, passkey.build(tok, length, d, passkey.random_key(rng)))
                 for d in depths for _ in range(trials)]
        scores = scorer(got.params, [e for _, e in cells], vocab)
        grid.append([float(np.mean([s["correct"] for (d, _), s in zip(cells, scores) if d == depth]))
                     for depth in depths])
        token_grid.append([float(np.mean(np.concatenate(
            [s["token_correct"] for (d, _), s in zip(cells, scores) if d == depth])))
            for depth in depths])
        losses.append(float(np.mean([s["loss"] for s in scores])))
        log(f"length {length}: accuracy {np.mean(grid[-1]):.2f}, prompt loss {losses[-1]:.4f}")
    return {"run": str(run.directory), "step": got.step, "checkpoint": str(got.path),
            "lengths": lengths, "depths": depths, "trials": trials, "seed": seed,
            "accuracy": grid, "answer_token_accuracy": token_grid, "loss": losses,
            "rows_per_pass": scorer.rows_per_pass(len(depths) * trials),
            "layout": config.attention.layout, "attention": config.attention.impl,
            "mesh": {k: int(v) for k, v in mesh.shape.items()},
            "rope_theta": float(config.model.rope_theta),
            "trained_seq_len": int(run.config.data.seq_len)}


def table(result: dict) -> str:
    depths = result["depths"]
    lines = [f"run {result['run']}, step {result['step']}: passkey accuracy, {result['trials']} "
             f"trials per cell ({result['attention']} attention, {result['layout']} layout, "
             f"mesh {' '.join(f'{k}={v}' for k, v in result['mesh'].items())})",
             f"{'length':>8} | " + " ".join(f"{d:>6.2f}" for d in depths) +
             f" | {'mean':>5} | {'loss':>7}"]
    for length, row, loss in zip(result["lengths"], result["accuracy"], result["loss"]):
        lines.append(f"{length:>8} | " + " ".join(f"{v:>6.2f}" for v in row) +
                     f" | {sum(row) / len(row):>5.2f} | {loss:>7.4f}")
    lines.append("(columns: needle depth; loss: mean next-token loss over the prompt)")
    return "\n".join(lines)


def heatmap(result: dict, path: pathlib.Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    grid = np.asarray(result["accuracy"])
    fig, ax = plt.subplots(figsize=(1.2 * len(result["depths"]) + 2.5,
                                    0.5 * len(result["lengths"]) + 1.8))
    im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(result["depths"])), [f"{d:g}" for d in result["depths"]])
    ax.set_yticks(range(len(result["lengths"])), [str(n) for n in result["lengths"]])
    for (i, j), v in np.ndenumerate(grid):
        ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=9)
    ax.set_xlabel("needle depth")
    ax.set_ylabel("length (tokens)")
    ax.set_title(f"{pathlib.Path(result['run']).name}, step {result['step']}: passkey accuracy",
                 fontsize=10)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    from parallel.cluster import one_process_or_exit
    from parallel.host_devices import simulate_for_run
    from training.entry import script_main, stderr
    one_process_or_exit("scripts/eval_passkey.py")
    simulate_for_run(args.run, say=stderr)  # before jax starts

    def run_eval() -> int:
        from checkpoints.rundir import open_run
        from errors import ConfigError
        depths = parse_list(args.depths, float, "--depths")
        if not all(0.0 <= d <= 1.0 for d in depths):
            raise ConfigError(f"--depths={args.depths}: every depth must be in [0, 1]")
        if args.trials < 1:
            raise ConfigError(f"--trials={args.trials} must be >= 1")
        run = open_run(args.run, log=stderr)
        lengths = (parse_list(args.lengths, int, "--lengths") if args.lengths
                   else [int(run.config.data.seq_len)])
        result = evaluate(run, lengths, depths, args.trials, args.seed, args.step, stderr)
        out_json = pathlib.Path(args.json) if args.json else run.directory / "eval" / "passkey.json"
        out_png = pathlib.Path(args.png) if args.png else run.directory / "eval" / "passkey.png"
        for path in (out_json, out_png):
            path.parent.mkdir(parents=True, exist_ok=True)
        out_json.write_text(json.dumps(result, indent=2) + "\n")
        heatmap(result, out_png)
        print(table(result))
        print(f"wrote {out_json} and {out_png}")
        return 0

    return script_main(run_eval)

if __name__ == "__main__":
    sys.exit(main())
