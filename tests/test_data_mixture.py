"""The epoch's composition on random document lengths: mixture shares, long-document upsampling,
determinism, and one-line errors for bad data.mixture / long-context values."""
import numpy as np
import pytest

from configs import base
from data import mixture
from errors import DataError


def random_parts(rng, sizes, max_len=400):
    """Per-source training ids (consecutive, as in a corpus) and every document's length."""
    lengths = rng.integers(1, max_len, size=sum(sizes))
    ends = np.cumsum(sizes)
    parts = [np.arange(e - n, e, dtype=np.int64) for n, e in zip(sizes, ends)]
    return parts, lengths


def tokens_by_part(plan, parts, lengths):
    counts = np.bincount(plan.documents, minlength=lengths.size)
    return np.array([int((counts[p] * (lengths[p] + 1)).sum()) for p in parts])


def test_shares_match_the_weights(rng):
    sizes = [int(n) for n in rng.integers(20, 200, size=3)]
    parts, lengths = random_parts(rng, sizes)
    weights = [float(w) for w in rng.uniform(0.2, 5.0, size=3)]
    plan = mixture.plan(parts, lengths, weights, 0, 1, seed=int(rng.integers(1 << 30)))
    got = tokens_by_part(plan, parts, lengths)
    natural = sum(int((lengths[p] + 1).sum()) for p in parts)
    # Each source misses its target by at most half a document; the epoch keeps its size.
    slack = (lengths.max() + 1) / 2
    targets = natural * np.array(weights) / sum(weights)
    assert np.all(np.abs(got - targets) <= slack), (got, targets)
    assert abs(got.sum() - natural) <= 3 * slack
    np.testing.assert_allclose(got / got.sum(), np.array(weights) / sum(weights),
                               atol=3 * slack / got.sum())
    assert [s.tokens for s in plan.shares] == got.tolist()
    # Documents are whole: every chosen id belongs to its source, none invented.
    assert set(plan.documents.tolist()) <= set(np.concatenate(parts).tolist())


def test_a_source_above_its_size_repeats_whole_and_the_rest_is_a_random_subset(rng):
    parts, lengths = random_parts(rng, [50, 50])
    lengths[:] = 9  # every document 10 tokens with its EOS: shares are exact
    plan = mixture.plan(parts, lengths, [3.0, 1.0], 0, 1, seed=7)
    counts = np.bincount(plan.documents, minlength=100)
    assert set(counts[:50]) == {1, 2} and counts[:50].sum() == 75  # 1.5 passes
    assert set(counts[50:]) == {0, 1} and counts[50:].sum() == 25  # half a pass
    other = mixture.plan(parts, lengths, [3.0, 1.0], 0, 1, seed=8)
    again = mixture.plan(parts, lengths, [3.0, 1.0], 0, 1, seed=7)
    np.testing.assert_array_equal(again.documents, plan.documents)  # deterministic in the seed
    assert not np.array_equal(np.sort(other.documents), np.sort(plan.documents))


@pytest.mark.parametrize("mixed", [False, True])
def test_long_documents_appear_k_times(rng, mixed):
    parts, lengths = random_parts(rng, [60, 40])
    k, long_tokens = int(rng.integers(2, 5)), int(rng.integers(100, 300))
    long = lengths >= long_tokens
    copies = np.where(long, k, 1)
    # Weights equal to the sources' upsampled sizes: the mixture keeps each source whole.
    weights = [float(((lengths[p] + 1) * copies[p]).sum()) for p in parts] if mixed else None
    plan = mixture.plan(parts, lengths, weights, long_tokens, k, seed=0)
    np.testing.assert_array_equal(np.bincount(plan.documents, minlength=lengths.size), copies)
    assert plan.upsampled == int(long.sum())


def test_without_options_the_plan_is_one_plain_pass(rng):
    parts, lengths = random_parts(rng, [30])
    plan = mixture.plan(parts, lengths, None, 0, 1, seed=3)
    np.testing.assert_array_equal(plan.documents, parts[0])
    assert mixture.digest(plan.documents) == mixture.digest(parts[0].copy())
    assert mixture.digest(plan.documents[::-1]) != mixture.digest(plan.documents)


def test_parse():
    assert mixture.parse("") == []
    got = mixture.parse(" books/*.jsonl=2, web/year=2024=0.5 ,code.jsonl=1e-1")
    assert got == [mixture.Entry("books/*.jsonl", 2.0), mixture.Entry("web/year=2024", 0.5),
                   mixture.Entry("code.jsonl", 0.1)]


@pytest.mark.parametrize("spec,message", [
    ("a.jsonl", "data.mixture entry 'a.jsonl' is not PATH=WEIGHT (e.g. books/*.jsonl=2)"),
    ("=3", "data.mixture entry '=3' is not PATH=WEIGHT"),
    ("a.jsonl=2,,b.jsonl=1", "data.mixture='a.jsonl=2,,b.jsonl=1' has an empty entry; valid: PATH=WEIGHT,PATH=WEIGHT"),
    ("a.jsonl=two", "data.mixture entry 'a.jsonl=two': weight 'two' is not a number"),
    ("a.jsonl=-1", "data.mixture entry 'a.jsonl=-1': weight '-1' must be a finite number > 0"),
    ("a.jsonl=0", "weight '0' must be a finite number > 0 (leave the source out instead of weighting it 0)"),
    ("a.jsonl=inf", "weight 'inf' must be a finite number > 0"),
])
def test_malformed_mixture_is_one_line(spec, message):
    with pytest.raises(DataError) as e:
        mixture.parse(spec)
    assert message in str(e.value) and "\n" not in str(e.value)


def data_cfg(**kw):
    d = base.get_config().data
    d.update(kw)
    return d


@pytest.mark.parametrize("fields,message", [
    (dict(min_doc_tokens=-1), "data.min_doc_tokens=-1 must be >= 0 (0 keeps every document)"),
    (dict(long_doc_tokens=-5), "data.long_doc_tokens=-5 must be >= 0"),
    (dict(long_doc_tokens=100, long_doc_upsample=0), "data.long_doc_upsample=0 must be >= 1"),
    (dict(long_doc_upsample=3), "data.long_doc_upsample=3 needs data.long_doc_tokens > 0"),
    (dict(mixture="a.jsonl=1"), "data.mixture needs data.source text, jsonl, parquet, hf or tfds"),
    (dict(source="jsonl", path="x.jsonl", mixture="a.jsonl=1"),
     "data.path='x.jsonl' and data.mixture are both set"),
    (dict(source="jsonl", mixture="a.jsonl:1"), "data.mixture entry 'a.jsonl:1' is not PATH=WEIGHT"),
])
def test_bad_fields_are_one_line(fields, message):
    with pytest.raises(DataError) as e:
        mixture.check_fields(data_cfg(**fields))
    assert message in str(e.value) and "\n" not in str(e.value)
    mixture.check_fields(data_cfg())  # the defaults are fine
