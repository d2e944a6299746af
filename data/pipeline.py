"""The data pipeline the trainer calls: ``make_pipeline(config, mesh)``.

source (or a mixture of sources) -> tokenizer (trained once, cached) -> tokenized corpus
(cached) -> held-out split and length filter -> the epoch's documents (mixture weights, long
documents upsampled) -> per-epoch shuffled packing -> layout permutation -> global arrays
sharded on the mesh.

``data.format=chat`` reads conversations instead (data/sft.py: the same batches, rows of whole
conversations, the loss mask on the assistant's tokens), ``preference`` pairs of them
(data/preference.py: a pair's two sides packed together, with the reference's log-probs).

Batches are dicts of global ``jax.Array``s ``[B, L]`` in layout order, sharded
``P(("data", "fsdp"), "sequence")``: ``tokens``, ``labels`` (int32), ``positions`` (int32 true
RoPE positions), ``segment_ids`` (int32, documents 1.. within a row, 0 for padding) and
``loss_mask`` (float32, 0 on padding).
"""
from __future__ import annotations

import dataclasses

import numpy as np
from jax.sharding import Mesh
from tokenizers import Tokenizer

from data import files, mixture, packing, selection, sources, tokenizer as tok_lib, tokens
from data.batches import Batches, Layout  # noqa: F401  (Layout: part of the public API)
from data.batching import from_layout, to_layout  # noqa: F401  (part of the public API)
from data.iterator import TrainIterator
from errors import DataError

__all__ = ["Pipeline", "make_pipeline", "to_layout", "from_layout", "DataError"]


class RowSource:
    """Global rows ``g`` of a repeated stream of passes, ``order_of(pass_index)`` each."""

    def __init__(self, corpus: tokens.Corpus, order_of, eos_id: int, seq_len: int, reset: bool):
        self.corpus, self.order_of, self.eos_id = corpus, order_of, eos_id
        self.seq_len, self.reset = seq_len, reset
        self._cached = (None, None)  # (pass index, PackedPass): one tuple, swapped atomically
        self.rows_per_pass = self._packed(0).num_rows  # the same for every order of the docs

    def _packed(self, index: int) -> packing.PackedPass:
        cached_index, packed = self._cached
        if cached_index != index:
            packed = packing.PackedPass(self.corpus.tokens, self.corpus.offsets,
                                        self.order_of(index), self.eos_id, self.seq_len, self.reset)
            self._cached = (index, packed)
        return packed

    def rows(self, first: int, count: int) -> dict[str, np.ndarray]:
        """Natural-order rows ``first .. first+count-1``, crossing pass boundaries as needed."""
        parts, g, end = [], first, first + count
        while g < end:
            index, r = divmod(g, self.rows_per_pass)
            n = min(end - g, self.rows_per_pass - r)
            parts.append(self._packed(index).rows(r, n))
            g += n
        if len(parts) == 1:
            return parts[0]
        return {k: np.concatenate([p[k] for p in parts]) for k in packing.KEYS}


class Pipeline(Batches):
    """Text documents (``data.format=text``): packed as one stream into rows."""

    def __init__(self, config, mesh: Mesh):
        d = config.data
        self._init_batches(config, mesh)
        self.source = sources.make_source(d)
        self._read(d, int(config.model.vocab_size))
        self._choose_documents(d)
        reset = bool(d.reset_positions_at_doc)
        self._train_rows = RowSource(
            self.corpus, lambda epoch: packing.epoch_order(self.epoch_docs, self.shuffle_seed, epoch),
            self.eos_id, self.seq_len, reset)
        self._heldout_rows = RowSource(self.corpus, lambda _: self.heldout_ids, self.eos_id,
                                       self.seq_len, reset)
        identity = {"tokenizer": self.fingerprint, "seq_len": self.seq_len,
                    "documents": int(self.epoch_docs.size), "shuffle_seed": self.shuffle_seed,
                    "data_plan": mixture.digest(self.epoch_docs)}
        # States saved before the long-context options existed describe one plain pass.
        plain = {"data_plan": mixture.digest(self.selection.unfiltered_train)}
        self.train = TrainIterator(self.device_batch, self.batch_size, self.rows_per_epoch,
                                   int(d.prefetch), identity, defaults=plain)

    def _read(self, d, vocab: int) -> None:
        """The tokenizer and the tokenized corpus, one part per source, both cached."""
        max_docs = int(d.max_docs)
        key = f"{self.source.signature()}\0max_docs={max_docs}"
        docs = lambda: sources.interleaved(self.source, max_docs)  # noqa: E731
        if d.tokenizer:
            self.tokenizer: Tokenizer = tok_lib.load(d.tokenizer, vocab)
            self.tokenizer_path = d.tokenizer
        else:
            self.tokenizer, self.tokenizer_path = tok_lib.cached_bpe(
                d.cache_dir, key, vocab, docs, self.source.description)
        self.fingerprint = tok_lib.fingerprint(self.tokenizer)
        # The model's embedding size; a tokenizer with fewer entries leaves some rows unused.
        self.vocab_size = vocab
        self.eos_id = tok_lib.eos_id(self.tokenizer)
        parts = self.source.parts
        self.corpus, self.corpus_path = tokens.cached_corpus(
            d.cache_dir, key, self.fingerprint, self.tokenizer,
            lambda: [sources.documents(p, max_docs) for p in parts], [p.description for p in parts],
            notes=lambda: {"bad_records": dataclasses.asdict(files.tally(parts))})
        # From the cache's notes: a resumed run, which does not read the files, says the same.
        self.bad_records = files.BadRecords(**tokens.meta(self.corpus_path).get("bad_records", {}))

    def _choose_documents(self, d) -> None:
        """Held-out and training documents, and the epoch's documents (repeats included)."""
        self.min_doc_tokens = int(d.min_doc_tokens)
        self.selection = selection.select(self.corpus, float(d.heldout_fraction), self.min_doc_tokens,
                                          [p.description for p in self.source.parts])
        self.train_ids, self.heldout_ids = self.selection.train, self.selection.heldout
        self.shuffle_seed = int(d.shuffle_seed)
        self.long_doc_tokens, self.long_doc_upsample = int(d.long_doc_tokens), int(d.long_doc_upsample)
        self.plan = mixture.plan(self.selection.train_parts, self.corpus.lengths, self.source.weights,
                                 self.long_doc_tokens, self.long_doc_upsample, self.shuffle_seed)
        self.epoch_docs = self.plan.documents

    @property
    def shapes_epoch(self) -> bool:
        """Whether the filter, upsampling or a mixture make the epoch other than one plain pass."""
        return bool(self.min_doc_tokens or self.source.weights is not None
                    or (self.long_doc_tokens and self.long_doc_upsample > 1))

    @property
    def tokens_per_epoch(self) -> int:
        return int(self.corpus.lengths[self.epoch_docs].sum() + self.epoch_docs.size)

    def plan_line(self) -> str:
        """One line on what the filter, upsampling and mixture did ("" when none is on)."""
        if not self.shapes_epoch:
            return ""
        said = [f"data: {self.epoch_docs.size} documents per epoch, repeats included "
                f"({self.tokens_per_epoch} tokens)"]
        if self.min_doc_tokens:
            dropped = self.selection.documents - self.selection.kept
            said.append(f"min_doc_tokens={self.min_doc_tokens} kept {self.selection.kept} of "
                        f"{self.selection.documents} documents ({dropped} dropped, training and "
                        f"held-out alike)")
        if self.plan.upsampled:
            said.append(f"{self.plan.upsampled} training documents of >= {self.long_doc_tokens} "
                        f"tokens x{self.long_doc_upsample}")
        if self.source.weights is not None:
            said.append("per source: " + ", ".join(
                f"{p.description} {s.tokens} tokens = {s.tokens / self.tokens_per_epoch:.1%} "
                f"(weight {s.target:.1%}, x{s.repeat:.2f} its {s.documents} documents)"
                for p, s in zip(self.source.parts, self.plan.shares)))
        return "; ".join(said)


def make_pipeline(config, mesh: Mesh) -> Pipeline:
    """Builds the pipeline for ``config`` on ``mesh`` (``data.format``: text streams or chat
    conversations); user mistakes raise DataError (one line)."""
    fmt = config.data.get("format", "text")
    if fmt == "chat":
        from data.sft import ChatPipeline
        return ChatPipeline(config, mesh)
    if fmt == "preference":
        from data.preference import PreferencePipeline
        return PreferencePipeline(config, mesh)
    return Pipeline(config, mesh)

