"""The tokenized corpus: every document's ids in one flat array plus document offsets, cached.

A corpus may hold several parts (the sources of ``data.mixture``), back to back in order;
``part_offsets`` says which documents each part holds.

Documents are encoded with the tokenizer's fast batch encoder and written to disk as they come
(memory stays flat for any corpus size); the cache is read back memory-mapped, so a second run
neither reads the source nor tokenizes again.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np
from tokenizers import Tokenizer

from errors import DataError

_CHUNK = 256  # documents per encode_batch call: big enough for the thread pool, small in memory
VERSION = 1


@dataclass(frozen=True)
class Corpus:
    tokens: np.ndarray  # [total] uint16/uint32 ids of all documents, back to back (no EOS)
    offsets: np.ndarray  # [num_docs + 1] int64: document i is tokens[offsets[i]:offsets[i+1]]
    part_offsets: np.ndarray  # [num_parts + 1] int64: part p is documents part_offsets[p]:[p+1]

    @property
    def num_docs(self) -> int:
        return self.offsets.size - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def num_parts(self) -> int:
        return self.part_offsets.size - 1

    def part(self, p: int) -> np.ndarray:
        """The document indices of part ``p``."""
        return np.arange(self.part_offsets[p], self.part_offsets[p + 1], dtype=np.int64)

    def doc(self, i: int) -> np.ndarray:
        return np.asarray(self.tokens[self.offsets[i]:self.offsets[i + 1]])


def _dtype(vocab: int):
    return np.uint16 if vocab <= 1 << 16 else np.uint32


def tokenize(docs: Iterable[str], tokenizer: Tokenizer, out_dir: str, description: str) -> Corpus:
    """Encodes ``docs`` into ``out_dir`` (tokens.bin, offsets.npy, meta.json) and loads it."""
    return tokenize_parts([docs], tokenizer, out_dir, [description])


def tokenize_parts(parts: Sequence[Iterable[str]], tokenizer: Tokenizer, out_dir: str,
                   descriptions: Sequence[str], notes: Callable[[], dict] = dict) -> Corpus:
    """Encodes each part's documents, one part after the other, into one corpus in ``out_dir``;
    ``notes()``, called once every document is read, adds facts of the read to meta.json."""
    dtype = _dtype(tokenizer.get_vocab_size(with_added_tokens=True))
    lengths, part_docs = [], []
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "tokens.bin"), "wb") as f:
        chunk: list[str] = []

        def flush():
            for enc in tokenizer.encode_batch_fast(chunk, add_special_tokens=False):
                ids = np.asarray(enc.ids, dtype=dtype)
                f.write(ids.tobytes())
                lengths.append(ids.size)
            chunk.clear()

        for docs, description in zip(parts, descriptions):
            before = len(lengths) + len(chunk)
            for doc in docs:
                chunk.append(doc)
                if len(chunk) == _CHUNK:
                    flush()
            part_docs.append(len(lengths) + len(chunk) - before)
            if not part_docs[-1]:
                where = "the corpus is empty" if len(parts) == 1 else "a data.mixture entry is empty"
                raise DataError(f"no documents in {description}: {where}")
        if chunk:
            flush()
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    np.save(os.path.join(out_dir, "offsets.npy"), offsets)
    with open(os.path.join(out_dir, "meta.json"), "w") as f:
        json.dump({"dtype": np.dtype(dtype).name, "num_docs": len(lengths),
                   "num_tokens": int(offsets[-1]), "part_docs": part_docs,
                   "source": "; ".join(descriptions), **notes()}, f)
    return load(out_dir)


def meta(cache: str) -> dict:
    """A cached corpus's meta.json: its size, parts, source and the notes of its read."""
    with open(os.path.join(cache, "meta.json")) as f:
        return json.load(f)


def load(cache: str) -> Corpus:
    info = meta(cache)
    offsets = np.load(os.path.join(cache, "offsets.npy"))
    # Caches written before parts existed hold one part.
    parts = np.concatenate([[0], np.cumsum(info.get("part_docs", [info["num_docs"]]))])
    parts = parts.astype(np.int64)
    if info["num_tokens"] == 0:  # np.memmap refuses empty files
        return Corpus(np.zeros(0, info["dtype"]), offsets, parts)
    tokens = np.memmap(os.path.join(cache, "tokens.bin"), dtype=info["dtype"], mode="r",
                       shape=(info["num_tokens"],))
    return Corpus(tokens, offsets, parts)


def cached_corpus(cache_dir: str, key: str, tokenizer_fingerprint: str, tokenizer: Tokenizer,
                  parts: Callable[[], Sequence[Iterable[str]]],
                  descriptions: Sequence[str], notes: Callable[[], dict] = dict
                  ) -> tuple[Corpus, str]:
    """The corpus cached for (sources ``key``, tokenizer); ``parts()`` (each part's documents)
    and ``notes()`` (tokenize_parts) are only called on a miss."""
    digest = hashlib.sha256(f"{VERSION}\0{tokenizer_fingerprint}\0{key}".encode()).hexdigest()
    root = os.path.join(os.path.expanduser(cache_dir), "tokens")
    path = os.path.join(root, f"{tokenizer_fingerprint}-{digest[:16]}")
    if os.path.isfile(os.path.join(path, "meta.json")):
        return load(path), path
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=root, prefix=".tmp-")
    try:
        tokenize_parts(parts(), tokenizer, tmp, descriptions, notes)
        try:
            os.rename(tmp, path)  # atomic: a crash or a concurrent writer never leaves half a cache
        except OSError:
            if not os.path.isfile(os.path.join(path, "meta.json")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return load(path), path
