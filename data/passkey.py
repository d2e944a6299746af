"""Passkey retrieval: a number hidden in repeated filler text, asked for at the end.

The test of Mohtashami & Jaggi (2023) that long-context work reports: filler sentences, the
needle "The pass key is 71432. Remember it. 71432 is the pass key." at a chosen depth, then
"What is the pass key? The pass key is" and the answer " 71432".

Examples are built in tokens of the run's tokenizer, piece by piece (filler, needle, question,
answer, each encoded on its own), so that a row has exactly the requested number of tokens
and the needle sits at exactly the requested token offset; the filler is cut at a token, not
at a sentence. Every piece starts with a space, so a byte-level BPE encodes the pieces as it
would encode their concatenation. ``document`` writes the same format as text, for training
corpora (scripts/make_passkey_corpus.py).
"""
from __future__ import annotations

import dataclasses

import numpy as np

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
          "There and back again.")
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is"
ANSWER = " {key}"
DIGITS = 5


@dataclasses.dataclass
class Example:
    tokens: np.ndarray  # int32 [length]: prefix, filler with the needle inside, question, answer
    key: str
    needle_start: int  # token index where the needle's tokens begin (after the prefix)
    needle_len: int
    answer_start: int  # token index of the answer's first token; the row ends with the answer
    depth: float


def random_key(rng: np.random.Generator, digits: int = DIGITS) -> str:
    """A number of exactly ``digits`` digits (no leading zero)."""
    return str(int(rng.integers(10 ** (digits - 1), 10 ** digits)))


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False).ids)


def prefix_ids(tokenizer) -> list[int]:
    """What starts a document: the tokenizer's own prefix (a LLaMA tokenizer's BOS), else the
    end-of-text token that packing puts before every document a run trains on (data/packing.py):
    without it the first tokens of a row are a context no trained document ever had."""
    from data.tokenizer import eos_id
    return list(tokenizer.encode("").ids) or [eos_id(tokenizer)]


def fixed_tokens(tokenizer, key: str) -> int:
    """Tokens of a row that are not filler: prefix, needle, question and answer."""
    return (len(prefix_ids(tokenizer)) + len(_ids(tokenizer, NEEDLE.format(key=key)))
            + len(_ids(tokenizer, QUESTION)) + len(_ids(tokenizer, ANSWER.format(key=key))))


def build(tokenizer, length: int, depth: float, key: str) -> Example:
    """A row of exactly ``length`` tokens whose needle starts ``depth`` of the way through the
    filler (0: right after the prefix, 1: right before the question)."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth {depth} must be in [0, 1]")
    prefix = prefix_ids(tokenizer)
    needle = _ids(tokenizer, NEEDLE.format(key=key))
    question = _ids(tokenizer, QUESTION)
    answer = _ids(tokenizer, ANSWER.format(key=key))
    filler_len = length - len(prefix) - len(needle) - len(question) - len(answer)
    if filler_len < 0:
        raise ValueError(f"length {length} is shorter than the needle, question and answer "
                         f"({length - filler_len} tokens)")
    cycle = _ids(tokenizer, " " + FILLER)
    filler = (cycle * (filler_len // len(cycle) + 1))[:filler_len]
    cut = int(round(depth * filler_len))
    tokens = prefix + filler[:cut] + needle + filler[cut:] + question + answer
    return Example(tokens=np.asarray(tokens, np.int32), key=key,
                   needle_start=len(prefix) + cut, needle_len=len(needle),
                   answer_start=length - len(answer), depth=depth)


def document(rng: np.random.Generator, filler_sentences: int, digits: int = DIGITS) -> str:
    """One training document in the same format as ``build``'s rows: the filler starts at a
    random sentence of the cycle, the needle goes between two random sentences."""
    sentences = [s.strip() + "." for s in FILLER.split(".") if s.strip()]
    start = int(rng.integers(len(sentences)))
    filler = [sentences[(start + i) % len(sentences)] for i in range(filler_sentences)]
    key = random_key(rng, digits)
    cut = int(rng.integers(filler_sentences + 1))
    parts = filler[:cut] + [NEEDLE.format(key=key).strip()] + filler[cut:]
    return " ".join(parts) + QUESTION + ANSWER.format(key=key) + "."
