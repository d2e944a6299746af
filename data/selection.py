"""Which documents train and which evaluate: each source's held-out split, then the length filter.

The split comes first and per source (corpus part), so a document's side never depends on
``data.min_doc_tokens`` or on the other sources of a mixture: a context-extension run on the
same files never trains on what an earlier run held out. The filter then drops the short
documents from both sides, so evaluation at the new length sees long documents only.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from data import split
from data.tokens import Corpus
from errors import DataError


@dataclass(frozen=True)
class Selection:
    train_parts: list[np.ndarray]  # per source: sorted int64 training document ids
    heldout: np.ndarray  # sorted int64 held-out document ids, every source
    documents: int  # before the filter, both sides
    unfiltered_train: np.ndarray  # sorted training ids before the filter: one plain pass

    @property
    def train(self) -> np.ndarray:
        return np.concatenate(self.train_parts)

    @property
    def kept(self) -> int:
        return int(self.train.size + self.heldout.size)


def select(corpus: Corpus, heldout_fraction: float, min_tokens: int,
           descriptions: list[str]) -> Selection:
    """Training ids per part and held-out ids, documents under ``min_tokens`` tokens dropped."""
    lengths = corpus.lengths
    train_parts, held_parts = [], []
    for p, description in enumerate(descriptions):
        ids = corpus.part(p)
        try:
            train, held = split.heldout_split(ids.size, heldout_fraction)
        except DataError as e:
            raise DataError(f"{description}: {e}" if len(descriptions) > 1 else str(e)) from None
        train_parts.append(ids[train])
        held_parts.append(ids[held])
    all_train = np.concatenate(train_parts)
    heldout = np.concatenate(held_parts)
    if min_tokens:
        _need_some(all_train, lengths, min_tokens, "training")
        for part, description in zip(train_parts, descriptions):
            if len(descriptions) > 1:
                _need_some(part, lengths, min_tokens, "training", f" in {description}")
        _need_some(heldout, lengths, min_tokens, "held-out", fix=", or raise data.heldout_fraction")
        train_parts = [ids[lengths[ids] >= min_tokens] for ids in train_parts]
        heldout = heldout[lengths[heldout] >= min_tokens]
    return Selection(train_parts, heldout, corpus.num_docs, all_train)


def _need_some(ids: np.ndarray, lengths: np.ndarray, min_tokens: int, side: str, where: str = "",
               fix: str = "") -> None:
    longest = int(lengths[ids].max())
    if longest < min_tokens:
        raise DataError(f"data.min_doc_tokens={min_tokens} leaves no {side} document{where}: the "
                        f"longest of the {ids.size} {side} documents has {longest} tokens; lower "
                        f"data.min_doc_tokens to {longest} or less{fix}")
