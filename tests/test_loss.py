"""The chunked loss equals the full-logits cross-entropy in float64, values and gradients, on
every mesh split (the whole decoder's chunked loss and MLP against the full logits:
tests/test_state.py::test_sharded_step_equals_single_device_step; that the chunked step never
holds the whole logits: tests/test_plan.py::test_chunked_loss_and_microbatches_lower_the_compiled_memory)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from model.chunks import num_chunks
from model.loss import chunked_token_losses
from parallel.mesh import make_mesh


def rms(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-5) * scale


def full_loss(x_BLD, scale_D, head_DV, labels_BL, mask_BL):
    logits = jnp.einsum("bld,dv->blv", rms(x_BLD, scale_D), head_DV)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels_BL) * mask_BL


def test_num_chunks():
    assert num_chunks(16, 0) == (1, 16) and num_chunks(16, 32) == (1, 16)
    assert num_chunks(16, 4) == (4, 4) and num_chunks(16, 6) == (3, 6)


@pytest.mark.parametrize("mesh,chunk,vocab_major", [
    ({"data": 1, "fsdp": 2, "sequence": 4, "tensor": 1}, 6, False),  # 6 + 6 + 4 (padded)
    ({"data": 1, "fsdp": 2, "sequence": 2, "tensor": 2}, 8, False),  # vocab over tensor
    # one chunk per slice: no remat (map_chunks' remat_one=False), the padded vocab over tensor
    ({"data": 1, "fsdp": 2, "sequence": 2, "tensor": 2}, 0, False),
    (None, 5, False),
    # a tied head: the embedding table [V, D] as it is (head_VD), padded and split over tensor
    ({"data": 1, "fsdp": 2, "sequence": 2, "tensor": 2}, 8, True),
    (None, 0, True),
])
def test_chunked_equals_full_in_float64(mesh, chunk, vocab_major):
    with jax.enable_x64(True):
        rng = np.random.default_rng()
        B, L, D, V = 4, 64, 24, 37  # an odd vocabulary: split over tensor=2 it is padded
        x = jnp.asarray(rng.normal(size=(B, L, D)))
        scale = jnp.asarray(1 + 0.1 * rng.normal(size=(D,)))
        head = jnp.asarray(rng.normal(size=(D, V)) / np.sqrt(D))
        labels = jnp.asarray(rng.integers(0, V, (B, L)).astype(np.int32))
        mask = (rng.random((B, L)) > 0.2).astype(np.float64)
        mask[:, -11:] = 0  # a masked tail (padding at the end of the rows)
        mask[1] = 0  # and a row that is all padding
        mask = jnp.asarray(mask)
        m = make_mesh(mesh) if mesh else None

        def chunked(x, scale, head):
            given = {"head_VD": head.T} if vocab_major else {"head_DV": head}
            ce = chunked_token_losses(x, labels, mask, scale, **given, eps=1e-5,
                                      chunk=chunk, mesh=m, compute_dtype=jnp.float64)
            return ce.sum() / mask.sum(), ce

        def full(x, scale, head):
            ce = full_loss(x, scale, head, labels, mask)
            return ce.sum() / mask.sum(), ce

        (got, got_ce), got_g = jax.jit(jax.value_and_grad(chunked, (0, 1, 2), has_aux=True))(x, scale, head)
        (want, want_ce), want_g = jax.value_and_grad(full, (0, 1, 2), has_aux=True)(x, scale, head)
        assert got_ce.dtype == jnp.float64 and got_ce.shape == (B, L)
        np.testing.assert_allclose(np.asarray(got_ce), np.asarray(want_ce), rtol=1e-12, atol=1e-12)
        assert np.all(np.asarray(got_ce)[np.asarray(mask) == 0] == 0)
        assert abs(float(got) - float(want)) <= 1e-12 * abs(float(want))
        for g, w in zip(got_g, want_g):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-10, atol=1e-13)


def test_the_head_is_given_one_way():
    x = jnp.ones((1, 4, 8))
    with pytest.raises(ValueError, match="one of head_DV"):
        chunked_token_losses(x, jnp.zeros((1, 4), jnp.int32), jnp.ones((1, 4)), jnp.ones(8),
                             jnp.ones((8, 5)), head_VD=jnp.ones((5, 8)), eps=1e-5, chunk=0)
