"""Token layouts: exact small permutations, what each shard holds, errors, round trips."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from errors import LayoutError
from parallel.layouts import LAYOUTS, check, inverse, permutation


@pytest.mark.parametrize("layout,seq_len,n,stripe,want", [
    ("contiguous", 8, 2, 1, [0, 1, 2, 3, 4, 5, 6, 7]),
    ("contiguous", 6, 3, 1, [0, 1, 2, 3, 4, 5]),
    ("striped", 8, 2, 1, [0, 2, 4, 6, 1, 3, 5, 7]),
    ("striped", 12, 3, 1, [0, 3, 6, 9, 1, 4, 7, 10, 2, 5, 8, 11]),
    ("striped", 8, 2, 2, [0, 1, 4, 5, 2, 3, 6, 7]),
    ("striped", 16, 2, 4, [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15]),
    ("striped", 16, 4, 2, [0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15]),
    ("zigzag", 8, 2, 1, [0, 1, 6, 7, 2, 3, 4, 5]),
    ("zigzag", 8, 4, 1, [0, 7, 1, 6, 2, 5, 3, 4]),
    ("zigzag", 12, 2, 1, [0, 1, 2, 9, 10, 11, 3, 4, 5, 6, 7, 8]),
])
def test_known_permutations(layout, seq_len, n, stripe, want):
    perm = permutation(layout, seq_len, n, stripe)
    assert perm.dtype == np.int32
    np.testing.assert_array_equal(perm, want)


def test_single_shard_is_identity_for_every_layout():
    for layout in LAYOUTS:
        np.testing.assert_array_equal(permutation(layout, 16, 1), np.arange(16))


@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_striped_shard_holds_every_nth_token(n):
    seq_len = 8 * n
    shards = permutation("striped", seq_len, n).reshape(n, -1)
    for d in range(n):
        np.testing.assert_array_equal(shards[d], np.arange(d, seq_len, n))


@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_zigzag_shard_holds_chunks_d_and_mirror(n):
    seq_len = 6 * n
    chunks = np.arange(seq_len).reshape(2 * n, -1)
    shards = permutation("zigzag", seq_len, n).reshape(n, -1)
    for d in range(n):
        np.testing.assert_array_equal(shards[d], np.concatenate([chunks[d], chunks[2 * n - 1 - d]]))


def test_layout_in_use_moves_data_and_inverse_restores_it():
    x = np.arange(16) * 10
    perm = permutation("striped", 16, 4)
    x_layout = x[..., perm]
    assert list(x_layout[:4]) == [0, 40, 80, 120]  # shard 0 holds tokens 0, 4, 8, 12
    np.testing.assert_array_equal(x_layout[..., inverse(perm)], x)


@pytest.mark.parametrize("args,message", [
    (("diagonal", 8, 2), "unknown layout 'diagonal'; valid layouts: contiguous, striped, zigzag"),
    (("contiguous", 10, 4), "seq_len 10 is not divisible by the number of shards (4) for the contiguous "
                            "layout; use a multiple of 4, e.g. 8"),
    (("striped", 12, 2, 4), "seq_len 12 is not divisible by shards x stripe width (2 x 4 = 8) for the "
                            "striped layout; use a multiple of 8, e.g. 8"),
    (("zigzag", 12, 4), "seq_len 12 is not divisible by 2 x shards (2 x 4 = 8) for the zigzag layout; "
                        "use a multiple of 8, e.g. 8"),
    (("zigzag", 4, 4), "seq_len 4 is not divisible by 2 x shards (2 x 4 = 8) for the zigzag layout; "
                       "use a multiple of 8, e.g. 8"),
    (("striped", 8, 0), "num_shards must be >= 1, got 0"),
    (("striped", 8, 2, 0), "stripe width must be >= 1, got 0"),
    (("contiguous", 0, 2), "seq_len must be >= 1, got 0"),
])
def test_clear_errors(args, message):
    with pytest.raises(LayoutError) as e:
        permutation(*args)
    assert str(e.value) == message
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError):  # LayoutError is a ValueError for callers that catch those
        check(*args)


@st.composite
def valid_args(draw):
    layout = draw(st.sampled_from(LAYOUTS))
    n = draw(st.integers(1, 16))
    stripe = draw(st.integers(1, 8)) if layout == "striped" else 1
    unit = {"contiguous": n, "striped": n * stripe, "zigzag": 2 * n}[layout]
    return layout, unit * draw(st.integers(1, 12)), n, stripe


@settings(max_examples=300, deadline=None)
@given(valid_args())
def test_inverse_round_trips(args):
    layout, seq_len, n, stripe = args
    perm = permutation(layout, seq_len, n, stripe)
    inv = inverse(perm)
    np.testing.assert_array_equal(np.sort(perm), np.arange(seq_len))  # a permutation
    np.testing.assert_array_equal(perm[inv], np.arange(seq_len))
    np.testing.assert_array_equal(inv[perm], np.arange(seq_len))
    x = np.random.default_rng().standard_normal((2, seq_len))
    np.testing.assert_array_equal(x[..., perm][..., inv], x)
