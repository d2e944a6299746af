"""Held-out split per source, then the length filter, on random corpora; errors are one line."""
import numpy as np
import pytest

from data import selection, split
from data.tokens import Corpus
from errors import DataError


def corpus(lengths, part_docs):
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    parts = np.concatenate([[0], np.cumsum(part_docs)]).astype(np.int64)
    return Corpus(np.zeros(int(offsets[-1]), np.uint16), offsets, parts)


def test_split_per_source_then_filter_both_sides(rng):
    part_docs = [int(n) for n in rng.integers(20, 80, size=3)]
    lengths = rng.integers(1, 500, size=sum(part_docs))
    c = corpus(lengths, part_docs)
    names = ["a", "b", "c"]
    plain = selection.select(c, 0.1, 0, names)
    # Each source is split as it would be alone: its held-out documents do not depend on the others.
    for p, n in enumerate(part_docs):
        train, held = split.heldout_split(n, 0.1)
        np.testing.assert_array_equal(plain.train_parts[p], c.part_offsets[p] + train)
        assert np.isin(c.part_offsets[p] + held, plain.heldout).all()
    np.testing.assert_array_equal(plain.unfiltered_train, plain.train)

    m = int(np.median(lengths))
    got = selection.select(c, 0.1, m, names)
    np.testing.assert_array_equal(got.train, plain.train[lengths[plain.train] >= m])
    np.testing.assert_array_equal(got.heldout, plain.heldout[lengths[plain.heldout] >= m])
    assert got.kept == int((lengths >= m).sum()) and got.documents == lengths.size
    np.testing.assert_array_equal(got.unfiltered_train, plain.train)


def test_nothing_left_names_the_longest_document():
    c = corpus([5, 9, 3, 7, 2, 8, 4, 6, 1, 5], [10])
    with pytest.raises(DataError) as e:
        selection.select(c, 0.2, 10, ["x"])
    train_longest = max(np.array([5, 9, 3, 7, 2, 8, 4, 6, 1, 5])[selection.select(c, 0.2, 0, ["x"]).train])
    assert str(e.value) == (f"data.min_doc_tokens=10 leaves no training document: the longest of the "
                            f"8 training documents has {train_longest} tokens; lower "
                            f"data.min_doc_tokens to {train_longest} or less")


def test_no_long_heldout_or_source_document_is_one_line():
    lengths = np.full(40, 10)
    held = selection.select(corpus(lengths, [40]), 0.1, 0, ["x"]).heldout
    lengths[np.setdiff1d(np.arange(40), held)] = 100  # only the held-out documents are short
    with pytest.raises(DataError) as e:
        selection.select(corpus(lengths, [40]), 0.1, 50, ["x"])
    assert str(e.value) == ("data.min_doc_tokens=50 leaves no held-out document: the longest of the "
                            "4 held-out documents has 10 tokens; lower data.min_doc_tokens to 10 or "
                            "less, or raise data.heldout_fraction")
    lengths = np.concatenate([np.full(20, 100), np.full(20, 10)])
    with pytest.raises(DataError) as e:
        selection.select(corpus(lengths, [20, 20]), 0.1, 50, ["a.jsonl", "b.jsonl"])
    assert str(e.value).startswith("data.min_doc_tokens=50 leaves no training document in b.jsonl: "
                                   "the longest of the 18 training documents has 10 tokens")
    with pytest.raises(DataError, match=r"^b.jsonl: the corpus has 1 document\(s\)"):
        selection.select(corpus([5] * 21, [20, 1]), 0.1, 0, ["a.jsonl", "b.jsonl"])
