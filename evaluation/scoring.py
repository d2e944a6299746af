"""Log-likelihoods of continuations on the run's mesh: the sum of log p(token | everything
before it) over a row's scored tokens, and whether each scored token is the greedy pick.

Rows run through the run's own attention and layout: each is padded to a length the layout
accepts (evaluation/lengths.Buckets), permuted into layout order with its true positions, and
split over the ``sequence`` axis, so a long row's attention is context parallel. The head and
the log-softmax run over chunks of tokens (model/loss.py): the ``[B, L, V]`` logits never
exist whole. Padding sits after a row's tokens, where the causal mask hides it; it gets
position 0 for RoPE, as generation's padding does.

A multiple-choice or short-answer request scores a few tokens at the end of a long context.
Where a pass scores at most half its tokens, only those go through the final norm, the head and
the softmax: their hidden states are gathered from the devices that hold them (a ``[B, K, D]``
psum over ``sequence``; K, the most a row scores, rounded up to a power of two). The head of
a small-vocabulary-heavy model (SmolLM2-135M: a fifth of its FLOPs) then costs nothing for the
context. A rolling window scores every token and takes the chunked head over all of them.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

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
    the data x fsdp axes), with the graphdef and shardings of ``sharded`` (the run's
    model.sharded.ShardedModel, or a training.state.Trainer)."""

    def __init__(self, sharded, usable_vocab: int, buckets, rows_per_pass: int):
        self.sharded, self.mesh, self.config = sharded, sharded.mesh, sharded.config
        self.usable_vocab, self.buckets = int(usable_vocab), buckets
        shards = batch_shards(self.mesh)
        self.rows_per_pass = -(-max(int(rows_per_pass), 1) // shards) * shards
        self.tokens_real = self.tokens_run = 0  # the rows' tokens, and the passes' (padding in)

    @functools.cached_property
    def _forward(self):
        from model.loss import chunked_token_losses
        sharded, chunk, vocab = self.sharded, int(self.config.train.loss_chunk), self.usable_vocab
        mesh = self.mesh

        def forward(params, batch):
            model = nnx.merge(sharded.graphdef, params)
            x_BLD = model.hidden(batch["tokens"], batch["positions"], batch["segment_ids"])
            scores_BL2 = chunked_token_losses(
                x_BLD, batch["labels"], batch["loss_mask"], **model.head_args(), chunk=chunk,
                mesh=mesh, compute_dtype=model.dtype, greedy_vocab=vocab)
            scored_BL = batch["loss_mask"] > 0
            loglik_B = -scores_BL2[..., 0].sum(-1)
            greedy_B = jnp.where(scored_BL, scores_BL2[..., 1] > 0, True).all(-1)
            return loglik_B, greedy_B

        return jax.jit(forward, in_shardings=(sharded.param_shardings, sharded.batch_shardings))

    @functools.cached_property
    def _forward_scored(self):
        """As ``_forward``, the head over only the scored tokens: ``batch`` has the model's
        inputs and ``at`` [B, K] (each scored token's index in the layout's order), ``labels``
        and ``loss_mask`` [B, K]."""
        from model.loss import chunked_token_losses
        from parallel.mesh import BATCH_AXES
        sharded, chunk, vocab = self.sharded, int(self.config.train.loss_chunk), self.usable_vocab
        mesh = self.mesh

        def gather_local(x_BlD, at_BK):
            # this device's slice of the layout holds tokens [s * l, (s + 1) * l)
            local_BK = at_BK - jax.lax.axis_index("sequence") * x_BlD.shape[1]
            mine_BK = (local_BK >= 0) & (local_BK < x_BlD.shape[1])
            x_BKD = jnp.take_along_axis(x_BlD, jnp.clip(local_BK, 0, x_BlD.shape[1] - 1)[..., None],
                                        axis=1)
            return jax.lax.psum(jnp.where(mine_BK[..., None], x_BKD, 0), "sequence")

        gather = jax.shard_map(gather_local, mesh=mesh,
                               in_specs=(P(BATCH_AXES, "sequence", None), P(BATCH_AXES, None)),
                               out_specs=P(BATCH_AXES, None, None))

        def forward(params, batch, at_BK, labels_BK, mask_BK):
            model = nnx.merge(sharded.graphdef, params)
            x_BLD = model.hidden(batch["tokens"], batch["positions"], batch["segment_ids"])
            scores_BK2 = chunked_token_losses(
                gather(x_BLD, at_BK), labels_BK, mask_BK, **model.head_args(), chunk=chunk,
                mesh=mesh, compute_dtype=model.dtype, greedy_vocab=vocab)
            loglik_B = -scores_BK2[..., 0].sum(-1)
            greedy_B = jnp.where(mask_BK > 0, scores_BK2[..., 1] > 0, True).all(-1)
            return loglik_B, greedy_B

        rows = NamedSharding(mesh, P(BATCH_AXES, None))
        inputs = {k: sharded.batch_shardings[k] for k in ("tokens", "positions", "segment_ids")}
        return jax.jit(forward, in_shardings=(sharded.param_shardings, inputs, rows, rows, rows))

    def _scored_width(self, most: int, length: int) -> int | None:
        """K for a pass whose rows score at most ``most`` tokens: a power of two (at least
        8, a multiple of the sequence axis), or None where it would be over half the row."""
        S = int(self.mesh.shape["sequence"])
        k = -(-max(8, 1 << max(most - 1, 0).bit_length()) // S) * S
        return k if 2 * k <= length else None

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
            self.tokens_real += sum(len(r.tokens) for r in chunk)
            self.tokens_run += B * L
            K = self._scored_width(max(r.scored for r in chunk), L)
            if K is None:
                labels = np.zeros((B, L), np.int32)
                mask = np.zeros((B, L), np.float32)
                for r, row in enumerate(chunk):
                    n = len(row.tokens)
                    labels[r, :n] = (*row.tokens[1:], row.target)
                    mask[r, n - row.scored:n] = 1.0
                natural.update(labels=labels, loss_mask=mask)
            batch = {k: jax.device_put(v, self.sharded.batch_shardings[k])
                     for k, v in to_layout(natural, a.layout, S, int(a.stripe)).items()}
            if K is None:
                loglik_B, greedy_B = jax.device_get(self._forward(params, batch))
            else:
                loglik_B, greedy_B = jax.device_get(self._forward_scored(
                    params, batch, *self._scored(chunk, B, K, L)))
            for r, i in enumerate(ids):
                out[i] = (float(loglik_B[r]), bool(greedy_B[r]))
            if progress is not None:
                progress(len(chunk))
        return out

    def _scored(self, chunk: list[Row], B: int, K: int, L: int):
        """Each row's scored tokens: their indices in the layout's order, labels and mask
        [B, K] (past a row's own count: index 0, masked)."""
        from parallel.layouts import inverse, permutation
        a, S = self.config.attention, int(self.mesh.shape["sequence"])
        where_L = inverse(permutation(a.layout, L, S, int(a.stripe)))  # natural -> layout
        at_BK = np.zeros((B, K), np.int32)
        labels_BK = np.zeros((B, K), np.int32)
        mask_BK = np.zeros((B, K), np.float32)
        for r, row in enumerate(chunk):
            n, k = len(row.tokens), row.scored
            at_BK[r, :k] = where_L[n - k:n]
            labels_BK[r, :k] = (*row.tokens[1:], row.target)[n - k:]
            mask_BK[r, :k] = 1.0
        return at_BK, labels_BK, mask_BK
