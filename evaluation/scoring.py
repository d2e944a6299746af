"""Log-likelihoods of continuations on the run's mesh: the sum of log p(token | everything
before it) over a row's scored tokens, and whether each scored token is the greedy pick.

Rows run through the run's own attention and layout: each is padded to a length the layout
accepts (evaluation/lengths.Buckets), permuted into layout order with its true positions, and
split over the ``sequence`` axis, so a long row's attention is context parallel. The head and
the log-softmax run over chunks of tokens (model/loss.py): the ``[B, L, V]`` logits never
exist whole. Padding sits after a row's tokens, where the causal mask hides it; it gets
position 0 for RoPE, as generation's padding does.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from parallel.mesh import batch_shards


@dataclasses.dataclass(frozen=True)
class Row:
    """``tokens`` fed to the model and ``target``, the token after the last: the last
    ``scored`` of ``tokens[1:] + (target,)`` are scored, each predicted by the tokens before it
    (their log-likelihoods are summed)."""
    tokens: tuple[int, ...]
    target: int
    scored: int


class Scorer:
    """``(log-likelihood, greedy)`` per row, ``rows_per_pass`` rows at a time (a multiple of
    the data x fsdp axes)."""

    def __init__(self, trainer, usable_vocab: int, buckets, rows_per_pass: int):
        self.trainer, self.mesh, self.config = trainer, trainer.mesh, trainer.config
        self.usable_vocab, self.buckets = int(usable_vocab), buckets
        shards = batch_shards(self.mesh)
        self.rows_per_pass = -(-max(int(rows_per_pass), 1) // shards) * shards

    @functools.cached_property
    def _forward(self):
        from model.loss import chunked_token_losses
        trainer, chunk, vocab = self.trainer, int(self.config.train.loss_chunk), self.usable_vocab
        mesh = self.mesh

        def forward(params, batch):
            model = nnx.merge(trainer.graphdef, params)
            x_BLD = model.hidden(batch["tokens"], batch["positions"], batch["segment_ids"])
            scores_BL2 = chunked_token_losses(
                x_BLD, batch["labels"], batch["loss_mask"], model.final_norm.scale[...],
                model.head_DV(), eps=model.final_norm.eps, chunk=chunk, mesh=mesh,
                compute_dtype=model.dtype, greedy_vocab=vocab)
            scored_BL = batch["loss_mask"] > 0
            loglik_B = -scores_BL2[..., 0].sum(-1)
            greedy_B = jnp.where(scored_BL, scores_BL2[..., 1] > 0, True).all(-1)
            return loglik_B, greedy_B

        return jax.jit(forward, in_shardings=(trainer.param_shardings, trainer.batch_shardings))

    def __call__(self, params, rows: list[Row], progress=None) -> list[tuple[float, bool]]:
        """One ``(log-likelihood, greedy)`` per row, in the given order. Rows are run longest
        first so that a pass holds rows of similar lengths."""
        from data.batching import to_layout
        from evaluation.lengths import pad_rows
        a, S = self.config.attention, int(self.mesh.shape["sequence"])
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i].tokens))
        out: list[tuple[float, bool] | None] = [None] * len(rows)
        for first in range(0, len(order), self.rows_per_pass):
            ids = order[first:first + self.rows_per_pass]
            chunk = [rows[i] for i in ids]
            longest = len(chunk[0].tokens)
            L = self.buckets(longest)
            if L is None:
                from errors import EvalError
                raise EvalError(f"a row of {longest} tokens has no length the layout accepts "
                                f"up to max_length={self.buckets.cap}")
            B = self.rows_per_pass
            # rows past the chunk stay empty: nothing scored
            natural, _ = pad_rows([r.tokens for r in chunk] + [()] * (B - len(chunk)), L)
            labels = np.zeros((B, L), np.int32)
            mask = np.zeros((B, L), np.float32)
            for r, row in enumerate(chunk):
                n = len(row.tokens)
                labels[r, :n] = (*row.tokens[1:], row.target)
                mask[r, n - row.scored:n] = 1.0
            natural.update(labels=labels, loss_mask=mask)
            batch = {k: jax.device_put(v, self.trainer.batch_shardings[k])
                     for k, v in to_layout(natural, a.layout, S, int(a.stripe)).items()}
            loglik_B, greedy_B = jax.device_get(self._forward(params, batch))
            for r, i in enumerate(ids):
                out[i] = (float(loglik_B[r]), bool(greedy_B[r]))
            if progress is not None:
                progress(len(chunk))
        return out
