"""The whole pipeline on the stdlib corpus over 8 simulated devices: format, sharding, layout,
a full pass, held-out split, and resuming the iterator."""
import json
import os

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from configs import base
from errors import DataError
from data.packing import KEYS, epoch_order
from data.pipeline import from_layout, make_pipeline
from parallel import layouts

AXES = ("data", "fsdp", "sequence", "tensor")


def make_mesh(data=1, fsdp=2, sequence=4, tensor=1):
    devices = np.array(jax.devices()[: data * fsdp * sequence * tensor])
    return Mesh(devices.reshape(data, fsdp, sequence, tensor), AXES)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("data_cache"))


def config(cache_dir, **data):
    c = base.get_config()
    c.model.vocab_size = 384
    c.attention.update(layout="striped", stripe=1)
    c.data.update(cache_dir=cache_dir, max_docs=24, seq_len=128, batch_size=4, prefetch=2,
                  heldout_fraction=0.1)
    c.data.update(data)
    return c


@pytest.fixture(scope="module")
def pipe(cache_dir):
    p = make_pipeline(config(cache_dir), make_mesh())
    yield p
    p.train.close()


def numpy_batch(batch):
    return {k: np.asarray(v) for k, v in batch.items()}


def test_batch_format_and_sharding(pipe):
    batch = next(pipe.train)
    assert set(batch) == set(KEYS)
    for k, v in batch.items():
        assert v.shape == (4, 128)
        assert v.dtype == (np.float32 if k == "loss_mask" else np.int32)
        assert v.sharding.spec == P(("data", "fsdp"), "sequence") and v.sharding.mesh == pipe.mesh
        # Each device holds exactly its block of the layout-order batch.
        host = np.asarray(v)
        for shard in v.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), host[shard.index])
    assert pipe.vocab_size == 384 and pipe.tokenizer.get_vocab_size() == 384
    tokens = np.asarray(batch["tokens"])
    assert tokens.min() >= 0 and tokens.max() < 384 and np.unique(tokens).size > 50


def test_device_batch_is_the_natural_batch_in_layout_order(pipe):
    nat = pipe.host_batch(8, natural=True)
    dev = numpy_batch(pipe.device_batch(8))
    back = from_layout(dev, "striped", 4, 1)
    for k in KEYS:
        np.testing.assert_array_equal(back[k], nat[k])
    # Striped, 4 shards: the first sequence shard holds natural columns 0, 4, 8, ...
    np.testing.assert_array_equal(dev["tokens"][:, :32], nat["tokens"][:, ::4])
    np.testing.assert_array_equal(nat["labels"][:, :-1], nat["tokens"][:, 1:])
    text = pipe.tokenizer.decode(nat["tokens"][0].tolist())
    assert len(text) > 200  # real source text, not ids of nothing


def collect_rows(pipe, first_row, num_rows):
    """Natural-order rows from the device batches the iterator yields, starting at first_row."""
    rows = []
    while sum(r["tokens"].shape[0] for r in rows) < num_rows:
        rows.append(from_layout(numpy_batch(next(pipe.train)), "striped", 4, 1))
    return {k: np.concatenate([r[k] for r in rows])[:num_rows] for k in KEYS}


def test_a_full_epoch_reads_every_training_document_once_in_the_shuffled_order(cache_dir):
    p = make_pipeline(config(cache_dir, shuffle_seed=3), make_mesh())
    try:
        R = p.rows_per_epoch
        rows = collect_rows(p, 0, R + 4)  # crosses into epoch 1
        valid = rows["loss_mask"][:R] > 0
        stream = rows["tokens"][:R][valid]
        order = epoch_order(p.train_ids, 3, 0)
        expected = np.concatenate([np.concatenate([[p.eos_id], p.corpus.doc(i)]) for i in order])
        np.testing.assert_array_equal(stream, expected)
        assert stream.size == p.tokens_per_epoch
        assert np.intersect1d(order, p.heldout_ids).size == 0
        # Epoch 1 starts on a fresh row with another order.
        order1 = epoch_order(p.train_ids, 3, 1)
        assert not np.array_equal(order, order1)
        first = np.concatenate([[p.eos_id], p.corpus.doc(order1[0])])[:128]
        np.testing.assert_array_equal(rows["tokens"][R][: first.size], first)
        assert p.train.state()["epoch"] == 1
    finally:
        p.train.close()


def test_state_round_trip_with_prefetch(cache_dir):
    mesh = make_mesh()
    a = make_pipeline(config(cache_dir), mesh)
    for _ in range(3):
        next(a.train)
    state = a.train.state()
    assert json.loads(json.dumps(state)) == state
    assert all(isinstance(v, (int, str)) for v in state.values())
    expected = [numpy_batch(next(a.train)) for _ in range(4)]
    a.train.close()

    b = make_pipeline(config(cache_dir), mesh)
    next(b.train)  # a running prefetch thread must be replaced by the restored position
    b.train.restore(state)
    got = [numpy_batch(next(b.train)) for _ in range(4)]
    b.train.close()
    for e, g in zip(expected, got):
        for k in KEYS:
            np.testing.assert_array_equal(g[k], e[k])
    assert not np.array_equal(expected[0]["tokens"], expected[1]["tokens"])


def test_restore_near_the_end_of_an_epoch_matches_the_uninterrupted_stream(pipe):
    R = pipe.rows_per_epoch
    state = dict(pipe.train.state(), epoch=2, row=R - 2)
    pipe.train.restore(state)
    got = numpy_batch(next(pipe.train))
    # Rows of epoch 2 and rows 0, 1 of epoch 3, built directly.
    direct = numpy_batch(pipe.device_batch(3 * R - 2))
    for k in KEYS:
        np.testing.assert_array_equal(got[k], direct[k])
    assert pipe.train.state()["epoch"] == 3 and pipe.train.state()["row"] == 2


def test_prefetch_does_not_change_the_batches(cache_dir):
    mesh = make_mesh()
    with_thread = make_pipeline(config(cache_dir, prefetch=3), mesh)
    inline = make_pipeline(config(cache_dir, prefetch=0), mesh)
    for _ in range(5):
        a, b = numpy_batch(next(with_thread.train)), numpy_batch(next(inline.train))
        for k in KEYS:
            np.testing.assert_array_equal(a[k], b[k])
    with_thread.train.close()


def test_restore_rejects_a_state_from_other_data(pipe):
    state = pipe.train.state()
    with pytest.raises(DataError, match=r"^data iterator state does not match this pipeline: "
                                        r"tokenizer is 'abc' in the checkpoint but"):
        pipe.train.restore(dict(state, tokenizer="abc"))
    with pytest.raises(DataError, match="lacks 'row'"):
        pipe.train.restore({k: v for k, v in state.items() if k != "row"})


def test_heldout_batches_are_fixed_and_come_from_heldout_documents(pipe):
    first = [numpy_batch(b) for b in pipe.heldout_batches(3)]
    again = [numpy_batch(b) for b in pipe.heldout_batches(3)]
    for a, b in zip(first, again):
        for k in KEYS:
            np.testing.assert_array_equal(a[k], b[k])
    held = np.concatenate([np.concatenate([[pipe.eos_id], pipe.corpus.doc(i)])
                           for i in pipe.heldout_ids])
    rows = pipe.heldout_rows(3)
    per_pass = -(-held.size // pipe.seq_len)  # packed rows of the held-out documents
    assert per_pass >= 3 * pipe.batch_size  # enough to spread: evenly over the whole set
    assert rows == [0, per_pass // 3, 2 * per_pass // 3]
    for row, b in zip(rows, first):
        nat = from_layout(b, "striped", 4, 1)
        mask = nat["loss_mask"] > 0
        start = row * pipe.seq_len
        want = held[start:start + pipe.batch_size * pipe.seq_len]
        np.testing.assert_array_equal(nat["tokens"][mask][:want.size], want)
    assert pipe.heldout_ids.size == round(0.1 * pipe.corpus.num_docs)


def test_heldout_batches_repeat_when_the_heldout_set_is_small(pipe):
    """More batches asked for than the held-out rows fill: consecutive rows, wrapping round."""
    per_pass = pipe._heldout_rows.rows_per_pass
    n = per_pass // pipe.batch_size + 2
    assert pipe.heldout_rows(n) == [i * pipe.batch_size for i in range(n)]
    wrapped = numpy_batch(pipe.heldout_batches(n)[-1])
    again = numpy_batch(pipe.device_batch((n - 1) * pipe.batch_size - per_pass, heldout=True))
    for k in KEYS:
        np.testing.assert_array_equal(wrapped[k], again[k])


@pytest.mark.parametrize("layout,stripe", [("contiguous", 1), ("striped", 2), ("zigzag", 1)])
def test_every_layout_and_positions_without_reset(cache_dir, layout, stripe):
    c = config(cache_dir, reset_positions_at_doc=False)
    c.attention.update(layout=layout, stripe=stripe)
    p = make_pipeline(c, make_mesh(fsdp=4, sequence=2))
    batch = numpy_batch(p.device_batch(0))
    perm = layouts.permutation(layout, 128, 2, stripe)
    np.testing.assert_array_equal(batch["positions"], np.broadcast_to(perm, (4, 128)))
    back = from_layout(batch, layout, 2, stripe)
    np.testing.assert_array_equal(back["tokens"], p.host_batch(0, natural=True)["tokens"])


def test_second_pipeline_reads_nothing_again(cache_dir, monkeypatch):
    p = make_pipeline(config(cache_dir), make_mesh())
    import data.sources as sources

    def fail(*a, **k):
        raise AssertionError("the source was read although the caches are warm")

    monkeypatch.setattr(sources, "documents", fail)
    q = make_pipeline(config(cache_dir), make_mesh())
    assert q.fingerprint == p.fingerprint and q.corpus_path == p.corpus_path
    assert os.path.isfile(q.tokenizer_path)


def test_loaded_tokenizer_json(pipe, cache_dir):
    p = make_pipeline(config(cache_dir, tokenizer=pipe.tokenizer_path), make_mesh())
    assert p.fingerprint == pipe.fingerprint and p.corpus_path == pipe.corpus_path
    c = config(cache_dir, tokenizer=pipe.tokenizer_path)
    c.model.vocab_size = 300
    with pytest.raises(DataError, match="has 384 tokens but model.vocab_size is 300"):
        make_pipeline(c, make_mesh())


def test_jsonl_source_end_to_end(tmp_path):
    import argparse, difflib, textwrap  # noqa: E401
    rows = [{"text": m.__doc__} for m in (argparse, difflib, textwrap, json, np)]
    with open(tmp_path / "docs.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    c = config(str(tmp_path / "cache"), source="jsonl", path=str(tmp_path / "docs.jsonl"),
               seq_len=64, heldout_fraction=0.2)
    c.model.vocab_size = 300
    p = make_pipeline(c, make_mesh())
    assert p.corpus.num_docs == 5 and p.heldout_ids.size == 1
    nat = from_layout(numpy_batch(next(p.train)), "striped", 4, 1)
    first_doc = p.corpus.doc(epoch_order(p.train_ids, 0, 0)[0])
    n = min(63, first_doc.size)
    np.testing.assert_array_equal(nat["tokens"][0, 1:1 + n], first_doc[:n])
    assert p.tokenizer.decode(first_doc.tolist()) in [r["text"] for r in rows]
    p.train.close()


@pytest.mark.parametrize("change,message", [
    (dict(batch_size=5), "data.batch_size=5 is not divisible by the data x fsdp mesh axes (2)"),
    (dict(seq_len=90), "data.seq_len / attention.layout: seq_len 90 is not divisible"),
    (dict(heldout_fraction=1.5), "data.heldout_fraction=1.5 must be in [0, 1)"),
    (dict(max_docs=-3), "data.max_docs=-3 must be >= 0"),
])
def test_shape_errors(cache_dir, change, message):
    with pytest.raises(DataError) as e:
        make_pipeline(config(cache_dir, **change), make_mesh())
    assert message in str(e.value) and "\n" not in str(e.value)


def test_empty_corpus_and_too_small_vocab(tmp_path):
    (tmp_path / "empty.jsonl").write_text(json.dumps({"text": ""}) + "\n")
    c = config(str(tmp_path / "cache"), source="jsonl", path=str(tmp_path / "empty.jsonl"))
    with pytest.raises(DataError, match=r"^no documents in jsonl file .*empty.jsonl: the corpus is empty$"):
        make_pipeline(c, make_mesh())
    c = config(str(tmp_path / "cache"))
    c.model.vocab_size = 200
    with pytest.raises(DataError, match=r"^model.vocab_size=200 is too small"):
        make_pipeline(c, make_mesh())


# -- long-context data: length filter, upsampling, mixture (random documents) -----------------
def random_texts(rng, n, long_every=3):
    """``n`` documents of random words; every ``long_every``-th or so is long."""
    words = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), size=rng.integers(2, 8)))
             for _ in range(150)]
    sizes = np.where(rng.random(n) < 1 / long_every, rng.integers(150, 400, n), rng.integers(3, 40, n))
    return [" ".join(rng.choice(words, size=s)) for s in sizes]


def write_jsonl(path, texts):
    with open(path, "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    return str(path)


def long_config(tmp_path, **data):
    c = config(str(tmp_path / "cache"), source="jsonl", max_docs=0, seq_len=128, **data)
    c.model.vocab_size = 300
    return c


def epoch_stream(p):
    """Epoch 0's valid input tokens, read through host_batch, and the stream they must be."""
    R = p.rows_per_epoch
    rows = [p.host_batch(r, natural=True) for r in range(0, R, p.batch_size)]
    rows = {k: np.concatenate([r[k] for r in rows])[:R] for k in ("tokens", "loss_mask")}
    order = epoch_order(p.epoch_docs, p.shuffle_seed, 0)
    want = np.concatenate([np.concatenate([[p.eos_id], p.corpus.doc(i)]) for i in order])
    return rows["tokens"][rows["loss_mask"] > 0], want, order


def test_min_doc_tokens_and_upsampling_over_a_real_epoch(tmp_path, rng):
    texts = random_texts(rng, 40)
    path = write_jsonl(tmp_path / "docs.jsonl", texts)
    plain = make_pipeline(long_config(tmp_path, path=path), make_mesh())
    # Token counts computed here, apart from the corpus cache: the tokenizer's own encoding.
    counts = np.array([len(plain.tokenizer.encode(t, add_special_tokens=False).ids) for t in texts])
    np.testing.assert_array_equal(plain.corpus.lengths, counts)
    # Drops about a third, keeping a held-out document.
    m = min(int(np.sort(counts)[len(counts) // 3]), int(counts[plain.heldout_ids].max()))
    long_tokens, k = int(np.sort(counts)[-8]), int(rng.integers(2, 4))
    p = make_pipeline(long_config(tmp_path, path=path, min_doc_tokens=m, long_doc_tokens=long_tokens,
                                  long_doc_upsample=k), make_mesh())
    assert p.fingerprint == plain.fingerprint and p.corpus_path == plain.corpus_path  # no re-tokenizing
    kept = np.flatnonzero(counts >= m)
    np.testing.assert_array_equal(np.union1d(p.train_ids, p.heldout_ids), kept)
    assert np.isin(p.heldout_ids, plain.heldout_ids).all()  # the split does not move
    np.testing.assert_array_equal(p.train_ids, plain.train_ids[counts[plain.train_ids] >= m])
    got, want, order = epoch_stream(p)
    np.testing.assert_array_equal(got, want)
    times = np.bincount(order, minlength=counts.size)
    np.testing.assert_array_equal(times[p.train_ids], np.where(counts[p.train_ids] >= long_tokens, k, 1))
    assert times[p.heldout_ids].sum() == 0 and got.size == p.tokens_per_epoch
    line = p.plan_line()
    assert f"min_doc_tokens={m} kept {kept.size} of 40 documents ({40 - kept.size} dropped" in line
    assert f"training documents of >= {long_tokens} tokens x{k}" in line and "\n" not in line
    assert plain.plan_line() == ""
    plain.close()
    p.close()


def test_mixture_shares_over_a_real_epoch(tmp_path, rng):
    a = write_jsonl(tmp_path / "a.jsonl", random_texts(rng, 30))
    b = write_jsonl(tmp_path / "b.jsonl", random_texts(rng, 12))
    weights = [float(rng.uniform(0.5, 1.0)), float(rng.uniform(1.0, 3.0))]
    p = make_pipeline(long_config(tmp_path, mixture=f"{a}={weights[0]},{b}={weights[1]}",
                                  shuffle_seed=int(rng.integers(100))), make_mesh())
    assert p.corpus.num_parts == 2 and p.corpus.part_offsets.tolist() == [0, 30, 42]
    got, want, order = epoch_stream(p)
    np.testing.assert_array_equal(got, want)
    lengths = p.corpus.lengths
    per_source = np.array([(lengths[order[order < 30]] + 1).sum(), (lengths[order[order >= 30]] + 1).sum()])
    # Whole documents: each source misses its share by at most half its longest document.
    tolerance = (lengths.max() + 1) / per_source.sum()
    np.testing.assert_allclose(per_source / per_source.sum(), np.array(weights) / sum(weights),
                               atol=tolerance)
    assert np.isin(order, p.heldout_ids).sum() == 0
    assert 0 < np.isin(p.heldout_ids, np.arange(30)).sum() < p.heldout_ids.size  # held out of both
    line = p.plan_line()
    assert f"per source: jsonl file {a} {per_source[0]} tokens" in line and f"jsonl file {b}" in line
    p.close()


def test_resume_is_exact_with_the_long_context_options(tmp_path, rng):
    a = write_jsonl(tmp_path / "a.jsonl", random_texts(rng, 20))
    b = write_jsonl(tmp_path / "b.jsonl", random_texts(rng, 20))
    mesh = make_mesh()
    options = dict(mixture=f"{a}=1,{b}=2.5", min_doc_tokens=20, long_doc_tokens=200, long_doc_upsample=3,
                   heldout_fraction=0.3)  # many held-out documents: some are long enough
    first = make_pipeline(long_config(tmp_path, **options), mesh)
    for _ in range(5):
        next(first.train)
    state = first.train.state()
    assert json.loads(json.dumps(state)) == state and state["data_plan"]
    expected = [numpy_batch(next(first.train)) for _ in range(3)]
    first.close()
    again = make_pipeline(long_config(tmp_path, **options), mesh)
    next(again.train)
    again.train.restore(state)
    for e in expected:
        g = numpy_batch(next(again.train))
        for key in KEYS:
            np.testing.assert_array_equal(g[key], e[key])
    again.close()
    other = make_pipeline(long_config(tmp_path, **dict(options, mixture=f"{a}=2,{b}=1")), mesh)
    with pytest.raises(DataError, match=r"^data iterator state does not match this pipeline: "
                                        r"(documents|data_plan) is .* now \(.*mixture.*\)$"):
        other.train.restore(state)
    other.close()


def test_a_state_from_before_the_options_restores_on_the_plain_pass(tmp_path, rng):
    path = write_jsonl(tmp_path / "docs.jsonl", random_texts(rng, 20))
    plain = make_pipeline(long_config(tmp_path, path=path, prefetch=0), make_mesh())
    next(plain.train)
    old = {k: v for k, v in plain.train.state().items() if k != "data_plan"}
    # A filter that drops nothing leaves the same data: the old state fits.
    same = make_pipeline(long_config(tmp_path, path=path, prefetch=0, min_doc_tokens=1), make_mesh())
    same.train.restore(old)
    np.testing.assert_array_equal(np.asarray(next(same.train)["tokens"]),
                                  np.asarray(next(plain.train)["tokens"]))
    longest = int(plain.corpus.lengths[plain.train_ids].max())
    upsampled = make_pipeline(long_config(tmp_path, path=path, prefetch=0, long_doc_tokens=longest,
                                          long_doc_upsample=2), make_mesh())
    with pytest.raises(DataError, match="does not match this pipeline"):
        upsampled.train.restore(old)


def test_a_mixture_keys_the_caches(tmp_path, rng, monkeypatch):
    a = write_jsonl(tmp_path / "a.jsonl", random_texts(rng, 10))
    b = write_jsonl(tmp_path / "b.jsonl", random_texts(rng, 10))
    alone = make_pipeline(long_config(tmp_path, path=a, prefetch=0), make_mesh())
    mixed = make_pipeline(long_config(tmp_path, mixture=f"{a}=1,{b}=1", prefetch=0), make_mesh())
    assert mixed.corpus_path != alone.corpus_path and mixed.tokenizer_path != alone.tokenizer_path
    import data.sources as sources
    with monkeypatch.context() as m:  # other weights: the same tokenizer and tokens, nothing read
        m.setattr(sources, "documents", lambda *a, **k: (_ for _ in ()).throw(AssertionError("read")))
        reweighted = make_pipeline(long_config(tmp_path, mixture=f"{a}=3,{b}=1", prefetch=0), make_mesh())
    assert (reweighted.corpus_path, reweighted.fingerprint) == (mixed.corpus_path, mixed.fingerprint)
    write_jsonl(b, random_texts(rng, 11))  # a changed part is a new corpus
    changed = make_pipeline(long_config(tmp_path, mixture=f"{a}=1,{b}=1", prefetch=0), make_mesh())
    assert changed.corpus_path != mixed.corpus_path and changed.corpus.num_docs == 21
    swapped = make_pipeline(long_config(tmp_path, mixture=f"{b}=1,{a}=1", prefetch=0), make_mesh())
    assert swapped.corpus.part_offsets.tolist() == [0, 11, 21]


@pytest.mark.parametrize("change,message", [
    (dict(min_doc_tokens=-2), "data.min_doc_tokens=-2 must be >= 0"),
    (dict(mixture="{a}=-1"), "weight '-1' must be a finite number > 0"),
    (dict(mixture="{a}"), "is not PATH=WEIGHT"),
    (dict(mixture="{a}=1", path="{a}"), "data.path='{a}' and data.mixture are both set"),
    (dict(mixture="{a}=1,{tmp}/nope*.jsonl=1"), "data.mixture: no jsonl file matches"),
    (dict(path="{a}", min_doc_tokens=100000), "data.min_doc_tokens=100000 leaves no training document: "
                                             "the longest of the"),
    (dict(mixture="{a}=1,{tmp}/empty.jsonl=1"), "empty.jsonl: a data.mixture entry is empty"),
])
def test_long_context_mistakes_are_one_line(tmp_path, rng, change, message):
    a = write_jsonl(tmp_path / "a.jsonl", random_texts(rng, 8))
    write_jsonl(tmp_path / "empty.jsonl", [""])
    change = {k: v.format(a=a, tmp=tmp_path) if isinstance(v, str) else v for k, v in change.items()}
    with pytest.raises(DataError) as e:
        make_pipeline(long_config(tmp_path, **change), make_mesh())
    assert message.format(a=a) in str(e.value) and "\n" not in str(e.value)


def test_a_token_cache_from_before_parts_holds_one_part(tmp_path, rng):
    from data import tokens
    path = write_jsonl(tmp_path / "docs.jsonl", random_texts(rng, 6))
    p = make_pipeline(long_config(tmp_path, path=path, prefetch=0), make_mesh())
    meta_path = os.path.join(p.corpus_path, "meta.json")
    with open(meta_path) as f:
        meta = json.load(f)
    assert meta["part_docs"] == [6]
    del meta["part_docs"]
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    assert tokens.load(p.corpus_path).part_offsets.tolist() == [0, 6]
