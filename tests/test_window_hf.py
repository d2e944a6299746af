"""The sliding window's convention against transformers' own Mistral mask: the mask function
its sliding-window layers build (``masking_utils.sliding_window_causal_mask_function``, the one
MistralModel passes to ``create_sliding_window_causal_mask``) equals ``predicate.visible``."""
import numpy as np
import pytest
import torch
from transformers import masking_utils

from parallel.kernels import predicate


@pytest.mark.parametrize("window", [1, 2, 5, 16, 40])
def test_visible_is_transformers_sliding_window_mask(window):
    length = 33
    theirs = masking_utils.sdpa_mask(
        batch_size=1, q_length=length, kv_length=length,
        mask_function=masking_utils.sliding_window_causal_mask_function(window),
        allow_is_causal_skip=False)
    pos = np.arange(length, dtype=np.int32)
    ours = predicate.visible(pos, pos, window=window)
    np.testing.assert_array_equal(ours, theirs[0, 0].numpy())
    assert theirs.dtype == torch.bool
    assert (ours.sum() < length * (length + 1) // 2) == (window < length)  # a band, or all
