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


@dataclasses.dataclass(frozen=True)
class Row:
    """``tokens`` fed to the model; the last ``scored`` of them are predicted by the ones
    before (their log-likelihood is summed) and ``target`` is the token after the last."""
    tokens: tuple[int, ...]
    target: int
    scored: int


class Scorer:
    """``(log-likelihood, greedy)`` per row, ``rows_per_pass`` rows at a time (a multiple of
    the data x fsdp axes)."""

    def __init__(self, trainer, usable_vocab: int, buckets, rows_per_pass: int):
        self.trainer, self.mesh, self.config = trainer, trainer.mesh, trainer.config
        self.usable_vocab, self.buckets = int(usable_vocab), buckets
        shards = int(self.mesh.shape["data"]) * int(self.mesh.shape["fsdp"])
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
        a, S = self.config.attention, int(self.mesh.shape["sequence"])
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i].tokens))
        out: list[tuple[float, bool] | None] = [None] * len(rows)
        for first in range(0, len(order), self.rows_per_pass):
            ids = order[first:first + self.rows_per_pass]
            chunk = [rows[i] for i in ids]
            longest = len(chunk[0].tokens)
            L = self.buckets(longest)
            if L is None:
                raise ValueError(f"a row of {longest} tokens is longer than the longest the "
                                 f"layout accepts here ({self.buckets.cap})")
            B = self.rows_per_pass
            tokens = np.zeros((B, L), np.int32)
            labels = np.zeros((B, L), np.int32)
            mask = np.zeros((B, L), np.float32)
            real = np.zeros((B, L), bool)
            for r, row in enumerate(chunk):  # rows past the chunk stay empty: nothing scored
                n = len(row.tokens)
                tokens[r, :n] = row.tokens
                labels[r, :n - 1] = row.tokens[1:]
                labels[r, n - 1] = row.target
                mask[r, n - row.scored:n] = 1.0
                real[r, :n] = True
            natural_L = np.arange(L, dtype=np.int32)
            natural = {"tokens": tokens, "labels": labels, "loss_mask": mask,
                       "positions": np.where(real, natural_L, 0).astype(np.int32),
                       "segment_ids": np.ones((B, L), np.int32)}
            batch = {k: jax.device_put(v, self.trainer.batch_shardings[k])
                     for k, v in to_layout(natural, a.layout, S, int(a.stripe)).items()}
            loglik_B, greedy_B = jax.device_get(self._forward(params, batch))
            for r, i in enumerate(ids):
                out[i] = (float(loglik_B[r]), bool(greedy_B[r]))
            if progress is not None:
                progress(len(chunk))
        return out
