"""Packing: documents joined with EOS into rows of ``seq_len + 1`` tokens, in natural order.

One pass over documents ``order`` is the token stream

    EOS d0 EOS d1 ... EOS dn EOS

Each document's segment starts with its EOS (so segment ids and positions restart at EOS) and
the token after a document's last token is the next EOS: the label of a document's last token
is "end of text", never a token of another document, so every label is a real target and only
padding is masked. Row ``r`` is the window ``stream[r*L : r*L + L + 1]`` (stride ``L``): tokens
are its first ``L``, labels its last ``L``, so every stream token is an input exactly once and a
label exactly once per pass. The last row is padded (segment 0, loss mask 0).

Positions restart at 0 at every segment start inside a row, a document continued from the
previous row included, so they stay in ``[0, L)``; RoPE attention only sees position
differences inside a segment, which are the true ones. Without ``reset_positions`` they are the
row index ``0..L-1``.
"""
from __future__ import annotations

import numpy as np

KEYS = ("tokens", "labels", "positions", "segment_ids", "loss_mask")


class PackedPass:
    """The rows of one pass over the documents ``order`` (indices into ``offsets``)."""

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray, order: np.ndarray, eos_id: int,
                 seq_len: int, reset_positions: bool = True):
        self.tokens, self.eos_id, self.seq_len = tokens, int(eos_id), int(seq_len)
        self.reset_positions = reset_positions
        order = np.asarray(order, dtype=np.int64)
        self.doc_begin = offsets[order]  # where each document's ids start in ``tokens``
        seg_len = offsets[order + 1] - self.doc_begin + 1  # + its leading EOS
        self.starts = np.concatenate([[0], np.cumsum(seg_len)])  # segment starts in the stream
        self.length = int(self.starts[-1]) + 1  # + the closing EOS, a label only
        self.num_rows = -(-(self.length - 1) // self.seq_len)

    def rows(self, first: int, count: int) -> dict[str, np.ndarray]:
        """Rows ``first .. first+count-1`` of this pass (must exist) as natural-order arrays."""
        assert 0 <= first and first + count <= self.num_rows, (first, count, self.num_rows)
        L = self.seq_len
        o = (np.arange(first, first + count, dtype=np.int64) * L)[:, None] + np.arange(L + 1)
        in_stream = o < self.length
        k = np.searchsorted(self.starts, o, side="right") - 1  # segment of each stream offset
        k = np.minimum(k, self.doc_begin.size - 1)  # the closing EOS and padding: last document
        j = o - self.starts[k]  # offset inside the segment; 0 is its EOS
        is_token = in_stream & (j > 0) & (o < self.length - 1)
        src = np.where(is_token, self.doc_begin[k] + j - 1, 0)
        window = np.where(is_token, self.tokens[src] if self.tokens.size else 0, self.eos_id)
        window = window.astype(np.int32)

        valid = in_stream[:, :L] & (o[:, :L] < self.length - 1)  # inputs: all but the closing EOS
        k, j = k[:, :L], j[:, :L]
        seg = np.where(valid, k - k[:, :1] + 1, 0).astype(np.int32)
        col = np.broadcast_to(np.arange(L, dtype=np.int64), (count, L))
        if self.reset_positions:
            # Segment 1 may be a document continued from the previous row: restart it at 0.
            pos = np.where(seg == 1, j - j[:, :1], j)
            first_pad = valid.sum(axis=1, keepdims=True)
            pos = np.where(valid, pos, col - first_pad)  # padding: its own run from 0
        else:
            pos = col
        return {
            "tokens": window[:, :L],
            "labels": window[:, 1:],
            "positions": pos.astype(np.int32),
            "segment_ids": seg,
            "loss_mask": valid.astype(np.float32),
        }


def epoch_order(train_ids: np.ndarray, shuffle_seed: int, epoch: int) -> np.ndarray:
    """The training documents' order in ``epoch``: a fresh shuffle from (seed, epoch)."""
    rng = np.random.default_rng([int(shuffle_seed), int(epoch)])
    return np.asarray(train_ids)[rng.permutation(len(train_ids))]
