"""What one training epoch is made of: each source's share of tokens and length upsampling.

Context-extension recipes (Fu et al. 2024, "Data Engineering for Scaling Language Models to
128K Context"; ProLong) keep a mixture of sources and, inside each source, show long documents
more often. Here:

- ``data.long_doc_tokens`` / ``data.long_doc_upsample``: a training document with at least
  that many tokens appears ``upsample`` times per epoch, in its source's list.
- ``data.mixture``: ``PATH=WEIGHT,PATH=WEIGHT,...``; after upsampling, source ``s`` gets
  ``weight_s / sum(weights)`` of the epoch's tokens. The epoch keeps the size of one pass over
  every source (upsampled): a source is repeated whole ``floor(r)`` times for a ratio ``r`` of
  its share to its size, plus a random subset of its documents for the fraction left.

The subset is drawn once from ``data.shuffle_seed``, not per epoch: every epoch then holds the
same documents (in a fresh order) and the same number of rows, so a batch stays a pure function
of its global row and resuming stays exact. A subsampled source therefore shows the same
documents every epoch; context-extension runs are usually shorter than one epoch.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from errors import DataError

# Kept apart from the epoch orders' seeds ([seed, epoch]): a longer seed is another stream.
_SUBSET_STREAM = 0x6D6978


@dataclass(frozen=True)
class Entry:
    path: str
    weight: float


def parse(spec: str) -> list[Entry]:
    """``data.mixture``'s entries; "" is no mixture. The weight follows the last ``=``, so a path
    may hold ``=`` (hive-style ``key=value`` folders) but not a comma."""
    if not spec.strip():
        return []
    entries = []
    for item in (x.strip() for x in spec.split(",")):
        if not item:
            raise DataError(f"data.mixture={spec!r} has an empty entry; valid: PATH=WEIGHT,PATH=WEIGHT")
        path, eq, weight = item.rpartition("=")
        if not eq or not path.strip():
            raise DataError(f"data.mixture entry {item!r} is not PATH=WEIGHT (e.g. books/*.jsonl=2)")
        try:
            w = float(weight)
        except ValueError:
            raise DataError(f"data.mixture entry {item!r}: weight {weight!r} is not a number") from None
        if not (w > 0 and np.isfinite(w)):
            raise DataError(f"data.mixture entry {item!r}: weight {weight!r} must be a finite number "
                            f"> 0 (leave the source out instead of weighting it 0)")
        entries.append(Entry(path.strip(), w))
    return entries


def check_fields(d) -> None:
    """The long-context data fields, each bad value one line (config validation and pipeline)."""
    if int(d.min_doc_tokens) < 0:
        raise DataError(f"data.min_doc_tokens={d.min_doc_tokens} must be >= 0 (0 keeps every document)")
    if int(d.long_doc_tokens) < 0:
        raise DataError(f"data.long_doc_tokens={d.long_doc_tokens} must be >= 0 (0: no upsampling)")
    if int(d.long_doc_upsample) < 1:
        raise DataError(f"data.long_doc_upsample={d.long_doc_upsample} must be >= 1 "
                        f"(times a long document appears per epoch; 1: no upsampling)")
    if int(d.long_doc_upsample) > 1 and int(d.long_doc_tokens) == 0:
        raise DataError(f"data.long_doc_upsample={d.long_doc_upsample} needs data.long_doc_tokens > 0 "
                        f"(the token count from which a document is long)")
    entries(d)


def entries(d) -> list[Entry]:
    """``data.mixture``'s entries, checked against ``data.source`` and ``data.path``."""
    if d.mixture.strip():
        if d.source == "stdlib":
            raise DataError("data.mixture needs data.source text, jsonl, parquet, hf or tfds "
                            "(the kind of every entry's PATH); stdlib has no paths")
        if d.path.strip():
            raise DataError(f"data.path={d.path!r} and data.mixture are both set; the mixture's "
                            f"entries name the files: set --config.data.path=''")
    return parse(d.mixture)


@dataclass(frozen=True)
class SourceShare:
    """One source's part of an epoch, for the startup line and tests."""
    documents: int  # distinct training documents
    natural_tokens: int  # one pass over them, upsampled, EOS included
    tokens: int  # in the epoch
    target: float  # share asked for (1.0 for a single source)

    @property
    def repeat(self) -> float:
        return self.tokens / max(self.natural_tokens, 1)


@dataclass(frozen=True)
class Plan:
    documents: np.ndarray  # [n] int64 document indices of one epoch, repeats included, unordered
    shares: list[SourceShare]
    upsampled: int  # distinct long documents repeated


def digest(documents: np.ndarray) -> str:
    """Names an epoch's documents: saved with the iterator's position, so that a resume on
    other data (another filter, upsampling or mixture) stops instead of drifting."""
    return hashlib.sha256(np.ascontiguousarray(documents, np.int64).tobytes()).hexdigest()[:16]


def upsampled(ids: np.ndarray, lengths: np.ndarray, long_tokens: int, times: int) -> np.ndarray:
    """``ids`` with each document of at least ``long_tokens`` tokens ``times`` times."""
    if not long_tokens or times == 1:
        return ids
    return np.repeat(ids, np.where(lengths[ids] >= long_tokens, times, 1))


def _subset(copies: np.ndarray, cost: np.ndarray, target: float, rng) -> np.ndarray:
    """A random prefix of ``copies`` whose tokens come closest to ``target``."""
    order = rng.permutation(copies.size)
    cum = np.concatenate([[0], np.cumsum(cost[order])])
    i = int(np.searchsorted(cum, target))
    if i > 0 and (i == cum.size or target - cum[i - 1] <= cum[i] - target):
        i -= 1
    return copies[order[:i]]


def plan(train_parts: list[np.ndarray], lengths: np.ndarray, weights: list[float] | None,
         long_tokens: int, upsample: int, seed: int) -> Plan:
    """The epoch's documents from each source's training ids (``weights`` None: one pass)."""
    copies = [upsampled(ids, lengths, long_tokens, upsample) for ids in train_parts]
    natural = [int((lengths[c] + 1).sum()) for c in copies]  # + each document's EOS
    long_docs = sum(int((lengths[ids] >= long_tokens).sum()) for ids in train_parts)
    if weights is None:
        shares = [SourceShare(ids.size, n, n, n / sum(natural)) for ids, n in zip(train_parts, natural)]
        return Plan(np.concatenate(copies), shares, long_docs if long_tokens and upsample > 1 else 0)
    total, wsum = sum(natural), sum(weights)
    chosen, shares = [], []
    for p, (ids, c, n, w) in enumerate(zip(train_parts, copies, natural, weights)):
        target = total * w / wsum
        whole = int(target // n)
        rng = np.random.default_rng([int(seed), p, _SUBSET_STREAM])
        docs = np.concatenate([np.tile(c, whole), _subset(c, lengths[c] + 1, target - whole * n, rng)])
        chosen.append(docs)
        shares.append(SourceShare(ids.size, n, int((lengths[docs] + 1).sum()), w / wsum))
    return Plan(np.concatenate(chosen), shares, long_docs if long_tokens and upsample > 1 else 0)
