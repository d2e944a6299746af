"""Training documents in RULER's needle-in-a-haystack format (lm-evaluation-harness's
``niah_single_1`` and ``niah_multikey_2`` prompts, answer included), so that a small model can
learn the task it is evaluated on (scripts/make_passkey_corpus.py --format ruler).

A document is RULER's prompt, its answer prefix and the answer:

    A special magic number is hidden within the following text. Make sure to memorize it. ...
    <haystack lines, the needle among them>
    What is the special magic number for <key> mentioned in the provided text? The special
    magic number for <key> mentioned in the provided text is <7 digits>.

The haystack is RULER's: the same sentence repeated (``repeat``, niah_single_1), or needles of
other keys (``needle``, niah_multikey_2). Keys are two random pseudo-words joined by a hyphen
(RULER's are English adjective-noun pairs: none of its evaluation keys is trained on), values
7-digit numbers, drawn from this module's own generator, never from RULER's seeded one.
"""
from __future__ import annotations

import numpy as np

TEMPLATE = ("A special magic number is hidden within the following text. Make sure to memorize "
            "it. I will quiz you about the number afterwards.\n{context}\nWhat is the special "
            "magic number for {key} mentioned in the provided text?")
ANSWER_PREFIX = " The special magic number for {key} mentioned in the provided text is"
NEEDLE = "One of the special magic numbers for {key} is: {value}."
REPEAT = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
HAYSTACKS = ("repeat", "needle")
_LETTERS = np.array(list("abcdefghijklmnopqrstuvwxyz"))


def random_key(rng: np.random.Generator) -> str:
    words = ("".join(rng.choice(_LETTERS, int(rng.integers(3, 9)))) for _ in range(2))
    return "-".join(words)


def random_value(rng: np.random.Generator) -> str:
    return str(int(rng.integers(10**6, 10**7)))


def document(rng: np.random.Generator, lines: int, haystack: str) -> str:
    """One document with ``lines`` haystack lines and the needle inserted among them."""
    if haystack not in HAYSTACKS:
        raise ValueError(f"haystack {haystack!r}: valid {', '.join(HAYSTACKS)}")
    key, value = random_key(rng), random_value(rng)
    if haystack == "repeat":
        context = [REPEAT] * lines
    else:
        context = [NEEDLE.format(key=random_key(rng), value=random_value(rng))
                   for _ in range(lines)]
    context.insert(int(rng.integers(lines + 1)), NEEDLE.format(key=key, value=value))
    return (TEMPLATE.format(context="\n".join(context), key=key)
            + ANSWER_PREFIX.format(key=key) + f" {value}.")
