"""The sharded loss and gradients equal the single-device ones (dense, natural order)."""
import jax
import numpy as np
import pytest

from configs import tiny
from parallel.layouts import permutation
from parallel.mesh import make_mesh
from training.state import Trainer


def config(impl, layout, mesh):
    c = tiny.get_config()
    c.model.update(vocab_size=101, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                   ffn_dim=96, dtype="float32", remat="full")
    c.attention.update(impl=impl, layout=layout, block_q=16, block_kv=16)
    c.mesh.update(mesh)
    c.data.update(seq_len=64, batch_size=4)
    c.train.update(steps=10, warmup_steps=0, lr=1e-2)
    return c


def natural_batch(rng, B, L, vocab):
    """Two packed documents per row, positions restarting at the boundary."""
    cut = rng.integers(L // 4, 3 * L // 4, B)
    idx = np.arange(L)[None]
    seg = np.where(idx < cut[:, None], 1, 2).astype(np.int32)
    pos = np.where(idx < cut[:, None], idx, idx - cut[:, None]).astype(np.int32)
    mask = (rng.random((B, L)) > 0.1).astype(np.float32)
    return {"tokens": rng.integers(0, vocab, (B, L)).astype(np.int32),
            "labels": rng.integers(0, vocab, (B, L)).astype(np.int32),
            "positions": pos, "segment_ids": seg, "loss_mask": mask}


def run_step(c, devices, batch_np, seed):
    mesh = make_mesh(c.mesh, devices)
    trainer = Trainer(c, mesh)
    perm = permutation(c.attention.layout, c.data.seq_len, mesh.shape["sequence"], c.attention.stripe)
    batch = {k: jax.device_put(v[:, perm], trainer.batch_shardings[k]) for k, v in batch_np.items()}
    state = trainer.init(seed)
    (loss, _), grads = jax.jit(jax.value_and_grad(trainer.loss, has_aux=True))(state.params, batch)
    return float(loss), jax.device_get(grads)


@pytest.mark.parametrize("impl,layout,mesh", [
    ("dense", "contiguous", {"data": 1, "fsdp": 2, "sequence": 2, "tensor": 2}),
    ("ring", "striped", {"data": 2, "fsdp": 1, "sequence": 2, "tensor": 2}),
])
def test_sharded_step_equals_single_device_step(impl, layout, mesh):
    rng = np.random.default_rng()
    seed = int(rng.integers(0, 2**31))
    batch = natural_batch(rng, 4, 64, 101)
    one = {"data": 1, "fsdp": 1, "sequence": 1, "tensor": 1}
    ref_loss, ref_grads = run_step(config("dense", "contiguous", one),
                                                  jax.devices()[:1], batch, seed)
    loss, grads = run_step(config(impl, layout, mesh), jax.devices(), batch, seed)
    assert abs(loss - ref_loss) < 1e-5 * abs(ref_loss)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_microbatches_equal_the_single_batch_step():
    """k sequential microbatches give the one-batch loss (token-weighted: rows carry different
    numbers of unmasked tokens) and gradients, and the step reports them."""
    k, mesh = 4, {"data": 2, "fsdp": 1, "sequence": 2, "tensor": 2}
    rng = np.random.default_rng()
    seed = int(rng.integers(0, 2**31))
    batch_np = natural_batch(rng, 8, 64, 101)
    batch_np["loss_mask"][3] = 0  # an all-padding row
    batch_np["loss_mask"][5, 20:] = 0  # and a short one
    results = []
    for micro in (1, k):
        c = config("ring", "striped", mesh)
        c.data.batch_size = 8
        c.train.microbatches = micro
        trainer = Trainer(c, make_mesh(c.mesh))
        batch = {key: jax.device_put(v, trainer.batch_shardings[key]) for key, v in batch_np.items()}
        state = trainer.init(seed)
        loss, count, grads = jax.jit(trainer.gradients)(state.params, batch)
        results.append((float(loss), float(count), jax.device_get(grads)))
    (loss1, count1, g1), (lossk, countk, gk) = results
    assert count1 == countk == batch_np["loss_mask"].sum()
    assert abs(lossk - loss1) < 2e-6 * abs(loss1)
    for got, want in zip(jax.tree.leaves(gk), jax.tree.leaves(g1)):
        assert np.abs(got - want).max() <= 2e-5 * np.abs(want).max()
    _, metrics = trainer.train_step(state, batch)  # the k-microbatch step
    norm1 = np.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in jax.tree.leaves(g1)))
    assert abs(float(metrics["loss"]) - loss1) < 2e-6 * abs(loss1)
    assert abs(float(metrics["grad_norm"]) - norm1) < 1e-5 * norm1
    assert float(metrics["tokens"]) == count1
