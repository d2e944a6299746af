"""The chunked loss equals the full-logits cross-entropy, values and gradients, and the chunked
step never holds the whole logits."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from model.chunks import num_chunks
from model.loss import chunked_token_losses
from parallel.mesh import make_mesh
from test_state import config as tiny_config, natural_batch
from training.state import Trainer


def rms(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-5) * scale


def full_loss(x_BLD, scale_D, head_DV, labels_BL, mask_BL):
    logits = jnp.einsum("bld,dv->blv", rms(x_BLD, scale_D), head_DV)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels_BL) * mask_BL


def test_num_chunks():
    assert num_chunks(16, 0) == (1, 16) and num_chunks(16, 32) == (1, 16)
    assert num_chunks(16, 4) == (4, 4) and num_chunks(16, 6) == (3, 6)


@pytest.mark.parametrize("mesh,chunk", [
    ({"data": 1, "fsdp": 2, "sequence": 4, "tensor": 1}, 6),  # 16-token slices: 6 + 6 + 4 (padded)
    ({"data": 1, "fsdp": 2, "sequence": 2, "tensor": 2}, 8),  # vocab over tensor, even chunks
    (None, 5),
])
def test_chunked_equals_full_in_float64(mesh, chunk):
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
            ce = chunked_token_losses(x, labels, mask, scale, head, eps=1e-5,
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


def test_trainer_loss_matches_the_full_logits():
    """The decoder's chunked token losses and chunked MLP (ring attention, striped, 8 devices)
    equal the cross-entropy of the unchunked decoder's full logits, loss and gradients."""
    mesh_sizes = {"data": 1, "fsdp": 2, "sequence": 2, "tensor": 2}  # vocab 101: padded over tensor
    rng = np.random.default_rng()
    batch_np = natural_batch(rng, 4, 64, 101)
    seed = int(rng.integers(0, 2**31))
    trainers = []
    for loss_chunk, mlp_chunk in ((3, 5), (0, 0)):  # 32-token slices: 11 and 7 chunks, padded
        c = tiny_config("ring", "striped", mesh_sizes)
        c.train.loss_chunk, c.model.mlp_chunk = loss_chunk, mlp_chunk
        trainers.append(Trainer(c, make_mesh(c.mesh)))
    chunked, ref = trainers
    batch = {k: jax.device_put(v, ref.batch_shardings[k]) for k, v in batch_np.items()}
    params = ref.init(seed).params

    def full(params, batch):
        logits = nnx.merge(ref.graphdef, params)(batch["tokens"], batch["positions"],
                                                 batch["segment_ids"])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
        return (ce * batch["loss_mask"]).sum() / batch["loss_mask"].sum()

    got, got_g = jax.jit(jax.value_and_grad(lambda p, b: chunked.loss(p, b)[0]))(params, batch)
    want, want_g = jax.jit(jax.value_and_grad(full))(params, batch)
    assert abs(float(got) - float(want)) < 1e-6 * abs(float(want))
    for g, w in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
        assert np.abs(np.asarray(g) - np.asarray(w)).max() <= 1e-5 * np.abs(np.asarray(w)).max()
