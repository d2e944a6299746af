"""Packing, the held-out split, the layout permutation, and the loss's indifference to layout."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from errors import DataError
from data.batching import contiguous_block, from_layout, to_layout
from data.packing import KEYS, PackedPass, epoch_order
from data.split import heldout_split

EOS = 0
LAYOUTS = [("contiguous", 1), ("striped", 1), ("striped", 2), ("zigzag", 1)]


def corpus_of(docs):
    tokens = np.concatenate([np.asarray(d, np.uint16) for d in docs]) if docs else np.zeros(0, np.uint16)
    offsets = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype(np.int64)
    return tokens, offsets


def all_rows(docs, seq_len, reset=True, order=None):
    tokens, offsets = corpus_of(docs)
    order = np.arange(len(docs)) if order is None else order
    p = PackedPass(tokens, offsets, order, EOS, seq_len, reset)
    return p, p.rows(0, p.num_rows)


def random_docs(rng, n, vocab=50, max_len=40):
    return [rng.integers(1, vocab, size=rng.integers(1, max_len)).tolist() for _ in range(n)]


# -- packing --------------------------------------------------------------------------------
def test_packing_exact_small_example():
    _, rows = all_rows([[5, 6, 7], [8, 9]], seq_len=4)
    np.testing.assert_array_equal(rows["tokens"], [[0, 5, 6, 7], [0, 8, 9, 0]])
    np.testing.assert_array_equal(rows["labels"], [[5, 6, 7, 0], [8, 9, 0, 0]])
    np.testing.assert_array_equal(rows["segment_ids"], [[1, 1, 1, 1], [1, 1, 1, 0]])
    np.testing.assert_array_equal(rows["positions"], [[0, 1, 2, 3], [0, 1, 2, 0]])
    np.testing.assert_array_equal(rows["loss_mask"], [[1, 1, 1, 1], [1, 1, 1, 0]])
    assert rows["loss_mask"].dtype == np.float32
    assert all(rows[k].dtype == np.int32 for k in KEYS if k != "loss_mask")


def test_packing_two_documents_in_one_row_and_a_continued_document():
    _, rows = all_rows([[3, 4], [5, 6, 7, 8, 9, 10]], seq_len=6)
    # stream: 0 3 4 0 5 6 | 7 8 9 10 0(closing)
    assert rows["tokens"].shape == (2, 6)
    np.testing.assert_array_equal(rows["tokens"][0], [0, 3, 4, 0, 5, 6])
    np.testing.assert_array_equal(rows["labels"][0], [3, 4, 0, 5, 6, 7])
    np.testing.assert_array_equal(rows["segment_ids"][0], [1, 1, 1, 2, 2, 2])
    np.testing.assert_array_equal(rows["positions"][0], [0, 1, 2, 0, 1, 2])
    np.testing.assert_array_equal(rows["tokens"][1][:4], [7, 8, 9, 10])
    np.testing.assert_array_equal(rows["labels"][1][:4], [8, 9, 10, 0])
    # The continued document restarts at 0 in the new row; padding is its own run from 0.
    np.testing.assert_array_equal(rows["positions"][1], [0, 1, 2, 3, 0, 1])
    np.testing.assert_array_equal(rows["segment_ids"][1], [1, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(rows["loss_mask"][1], [1, 1, 1, 1, 0, 0])


@settings(max_examples=60, deadline=None)
@given(docs=st.lists(st.lists(st.integers(1, 99), min_size=0, max_size=30), min_size=1, max_size=12),
       seq_len=st.integers(1, 24), reset=st.booleans())
def test_packing_loses_and_duplicates_nothing(docs, seq_len, reset):
    p, rows = all_rows(docs, seq_len, reset)
    stream = np.array([t for d in docs for t in [EOS] + d] + [EOS])
    assert p.num_rows == -(-(stream.size - 1) // seq_len)
    valid = rows["loss_mask"] > 0
    # Every stream token is an input once and a label once, in order.
    np.testing.assert_array_equal(rows["tokens"][valid], stream[:-1])
    np.testing.assert_array_equal(rows["labels"][valid], stream[1:])
    np.testing.assert_array_equal(valid, rows["segment_ids"] > 0)
    # Only the last row pads, and only at its end.
    assert valid[:-1].all() and (np.diff(valid[-1].astype(int)) <= 0).all()
    for r in range(p.num_rows):
        tok, seg, pos, lab = (rows[k][r] for k in ("tokens", "segment_ids", "positions", "labels"))
        n = int(valid[r].sum())
        np.testing.assert_array_equal(lab[:n - 1], tok[1:n])  # labels are the next tokens
        starts = np.flatnonzero(tok[:n] == EOS)
        new_doc = np.zeros(n, bool)
        new_doc[0] = True
        new_doc[starts] = True
        np.testing.assert_array_equal(seg[:n], np.cumsum(new_doc))  # +1 exactly at each EOS
        if reset:
            expected = np.concatenate([np.arange(b - a) for a, b in
                                       zip(np.flatnonzero(new_doc), list(np.flatnonzero(new_doc)[1:]) + [n])])
            np.testing.assert_array_equal(pos[:n], expected)
            np.testing.assert_array_equal(pos[n:], np.arange(seq_len - n))
        else:
            np.testing.assert_array_equal(pos, np.arange(seq_len))
    if p.num_rows > 1:
        np.testing.assert_array_equal(rows["labels"][:-1, -1], rows["tokens"][1:, 0])


def test_rows_in_pieces_equal_rows_at_once():
    rng = np.random.default_rng(3)
    p, rows = all_rows(random_docs(rng, 30), seq_len=16)
    for first, count in [(0, 3), (5, 7), (p.num_rows - 2, 2)]:
        piece = p.rows(first, count)
        for k in KEYS:
            np.testing.assert_array_equal(piece[k], rows[k][first:first + count])


def test_epoch_order_is_a_fresh_deterministic_shuffle_per_epoch():
    ids = np.arange(3, 103)
    e0, e1 = epoch_order(ids, 7, 0), epoch_order(ids, 7, 1)
    np.testing.assert_array_equal(np.sort(e0), ids)
    np.testing.assert_array_equal(np.sort(e1), ids)
    np.testing.assert_array_equal(e0, epoch_order(ids, 7, 0))
    assert not np.array_equal(e0, e1)
    assert not np.array_equal(e0, epoch_order(ids, 8, 0))


# -- held-out split -------------------------------------------------------------------------
@pytest.mark.parametrize("n,fraction,held", [(100, 0.02, 2), (10, 0.02, 1), (2, 0.5, 1), (7, 0.0, 1),
                                             (1000, 0.1, 100)])
def test_heldout_split_sizes_and_disjointness(n, fraction, held):
    train, heldout = heldout_split(n, fraction)
    assert heldout.size == held and train.size == n - held
    assert np.intersect1d(train, heldout).size == 0
    np.testing.assert_array_equal(np.union1d(train, heldout), np.arange(n))
    np.testing.assert_array_equal(heldout, heldout_split(n, fraction)[1])


def test_heldout_split_errors():
    with pytest.raises(DataError, match="need at least 2"):
        heldout_split(1, 0.1)
    with pytest.raises(DataError, match=r"heldout_fraction=1.0 must be in \[0, 1\)"):
        heldout_split(10, 1.0)


# -- layouts --------------------------------------------------------------------------------
def natural_batch(seed=0, seq_len=32, reset=True):
    rng = np.random.default_rng(seed)
    p, rows = all_rows(random_docs(rng, 40), seq_len, reset)
    return {k: v[-4:] for k, v in rows.items()}  # the last rows include padding


@pytest.mark.parametrize("layout,stripe", LAYOUTS)
@pytest.mark.parametrize("shards", [1, 2, 4])
def test_layout_round_trip(layout, stripe, shards):
    nat = natural_batch()
    lay = to_layout(nat, layout, shards, stripe)
    back = from_layout(lay, layout, shards, stripe)
    for k in KEYS:
        assert lay[k].dtype == nat[k].dtype
        np.testing.assert_array_equal(back[k], nat[k])
        if layout != "contiguous" and shards > 1:
            assert not np.array_equal(lay[k], nat[k]) or k == "loss_mask"


def test_layout_places_the_documented_positions_on_each_shard():
    nat = natural_batch(seq_len=16, reset=False)  # positions are then the row index
    n, c = 4, 4
    striped = to_layout(nat, "striped", n)["positions"][0].reshape(n, c)
    np.testing.assert_array_equal(striped[1], [1, 5, 9, 13])
    striped2 = to_layout(nat, "striped", 2, 2)["positions"][0].reshape(2, 8)
    np.testing.assert_array_equal(striped2[1], [2, 3, 6, 7, 10, 11, 14, 15])
    zigzag = to_layout(nat, "zigzag", 2)["positions"][0].reshape(2, 8)
    np.testing.assert_array_equal(zigzag[0], [0, 1, 2, 3, 12, 13, 14, 15])
    np.testing.assert_array_equal(zigzag[1], [4, 5, 6, 7, 8, 9, 10, 11])


def test_contiguous_block_of_a_process():
    L = 32
    slices = [(slice(4, 6), slice(0, 16)), (slice(6, 8), slice(0, 16)),
              (slice(4, 6), slice(16, 32)), (slice(6, 8), slice(16, 32))]
    assert contiguous_block(slices, (8, L)) == (slice(4, 8), slice(0, 32))
    with pytest.raises(ValueError, match="non-contiguous"):
        contiguous_block([(slice(0, 2), slice(None)), (slice(4, 6), slice(None))], (8, L))


# -- the loss does not see the layout -------------------------------------------------------
def rope(x, pos):
    half = x.shape[-1] // 2
    freq = 1.0 / (10000.0 ** (np.arange(half) / half))
    ang = pos[..., None] * freq
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x1 * np.sin(ang) + x2 * np.cos(ang)], -1)


def tiny_lm_loss(batch, params):
    """Causal LM loss of a 1-layer attention model, float64, masks from positions and segments."""
    emb, wq, wk, wv, wo, head = params
    x = emb[batch["tokens"]]
    pos, seg = batch["positions"].astype(np.float64), batch["segment_ids"]
    q, k, v = rope(x @ wq, pos), rope(x @ wk, pos), x @ wv
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])
    visible = (seg[:, :, None] == seg[:, None, :]) & (pos[:, None, :] <= pos[:, :, None])
    scores = np.where(visible, scores, -np.inf)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    h = x + (w / w.sum(-1, keepdims=True)) @ v @ wo
    logits = h @ head
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    nll = logz - np.take_along_axis(logits, batch["labels"][..., None], -1)[..., 0]
    return (nll * batch["loss_mask"]).sum() / batch["loss_mask"].sum()


def random_params(vocab=50, d=16, seed=1):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=s) / np.sqrt(s[0]) for s in
            [(vocab, d), (d, d), (d, d), (d, d), (d, d), (d, vocab)]]


@pytest.mark.parametrize("reset", [True, False])
@pytest.mark.parametrize("layout,stripe", LAYOUTS)
def test_loss_is_the_same_in_every_layout(layout, stripe, reset):
    nat = natural_batch(seed=5, seq_len=32, reset=reset)
    params = random_params()
    expected = tiny_lm_loss(nat, params)
    got = tiny_lm_loss(to_layout(nat, layout, 4, stripe), params)
    np.testing.assert_allclose(got, expected, rtol=1e-12)
    # The check has teeth: tokens moved without their positions change the loss.
    wrong = dict(to_layout(nat, layout, 4, stripe), positions=nat["positions"])
    if layout != "contiguous":
        assert abs(tiny_lm_loss(wrong, params) - expected) > 1e-6
