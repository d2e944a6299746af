"""The preference pipeline (``data.format=preference``, DPO): pairs of responses to one prompt,
each side rendered with the run's chat template, packed together, with the reference model's
log-probabilities.

records (TRL's prompt / chosen / rejected; data/chat.py ``pair_of``, bad ones counted) -> each
side's text and response spans (the assistant turns after the prompt) -> ids and a trained flag
per token (cached) -> held-out split of pairs -> a pair longer than a row dropped, or each side
cut to half a row (``data.too_long``) -> best-fit packing of whole pairs -> rows.

A pair is never split: pair k of a row is its chosen side (segment 2k - 1) then its rejected
side (2k), each with positions from 0, so a row's loss sees both sides of every pair it holds
and attention never crosses a side (model/preference.py reads the sides by segment). A side's
log-probability is the sum over its response tokens (``loss_mask``).

The reference's log-probabilities are computed once, by the starting weights, in a pass over
every train and held-out row before the first step (``prepare``), and stored in the run
directory (``reference_logps.npz``): a resumed run reads them there. A pass costs one forward
over the data; the alternative, a frozen copy of the weights run beside the policy in every
step, would hold a second set of parameters in device memory for the whole run and add a
forward to every step of every epoch. Each batch carries them as ``ref_logps``: a side's sum
at its first token, zero elsewhere (so any layout permutation keeps them).
"""
from __future__ import annotations

import hashlib
import json
import pathlib

import numpy as np

from data import chat
from data.chat import BadConversation
from data.chat_template import TemplateError
from data.sft import ChatPipeline, ChatRows, Conversations, row_arrays
from errors import CheckpointError, DataError

REFERENCE_FILE = "reference_logps.npz"


def tokenize_pairs(records, template, tokenizer, tally: chat.Tally) -> Conversations:
    """Every valid pair of ``records`` as two sequences: pair i is sequences 2i (chosen) and
    2i + 1 (rejected), each flagged on its response tokens."""
    from data.chat_template import token_mask
    ids, trained, keys = [], [], []
    for where, record in records:
        tally.read += 1
        try:
            prompt, chosen, rejected = chat.pair_of(record)
            context = chat.template_context(record)
            sides = [template.response_spans(prompt, chosen, context),
                     template.response_spans(prompt, rejected, context)]
        except (BadConversation, TemplateError) as e:
            tally.add("bad", f"{where}: {e}")
            continue
        encoded = tokenizer.encode_batch([t for t, _ in sides], add_special_tokens=False)
        flags = [token_mask(enc.offsets, spans) for enc, (_, spans) in zip(encoded, sides)]
        if not all(f[1:].any() for f in flags):
            tally.add("empty", where)
            continue
        for enc, f in zip(encoded, flags):
            ids.append(np.asarray(enc.ids, np.int32))
            trained.append(f)
        keys.append(chat.split_key(prompt))
    return Conversations.of(ids, trained, keys)


def fit_pairs(conv: Conversations, pairs: np.ndarray, seq_len: int, policy: str,
              tally: chat.Tally) -> tuple[Conversations, np.ndarray, np.ndarray]:
    """Pairs ``pairs`` as a row takes them (both sides together): a longer pair dropped, or each
    side cut to its first ``seq_len // 2`` tokens (dropped if a side then trains nothing).
    Returns the sequences (a new set when any was cut), the pairs kept in it, and each kept
    pair's index in ``conv``."""
    size = conv.lengths[2 * pairs] + conv.lengths[2 * pairs + 1]
    if (size <= seq_len).all():
        return conv, pairs, np.arange(conv.count // 2, dtype=np.int64)
    for p in pairs[size > seq_len]:
        tally.add("too_long", f"pair {int(p)} ({int(conv.lengths[2 * p])} + "
                              f"{int(conv.lengths[2 * p + 1])} tokens)")
    keep, ids, trained = [], [], []
    for p, n in zip(pairs, size):
        sides = [conv.one(int(2 * p)), conv.one(int(2 * p + 1))]
        if n > seq_len:
            if policy == "drop":
                continue
            sides = [(t[:seq_len // 2], f[:seq_len // 2]) for t, f in sides]
            if not all(f[1:].any() for _, f in sides):
                tally.add("cut_to_nothing", f"pair {int(p)}")
                continue
        keep.append(int(p))
        for t, f in sides:
            ids.append(t)
            trained.append(f)
    cut = Conversations.of(ids, trained)  # empty when no pair was kept
    return cut, np.arange(len(keep), dtype=np.int64), np.asarray(keep, np.int64)


def weights_fingerprint(params, mesh, per_leaf: int = 4096) -> str:
    """A hash of the weights: up to ``per_leaf`` evenly strided values of every parameter (any
    training step moves them all), gathered onto every process, and the shapes. The same for
    the same weights on any mesh."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec
    leaves = jax.tree.leaves(params)

    def sample(leaves):
        return [x.reshape(-1)[::max(1, x.size // per_leaf)][:per_leaf] for x in leaves]

    got = jax.jit(sample, out_shardings=NamedSharding(mesh, PartitionSpec()))(leaves)
    h = hashlib.sha256()
    for x, s in zip(leaves, jax.device_get(got)):
        h.update(f"{x.shape}{x.dtype}".encode())
        h.update(np.ascontiguousarray(s).tobytes())
    return h.hexdigest()[:32]


class PairRows(ChatRows):
    """Rows of packed pairs (each row a list of pair indices), with the reference's per-side
    log-probabilities at each side's first token once they are known (``ref``: one per
    sequence)."""

    def __init__(self, conv, rows, seq_len, pad_id, seed, wrap=True):
        super().__init__(conv, rows, seq_len, pad_id, seed, wrap)
        self.ref: np.ndarray | None = None

    @staticmethod
    def sides(row: list[int]) -> list[int]:
        return [s for p in row for s in (2 * p, 2 * p + 1)]

    def arrays(self, picked: list[list[int]]) -> dict:
        out = row_arrays(self.conv, [self.sides(r) for r in picked], self.seq_len, self.pad_id)
        ref = np.zeros(out["tokens"].shape, np.float32)
        for r, row in enumerate(picked):
            at = 0
            for s in self.sides(row):
                if self.ref is not None:
                    ref[r, at] = self.ref[s]
                at += self.conv.lengths[s]
        out["ref_logps"] = ref
        return out

    def rows(self, first: int, count: int) -> dict[str, np.ndarray]:
        return self.arrays(self.conversations(first, count))


class PreferencePipeline(ChatPipeline):
    """``data.format=preference``: batches over rows of packed pairs, each batch with
    the reference's log-probabilities (after ``prepare``)."""
    WORDS = {"kind": "preference pairs", "unit": "pair", "what": "preference pair",
             "cut": "half a row each side", "bad": "not preference pairs",
             "truncated": "cut to half a row each side", "trained": "response tokens"}

    SIDES = 2
    ROWS = PairRows

    def __init__(self, config, mesh):
        self.prepared = False
        super().__init__(config, mesh)

    def _cache_key(self, d) -> str:
        return "\0".join(["preference", self.source.record_signature(),
                          f"max_docs={int(d.max_docs)}", self.fingerprint, self.template.digest])

    def _tokenize(self, records, d, tally) -> Conversations:
        return tokenize_pairs(records, self.template, self.tokenizer, tally)

    def _fit(self, conv, ids, tally):
        return fit_pairs(conv, ids, self.seq_len, self.too_long, tally)

    @staticmethod
    def _sizes(conv, pairs) -> np.ndarray:
        return conv.lengths[2 * pairs] + conv.lengths[2 * pairs + 1]

    def device_batch(self, first_row: int, heldout: bool = False) -> dict:
        if not self.prepared:
            raise DataError("the reference log-probabilities are not computed yet: "
                            "PreferencePipeline.prepare comes before the first batch")
        return super().device_batch(first_row, heldout)

    # -- the reference ----------------------------------------------------------------------
    def prepare(self, trainer, params, workdir: pathlib.Path, start: int, log) -> None:
        """The reference's per-side log-probabilities: read from the run directory, or (a run's
        start) computed with ``params``, the starting weights (LoRA's adapters off: the base
        model), over every row, and saved."""
        import jax
        path = workdir / REFERENCE_FILE
        # What the reference is of: the rows' very tokens (which side is chosen included), and,
        # at a run's start, the starting weights. A resume reads the file its start wrote: its
        # params are the checkpoint's, not the starting weights, so only the data is compared.
        data = self.rows_digest()
        weights = weights_fingerprint(params, trainer.mesh) if start == 0 else None
        if path.is_file():
            with np.load(path) as z:
                try:
                    stored = json.loads(bytes(z["identity"]).decode())
                except ValueError:
                    stored = {}
                if stored.get("data") == data and (start > 0 or stored.get("weights") == weights):
                    self._train_rows.ref, self._heldout_rows.ref = z["train"], z["heldout"]
                    self.prepared = True
                    log(f"reference log-probabilities: {path}")
                    return
            if start > 0:
                raise CheckpointError(f"{path} was computed for other pairs (data, tokenizer, "
                                      f"template or seq_len changed); a preference run resumes "
                                      f"on the data it started with")
            log(f"{path} was computed for other pairs or other starting weights: computing "
                f"the reference anew")
        elif start > 0:
            raise CheckpointError(f"{path} is missing: a preference run resumes with the "
                                  f"reference log-probabilities it computed at its start")
        sides = jax.jit(lambda p, b: trainer.objective.sides_logps(
                            trainer.token_losses(trainer.reference_params(p), b), b),
                        in_shardings=(trainer.param_shardings, trainer.batch_shardings),
                        out_shardings=jax.sharding.NamedSharding(trainer.mesh,
                                                                 jax.sharding.PartitionSpec()))
        refs = []
        for rows in (self._train_rows, self._heldout_rows):
            ref = np.zeros(rows.conv.count, np.float64)
            packed = rows.packed
            for first in range(0, len(packed), self.batch_size):
                chunk = packed[first:first + self.batch_size]
                chunk = chunk + [[]] * (self.batch_size - len(chunk))  # empty rows: padding
                host = rows.arrays(chunk)
                batch = self._to_device(host)
                chosen, rejected = jax.device_get(sides(params, batch))
                for r, row in enumerate(chunk):
                    for k, p in enumerate(row):
                        ref[2 * p], ref[2 * p + 1] = chosen[r, k], rejected[r, k]
            refs.append(ref)
        self._train_rows.ref, self._heldout_rows.ref = refs
        self.prepared = True
        if jax.process_index() == 0:
            workdir.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".partial.npz")
            identity = json.dumps({"data": data, "weights": weights})
            np.savez(tmp, train=refs[0], heldout=refs[1],
                     identity=np.frombuffer(identity.encode(), np.uint8))
            tmp.replace(path)
        log(f"reference log-probabilities of {self.train_conversations} train and "
            f"{self.heldout_conversations} held-out pairs computed with the starting weights: "
            f"{path}")

    def rows_digest(self) -> str:
        """A hash of every train and held-out row as the reference pass reads it: the packing
        plan, each side's token ids and response flags, the tokenizer, template and seq_len."""
        h = hashlib.sha256(json.dumps([self.plan_digest, self.fingerprint, self.template.digest,
                                       self.seq_len]).encode())
        for rows in (self._train_rows, self._heldout_rows):
            for a in (rows.conv.ids, rows.conv.trained, rows.conv.offsets):
                h.update(np.ascontiguousarray(a).tobytes())
        return h.hexdigest()[:32]

    def _to_device(self, host: dict) -> dict:
        from data import batching
        block = {k: v[self._rows] for k, v in host.items()}
        return batching.to_global(self.in_layout(block), self.sharding, self.global_shape)
