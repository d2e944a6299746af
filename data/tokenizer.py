"""Tokenizer: a byte-level BPE trained on the source (cached), or any ``tokenizer.json``.

The fingerprint is a hash of the tokenizer's canonical JSON: the same tokenizer gives the same
string in every process and run, so a run directory can refuse a resume with another one.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from typing import Callable, Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from errors import DataError

EOS = "<|endoftext|>"
# Names other tokenizers use for their end-of-text token, checked in this order.
EOS_NAMES = (EOS, "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[EOS]", "<|im_end|>")
MIN_VOCAB = 256 + 1  # every byte, so any text encodes, plus EOS
# BPE merges come from word counts, which saturate long before the corpus ends; this cap keeps
# training a few seconds on 2 cores for any source (the whole stdlib corpus is ~12 MB).
TRAIN_CAP_CHARS = 64_000_000
VERSION = 1  # bump when training changes, so old cached tokenizers are not reused


def fingerprint(tokenizer: Tokenizer) -> str:
    canonical = json.dumps(json.loads(tokenizer.to_str()), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def eos_id(tokenizer: Tokenizer) -> int:
    for name in EOS_NAMES:
        i = tokenizer.token_to_id(name)
        if i is not None:
            return i
    raise DataError(f"the tokenizer has no end-of-text token (looked for {', '.join(EOS_NAMES)})")


def check_vocab_size(vocab_size: int) -> None:
    if vocab_size < MIN_VOCAB:
        raise DataError(f"model.vocab_size={vocab_size} is too small for a byte-level BPE: it needs "
                        f"at least {MIN_VOCAB} (256 bytes + the {EOS} token)")


def train_bpe(docs: Iterable[str], vocab_size: int, cap_chars: int = TRAIN_CAP_CHARS,
              description: str = "the source") -> Tokenizer:
    """A byte-level BPE with ``vocab_size`` entries at most (fewer if the text has fewer merges)."""
    check_vocab_size(vocab_size)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    seen = [0]

    def capped():
        for doc in docs:
            if seen[0] >= cap_chars:
                return
            seen[0] += len(doc)
            yield doc

    tok.train_from_iterator(capped(), trainer)
    if seen[0] == 0:
        raise DataError(f"no documents in {description}: the corpus is empty")
    return tok


def load(path: str, vocab_size: int) -> Tokenizer:
    """A tokenizer.json from disk, checked against the model's vocabulary and for an EOS token."""
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise DataError(f"data.tokenizer: no such file {path!r}")
    try:
        tok = Tokenizer.from_file(path)
    except Exception as e:
        raise DataError(f"data.tokenizer: {path} is not a tokenizer.json "
                        f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    size = tok.get_vocab_size(with_added_tokens=True)
    if size > vocab_size:
        raise DataError(f"data.tokenizer {path} has {size} tokens but model.vocab_size is "
                        f"{vocab_size}; set --config.model.vocab_size={size} or more")
    eos_id(tok)
    return tok


def _atomic_write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)  # readers see the old file or the whole new one, never half


def cached_bpe(cache_dir: str, key: str, vocab_size: int, docs: Callable[[], Iterable[str]],
               description: str = "the source") -> tuple[Tokenizer, str]:
    """The BPE cached under ``cache_dir`` for ``key`` (source signature etc.), trained if absent.

    Returns (tokenizer, path). ``docs`` is only called when training is needed."""
    check_vocab_size(vocab_size)
    digest = hashlib.sha256(f"{VERSION}\0{vocab_size}\0{TRAIN_CAP_CHARS}\0{key}".encode()).hexdigest()
    path = os.path.join(os.path.expanduser(cache_dir), "tokenizers",
                        f"bpe-{vocab_size}-{digest[:16]}.json")
    if os.path.isfile(path):
        return Tokenizer.from_file(path), path
    tok = train_bpe(docs(), vocab_size, description=description)
    _atomic_write(path, tok.to_str())
    return tok, path
