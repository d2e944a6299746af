"""model/rope.py against transformers' own RoPE (the definition an imported checkpoint expects)."""
import math

import jax.numpy as jnp
import numpy as np
import pytest

from model.rope import SCALINGS, Rope, check

# The reference, from requirements-test.txt (make test installs it).
import torch  # noqa: E402
from transformers import LlamaConfig  # noqa: E402
from transformers.models.llama.modeling_llama import (  # noqa: E402
    LlamaRotaryEmbedding, apply_rotary_pos_emb)


def random_case(rng, scaling: str, head_dim: int):
    """(HF rope_scaling dict or None, our Rope, HF max_position_embeddings) for one scaling."""
    theta = float(10 ** rng.uniform(3, 6))
    factor = float(rng.choice([2.0, 4.0, 8.0, 16.0]))
    orig = int(rng.choice([32, 64, 256]))
    if scaling == "none":
        return None, Rope(theta=theta), orig
    if scaling == "linear":
        return ({"rope_type": "linear", "factor": factor},
                Rope(theta=theta, scaling="linear", factor=factor), orig)
    if scaling == "dynamic":  # transformers grows the base past max_position_embeddings
        return ({"rope_type": "dynamic", "factor": factor},
                Rope(theta=theta, scaling="dynamic", factor=factor, original_max_len=orig), orig)
    if scaling == "yarn":
        fast, slow = float(rng.uniform(16, 48)), float(rng.uniform(0.5, 2))
        attention = float(rng.uniform(0.8, 1.5)) if rng.random() < 0.5 else None
        hf = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": orig,
              "beta_fast": fast, "beta_slow": slow}
        if attention is not None:
            hf["attention_factor"] = attention
        ours = Rope(theta=theta, scaling="yarn", factor=factor, original_max_len=orig,
                    beta_fast=fast, beta_slow=slow, attention_factor=attention or 0.0)
        return hf, ours, int(orig * factor)
    low = float(rng.uniform(0.5, 2))
    high = float(low + rng.uniform(1, 4))
    return ({"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
             "high_freq_factor": high, "original_max_position_embeddings": orig},
            Rope(theta=theta, scaling="llama3", factor=factor, original_max_len=orig,
                 low_freq_factor=low, high_freq_factor=high), int(orig * factor))


def hf_rotary(hf_scaling, theta, head_dim, max_pos):
    heads = 2
    config = LlamaConfig(hidden_size=head_dim * heads, num_attention_heads=heads,
                         rope_theta=theta, rope_scaling=hf_scaling, max_position_embeddings=max_pos)
    return LlamaRotaryEmbedding(config)


@pytest.mark.parametrize("scaling", SCALINGS)
def test_frequencies_and_scale_match_transformers(rng, scaling):
    for head_dim in (16, 64, 128):
        hf_scaling, ours, max_pos = random_case(rng, scaling, head_dim)
        emb = hf_rotary(hf_scaling, ours.theta, head_dim, max_pos)
        # Both sides are float32 and round differently (llama3's smooth blend of freq and
        # freq / factor): 1.2e-6 apart was seen for a random case, so a few float32 ulps more.
        np.testing.assert_allclose(ours.inv_freq(head_dim), emb.inv_freq.numpy(), rtol=1e-5)
        assert math.isclose(ours.cos_scale(), emb.attention_scaling, rel_tol=1e-12)


@pytest.mark.parametrize("scaling", SCALINGS)
def test_rotation_matches_transformers_past_the_original_context(rng, scaling):
    """q and k rotated at random positions up to 8x the original context, dynamic included
    (whose base grows with the largest position of the call)."""
    head_dim, B, L, H = 32, 2, 24, 3
    hf_scaling, ours, max_pos = random_case(rng, scaling, head_dim)
    orig = ours.original_max_len or max_pos
    pos = np.sort(rng.integers(0, 8 * orig, (B, L)), axis=1)
    q = rng.standard_normal((B, L, H, head_dim)).astype(np.float32)
    k = rng.standard_normal((B, L, H, head_dim)).astype(np.float32)
    emb = hf_rotary(hf_scaling, ours.theta, head_dim, max_pos)
    with torch.no_grad():
        cos, sin = emb(torch.tensor(q), torch.tensor(pos))
        want_q, want_k = apply_rotary_pos_emb(torch.tensor(q).transpose(1, 2),
                                              torch.tensor(k).transpose(1, 2), cos, sin)
    got_q = np.asarray(ours(jnp.asarray(q), jnp.asarray(pos)))
    got_k = np.asarray(ours(jnp.asarray(k), jnp.asarray(pos)))
    # fp32 angles of positions in the thousands carry ~1e-4 rad of rounding in both.
    np.testing.assert_allclose(got_q, want_q.transpose(1, 2).numpy(), atol=2e-3)
    np.testing.assert_allclose(got_k, want_k.transpose(1, 2).numpy(), atol=2e-3)


def test_dynamic_matches_float64_ntk_formula(rng):
    """The grown base against the NTK-aware formula in float64, positions past the original."""
    d, orig, factor, theta = 64, 128, 4.0, 10000.0
    r = Rope(theta=theta, scaling="dynamic", factor=factor, original_max_len=orig)
    pos = rng.integers(0, 6 * orig, (1, 16))
    n = max(int(pos.max()) + 1, orig)
    base = theta * (factor * n / orig - (factor - 1)) ** (d / (d - 2))
    want = pos[..., None] / base ** (np.arange(0, d, 2) / d)
    np.testing.assert_allclose(np.asarray(r.angles(jnp.asarray(pos), d)), want, rtol=1e-5, atol=1e-4)
    short = rng.integers(0, orig, (1, 16))  # inside the original context: the plain base
    np.testing.assert_allclose(np.asarray(r.angles(jnp.asarray(short), d)),
                               short[..., None] * Rope(theta=theta).inv_freq(d), rtol=1e-6)


def test_rotation_follows_the_positions_not_the_index(rng):
    """Permuting tokens and their positions together permutes the result (layouts rely on it)."""
    r = Rope(theta=5e5, scaling="yarn", factor=4.0, original_max_len=64)
    x = rng.standard_normal((1, 32, 2, 16)).astype(np.float32)
    pos = np.arange(32)[None] * 7
    perm = rng.permutation(32)
    whole = np.asarray(r(jnp.asarray(x), jnp.asarray(pos)))
    permuted = np.asarray(r(jnp.asarray(x[:, perm]), jnp.asarray(pos[:, perm])))
    np.testing.assert_allclose(permuted, whole[:, perm], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rope, says", [
    (Rope(theta=0.0), "rope_theta=0.0 must be > 0"),
    (Rope(scaling="ntk"), "rope_scaling.type='ntk' is not one of none, linear"),
    (Rope(scaling="linear", factor=0.5), "rope_scaling.factor=0.5 must be >= 1"),
    (Rope(scaling="yarn", factor=4.0), "rope_scaling.original_max_len=0: yarn scaling needs"),
    (Rope(scaling="llama3", factor=8.0, original_max_len=64, low_freq_factor=4.0,
          high_freq_factor=1.0), "rope_scaling.high_freq_factor=1.0 must exceed"),
])
def test_bad_scaling_is_one_line(rope, says):
    problem = check(rope)
    assert problem is not None and says in problem and "\n" not in problem


def test_validate_names_the_field():
    from configs import tiny
    from errors import ConfigError
    from configs.validate import validate
    c = tiny.get_config()
    c.model.rope_scaling.type = "dynamic"
    with pytest.raises(ConfigError, match=r"^model\.rope_scaling\.original_max_len=0: dynamic"):
        validate(c, 8)
    c.model.rope_scaling.original_max_len = 256
    validate(c, 8)
