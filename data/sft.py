"""The chat pipeline (``data.format=chat``): conversations, each rendered with the run's chat
template and tokenized with its trained tokens, packed whole into rows, in the chosen layout.

records (jsonl / hf) -> conversations (data/chat.py; bad ones counted, the first named) ->
the template's text and trained spans (data/chat_template.py) -> ids and a trained flag per
token (cached) -> held-out split -> too long: dropped or truncated (``data.too_long``) ->
best-fit packing, every conversation whole in one row -> rows shuffled per epoch -> layout.

A row holds whole conversations back to back, each with its own segment id (1, 2, ...; 0 for
padding) and positions from 0, so attention never crosses a conversation in any layout or
strategy. Inside a conversation the label of token j is token j + 1, trained where that token is
(``loss_mask``); a conversation's last token has no label. The loss is the sum over the step's
trained tokens over their count in the whole step (training/state.py), so packing, padding and
neighbours cannot change it. Packing is best-fit decreasing, done once; each epoch shuffles the
rows (seeded by data.shuffle_seed and the epoch), so the rows per epoch never change.
"""
from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import os
import tempfile

import numpy as np

from data import chat, chat_template, files, split, tokenizer as tok_lib
from data.chat import BadConversation
from data.iterator import TrainIterator
from data.batches import Batches
from errors import DataError

VERSION = 2  # bump when rendering or masking changes, so old caches are not reused
FORMATS = ("text", "chat", "preference")  # data.format
TOO_LONG = ("drop", "truncate")
_ENCODE_CHUNK = 256


@dataclasses.dataclass(frozen=True)
class Conversations:
    """Tokenized conversations back to back: conversation i is ids[offsets[i]:offsets[i+1]]."""
    ids: np.ndarray  # int32
    trained: np.ndarray  # bool per token: whether it is trained as a label
    offsets: np.ndarray  # int64 [n + 1]
    # per unit (a conversation; a preference pair), its place in [0, 1) for the held-out split
    # (data/chat.py split_key); None once the units are fitted to rows
    keys: np.ndarray | None = None

    @property
    def count(self) -> int:
        return self.offsets.size - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def one(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = self.offsets[i], self.offsets[i + 1]
        return self.ids[a:b], self.trained[a:b]

    @staticmethod
    def of(ids: list, trained: list, keys: list | None = None) -> "Conversations":
        """Sequences given one by one (none at all is an empty set)."""
        offsets = np.concatenate([[0], np.cumsum([len(t) for t in ids], dtype=np.int64)])
        cat = (lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt))  # noqa: E731
        return Conversations(cat(ids, np.int32), cat(trained, bool), offsets.astype(np.int64),
                             None if keys is None else np.asarray(keys, np.float64))


def tokenize(records, template: chat_template.ChatTemplate, tokenizer, train_on: str,
             messages_field: str = "", tally: chat.Tally | None = None) -> Conversations:
    """Every conversation of ``records`` ((where, record) pairs) that has something to train:
    rendered, tokenized (no special tokens added: the template writes them) and masked. Those
    passed over are counted in ``tally``."""
    tally = tally if tally is not None else chat.Tally()
    ids, trained, keys = [], [], []
    pending: list[tuple[str, str, list, float]] = []

    def flush():
        texts = [text for _, text, _, _ in pending]
        for (where, _, spans, key), enc in zip(pending, tokenizer.encode_batch(
                texts, add_special_tokens=False)):
            flags = chat_template.token_mask(enc.offsets, spans)
            if not flags[1:].any():  # the first token is never a label
                tally.add("empty", where)
                continue
            ids.append(np.asarray(enc.ids, np.int32))
            trained.append(flags)
            keys.append(key)
        pending.clear()

    for where, record in records:
        tally.read += 1
        try:
            messages = chat.messages_of(record, messages_field)
            text, spans = template.spans(messages, train_on, chat.template_context(record))
        except (BadConversation, chat_template.TemplateError) as e:
            tally.add("bad", f"{where}: {e}")
            continue
        pending.append((where, text, spans, chat.split_key(messages)))
        if len(pending) >= _ENCODE_CHUNK:
            flush()
    flush()
    return Conversations.of(ids, trained, keys)


def _save(conv: Conversations, notes: dict, path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-", suffix=".npz")
    with os.fdopen(fd, "wb") as f:
        np.savez(f, ids=conv.ids, trained=conv.trained, offsets=conv.offsets, keys=conv.keys,
                 notes=np.frombuffer(json.dumps(notes).encode(), np.uint8))
    os.replace(tmp, path)  # readers see the whole file or none


def cached(cache_dir: str, key: str, make) -> tuple[Conversations, dict, str]:
    """The conversations cached under ``key`` and the notes of their read (JSON), made by
    ``make()`` -> (Conversations, notes) if absent: a second run reads neither the source nor
    the template again, and reports the same counts."""
    digest = hashlib.sha256(f"{VERSION}\0{key}".encode()).hexdigest()[:16]
    path = os.path.join(os.path.expanduser(cache_dir), "chat", f"conversations-{digest}.npz")
    if os.path.isfile(path):
        with np.load(path) as z:
            conv = Conversations(z["ids"], z["trained"].astype(bool), z["offsets"], z["keys"])
            notes = json.loads(z["notes"].tobytes().decode())
        return conv, notes, path
    conv, notes = make()
    _save(conv, notes, path)
    return conv, notes, path


# -- packing ----------------------------------------------------------------------------------
def best_fit(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Items (by index) packed into rows of ``capacity``, each whole: best-fit decreasing (the
    longest first, each into the fullest row it fits), rows in order of opening, each row's
    items longest first. Deterministic: ties go to the lower index and the older row."""
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row), sorted
    for i in order:
        n = int(lengths[i])
        if n > capacity:
            raise ValueError(f"item {i} of {n} does not fit a row of {capacity}")
        k = bisect.bisect_left(free, (n, -1))
        if k < len(free):
            room, r = free.pop(k)
        else:
            room, r = capacity, len(rows)
            rows.append([])
        rows[r].append(i)
        if room - n > 0:
            bisect.insort(free, (room - n, r))
    return rows


def row_arrays(conv: Conversations, rows: list[list[int]], seq_len: int, pad_id: int) -> dict:
    """Natural-order arrays [len(rows), seq_len] of packed rows (pipeline.py's keys)."""
    shape = (len(rows), seq_len)
    tokens = np.full(shape, pad_id, np.int32)
    labels = np.full(shape, pad_id, np.int32)
    positions = np.zeros(shape, np.int32)
    segments = np.zeros(shape, np.int32)
    mask = np.zeros(shape, np.float32)
    for r, items in enumerate(rows):
        at = 0
        for k, i in enumerate(items, 1):
            ids, trained = conv.one(i)
            n = ids.size
            tokens[r, at:at + n] = ids
            labels[r, at:at + n - 1] = ids[1:]
            mask[r, at:at + n - 1] = trained[1:]
            positions[r, at:at + n] = np.arange(n)
            segments[r, at:at + n] = k
            at += n
        positions[r, at:] = np.arange(seq_len - at)  # padding: its own run from 0
    return {"tokens": tokens, "labels": labels, "positions": positions,
            "segment_ids": segments, "loss_mask": mask}


class ChatRows:
    """Global rows ``g`` of repeated epochs of packed rows, the rows in a fresh order per epoch
    (``shuffle``) or in packing order."""

    def __init__(self, conv: Conversations, rows: list[list[int]], seq_len: int, pad_id: int,
                 seed: int | None, wrap: bool = True):
        self.conv, self.packed, self.seq_len, self.pad_id, self.seed = conv, rows, seq_len, pad_id, seed
        self.rows_per_pass = len(rows)
        # past the last row: the next epoch's (training), or empty rows (held out: a batch that
        # would run over the end is padded, so every held-out row counts once)
        self.wrap = wrap

        self._order = (None, None)  # (epoch, its row order): one tuple, swapped atomically

    def order(self, epoch: int) -> np.ndarray:
        cached_epoch, order = self._order
        if cached_epoch != epoch:
            order = (np.arange(self.rows_per_pass) if self.seed is None else
                     np.random.default_rng([int(self.seed), int(epoch)]).permutation(self.rows_per_pass))
            self._order = (epoch, order)
        return order

    def conversations(self, first: int, count: int) -> list[list[int]]:
        """The conversations (indices) of global rows ``first .. first+count-1``, per row."""
        picked = []
        for g in range(first, first + count):
            if not self.wrap and g >= self.rows_per_pass:
                picked.append([])
                continue
            epoch, r = divmod(g, self.rows_per_pass)
            picked.append(self.packed[int(self.order(epoch)[r])])
        return picked

    def rows(self, first: int, count: int) -> dict[str, np.ndarray]:
        return row_arrays(self.conv, self.conversations(first, count), self.seq_len, self.pad_id)


def fit(conv: Conversations, ids: np.ndarray, seq_len: int, policy: str, tally: chat.Tally
        ) -> tuple[Conversations, np.ndarray, np.ndarray]:
    """Conversations ``ids`` as a row takes them: one longer than ``seq_len`` dropped or cut to
    its first ``seq_len`` tokens (dropped too if that leaves nothing trained). Returns the
    conversations (a new set when any was cut), the ids kept in it, and for each of its
    conversations the index it had in ``conv``."""
    lengths = conv.lengths[ids]
    long = ids[lengths > seq_len]
    every = np.arange(conv.count, dtype=np.int64)
    if long.size == 0:
        return conv, ids, every
    for i in long:
        tally.add("too_long", f"conversation {int(i)} ({int(conv.lengths[i])} tokens)")
    if policy == "drop":
        return conv, ids[lengths <= seq_len], every
    # truncate: copy every kept conversation, the long ones cut (the trained flags cut with them)
    keep, parts_ids, parts_trained = [], [], []
    for i in ids:
        tok, tr = conv.one(int(i))
        if tok.size > seq_len:
            tok, tr = tok[:seq_len], tr[:seq_len]
            if not tr[1:].any():
                tally.add("cut_to_nothing", f"conversation {int(i)}")
                continue
        keep.append(int(i))
        parts_ids.append(tok)
        parts_trained.append(tr)
    cut = Conversations.of(parts_ids, parts_trained)  # empty when every one was cut to nothing
    return cut, np.arange(len(keep), dtype=np.int64), np.asarray(keep, np.int64)


class ChatPipeline(Batches):
    """``data.format=chat``: batches (layout, sharding, held-out batches: data/batches.py) over
    rows of packed conversations."""

    SIDES = 1  # sequences per unit: a conversation (a preference pair has 2)
    ROWS = ChatRows

    def __init__(self, config, mesh):
        d = config.data
        self._init_batches(config, mesh)
        self._init_records(config)
        w = self.WORDS

        def make():
            tally = chat.Tally()
            conv = self._tokenize(_limited(self.source.records(), int(d.max_docs)), d, tally)
            return conv, {"tally": dataclasses.asdict(tally),
                          "bad_records": dataclasses.asdict(files.tally(self.source.parts))}

        conv, notes, self.cache_path = cached(d.cache_dir, self._cache_key(d), make)
        self.tally = chat.Tally(**notes["tally"])
        self.bad_records = files.BadRecords(**notes["bad_records"])
        units = conv.count // self.SIDES
        if units == 0:
            raise DataError(f"no {w['what']} to train in {self.source.description}: "
                            f"{self._passed_over() or 'it holds none'}")
        self.conversations_read = units
        train_ids, held_ids = split.heldout_by_key(conv.keys, float(d.heldout_fraction))
        train_conv, train_ids, self._train_origin = self._fit(conv, train_ids, self.tally)
        self.heldout_tally = chat.Tally()
        held_conv, held_ids, self._held_origin = self._fit(conv, held_ids, self.heldout_tally)
        if train_ids.size == 0:
            raise DataError(f"every training {w['unit']} is longer than data.seq_len="
                            f"{self.seq_len} tokens"
                            + (" (data.too_long=drop); raise data.seq_len or set "
                               "data.too_long=truncate" if self.too_long == "drop" else
                               f" and cut to {w['cut']} trains nothing (data.too_long=truncate); "
                               f"raise data.seq_len"))
        if held_ids.size == 0 and int(config.train.eval_batches):
            raise DataError(f"every held-out {w['unit']} ({self.heldout_tally.too_long}) is "
                            f"longer than data.seq_len={self.seq_len} tokens"
                            + (" (data.too_long=drop)" if self.too_long == "drop" else
                               f" and cut to {w['cut']} trains nothing")
                            + ": there is nothing to evaluate; raise data.seq_len or "
                              "data.heldout_fraction, or set train.eval_batches=0")
        self.train_rows_packed = [[int(train_ids[j]) for j in row]
                                  for row in best_fit(self._sizes(train_conv, train_ids), self.seq_len)]
        held_rows = [[int(held_ids[j]) for j in row]
                     for row in best_fit(self._sizes(held_conv, held_ids), self.seq_len)]
        self.train_conversations, self.heldout_conversations = int(train_ids.size), int(held_ids.size)
        self.train_tokens = int(self._sizes(train_conv, train_ids).sum())
        seqs = [self.SIDES * int(i) + k for i in train_ids for k in range(self.SIDES)]
        self.trained_tokens = int(sum(train_conv.one(q)[1][1:].sum() for q in seqs))
        self.shuffle_seed = int(d.shuffle_seed)
        self._train_rows = self.ROWS(train_conv, self.train_rows_packed, self.seq_len, self.eos_id,
                                     self.shuffle_seed)
        self._heldout_rows = self.ROWS(held_conv, held_rows, self.seq_len, self.eos_id, None,
                                       wrap=False)
        self.plan_digest = hashlib.sha256(
            json.dumps([self.train_rows_packed, held_rows]).encode()).hexdigest()[:16]
        identity = {"tokenizer": self.fingerprint, "seq_len": self.seq_len,
                    "documents": self.train_conversations, "shuffle_seed": self.shuffle_seed,
                    "data_plan": hashlib.sha256(json.dumps(self.train_rows_packed).encode())
                    .hexdigest()[:16]}
        self.train = TrainIterator(self.device_batch, self.batch_size, self.rows_per_epoch,
                                   int(d.prefetch), identity)

    # -- what a unit is: overridden by data/preference.py --------------------------------------
    def _cache_key(self, d) -> str:
        return "\0".join([self.source.record_signature(), f"max_docs={int(d.max_docs)}",
                          self.fingerprint, self.template.digest, self.train_on, d.messages_field])

    def _tokenize(self, records, d, tally) -> Conversations:
        return tokenize(records, self.template, self.tokenizer, self.train_on,
                        d.messages_field, tally)

    def _fit(self, conv, ids, tally):
        return fit(conv, ids, self.seq_len, self.too_long, tally)

    @staticmethod
    def _sizes(conv, ids) -> np.ndarray:
        return conv.lengths[ids]

    def _init_records(self, config) -> None:
        """The source of records, the model's tokenizer and the chat template (one line for
        each that is missing)."""
        d = config.data
        fmt = d.get("format", "chat")
        if d.source not in ("jsonl", "hf"):
            raise DataError(f"data.format={fmt} reads records from data.source=jsonl or hf, "
                            f"not {d.source!r}")
        if d.mixture:
            raise DataError(f"data.format={fmt} reads one source; data.mixture must be empty")
        if not d.tokenizer:
            raise DataError(f"data.format={fmt} needs the model's tokenizer: set data.tokenizer "
                            f"(configs/sft.py:RUN_DIR and configs/dpo.py:RUN_DIR set the run's)")
        from data import sources
        self.source = sources.make_source(d)
        self.tokenizer = tok_lib.load(d.tokenizer, int(config.model.vocab_size))
        self.tokenizer_path = d.tokenizer
        self.fingerprint = tok_lib.fingerprint(self.tokenizer)
        self.vocab_size = int(config.model.vocab_size)
        self.eos_id = tok_lib.eos_id(self.tokenizer)
        self.template = chat_template.load(d.chat_template, d.tokenizer)
        self.train_on, self.too_long = d.train_on, d.too_long

    def conversations(self, first_row: int, count: int, heldout: bool = False) -> list[list[int]]:
        """Which conversations (their index among those read, in read order) global rows
        ``first_row ..`` hold, row by row: what a batch trains on."""
        rows, origin = ((self._heldout_rows, self._held_origin) if heldout else
                        (self._train_rows, self._train_origin))
        return [[int(origin[i]) for i in row] for row in rows.conversations(first_row, count)]

    # -- facts for logs --------------------------------------------------------------------
    @property
    def tokens_per_epoch(self) -> int:
        return self.train_tokens

    @property
    def shapes_epoch(self) -> bool:
        return True

    def _heldout_too_long(self, what: str) -> str:
        h = self.heldout_tally
        if not h.too_long:
            return ""
        gone = h.too_long if self.too_long == "drop" else h.cut_to_nothing
        return (f"held out: {h.too_long} {what}(s) longer than {self.seq_len} tokens"
                f"{f', {gone} dropped' if gone else ', truncated'}")

    def _passed_over(self) -> str:
        t, said = self.tally, []
        if t.bad:
            said.append(f"{t.bad} {self.WORDS['bad']} (first: {t.first_bad})")
        if t.empty:
            said.append(f"{t.empty} with nothing to train under data.train_on={self.train_on} "
                        f"(first: {t.first_empty})")
        return "; ".join(said)

    # the startup line's words for what this pipeline reads (data/preference.py has its own)
    WORDS = {"kind": "chat", "unit": "conversation", "what": "conversation",
             "cut": "its first data.seq_len tokens", "bad": "not conversations",
             "truncated": "truncated", "trained": "trained tokens"}

    def plan_line(self) -> str:
        """The startup line: records read and passed over, rows, the trained fraction."""
        t, w = self.tally, self.WORDS
        rows = self.rows_per_epoch
        said = [f"data: {w['kind']}, {t.read} records read from {self.source.description}, "
                f"{self.conversations_read} {w['unit']}s"]
        passed = self._passed_over()
        if passed:
            said.append("passed over: " + passed)
        if t.too_long:
            cut = (f", {t.cut_to_nothing} of them then with nothing to train: dropped"
                   if t.cut_to_nothing else "")
            said.append(f"{t.too_long} training {w['unit']}(s) longer than {self.seq_len} "
                        f"tokens {'dropped' if self.too_long == 'drop' else w['truncated']} "
                        f"(data.too_long={self.too_long}; first: {t.first_too_long}){cut}")
        said.append(self._heldout_too_long(w["unit"]))
        on = f" (data.train_on={self.train_on})" if w["kind"] == "chat" else ""
        said.append(f"{self.train_conversations} train / {self.heldout_conversations} held out; "
                    f"{rows} rows of {self.seq_len} ({self.train_tokens / (rows * self.seq_len):.0%} "
                    f"filled); {w['trained']} {self.trained_tokens / (rows * self.seq_len):.1%} "
                    f"of the rows{on}; chat template {self.template.where}"
                    f"{'' if self.template.marked else ' (turn by turn: no generation marks)'}")
        return "; ".join(x for x in said if x)


def _limited(records, max_docs: int):
    for n, item in enumerate(records):
        if max_docs and n >= max_docs:
            return
        yield item
