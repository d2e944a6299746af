"""The optimizer against its closed form: warmup then cosine (a warmup longer than the run just
warms up), at the optimizer's own step count, and decoupled weight decay on every parameter
but the norm scales."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from ml_collections import ConfigDict

from configs import tiny
from model.decoder import Decoder
from model.layers import AttentionBackend
from training.optim import decay_mask, make_optimizer, schedule


def train_cfg(**kw):
    t = ConfigDict(tiny.get_config().train.to_dict())
    t.update(kw)
    return t


def closed_form(c, lr, warmup, steps, ratio):
    """The learning rate of optimizer update ``c`` (0-based) of a run of ``steps`` updates."""
    w = min(warmup, steps)
    if c < w:
        return lr * c / w
    end = lr * ratio
    return end + (lr - end) * 0.5 * (1 + math.cos(math.pi * (c - w) / max(steps - w, 1)))


@pytest.mark.parametrize("warmup,steps", [(10, 50), (0, 20), (30, 12)])
def test_schedule_is_warmup_then_cosine(warmup, steps):
    t = train_cfg(lr=3e-3, warmup_steps=warmup, steps=steps, min_lr_ratio=0.1)
    lr = schedule(t)
    want = [closed_form(c, 3e-3, warmup, steps, 0.1) for c in range(steps)]
    np.testing.assert_allclose([float(lr(c)) for c in range(steps)], want, rtol=1e-5, atol=1e-12)
    if warmup > steps:  # a run shorter than its warmup only warms up: still rising at the end
        assert all(b > a for a, b in zip(want, want[1:]))


def test_each_update_moves_by_the_scheduled_rate():
    """Adam with b1 = b2 = 0 and a unit gradient steps by exactly the learning rate: the
    optimizer reads the schedule at its own count, 0 for the first update."""
    steps = 7
    t = train_cfg(lr=0.5, warmup_steps=3, steps=steps, min_lr_ratio=0.2, b1=0.0, b2=0.0,
                  eps=0.0, weight_decay=0.0, grad_clip=0.0)
    opt = make_optimizer(t, {"w": True})
    params, grads = {"w": jnp.zeros(())}, {"w": jnp.ones(())}
    state, moves = opt.init(params), []
    for _ in range(steps):
        updates, state = opt.update(grads, state, params)
        moves.append(-float(updates["w"]))
        params = optax.apply_updates(params, updates)
    np.testing.assert_allclose(moves, [closed_form(c, 0.5, 3, steps, 0.2) for c in range(steps)],
                               rtol=1e-6, atol=1e-12)


def test_weight_decay_spares_the_norm_scales_and_biases():
    """With zero gradients AdamW's only move is decoupled decay, p -> p (1 - lr wd), on every
    parameter but the norm scales (stacked per layer, so 2-D: found by their logical axes) and
    the q/k/v biases (3-D once stacked: found by their metadata)."""
    m = tiny.get_config().model
    m.update(vocab_size=64, d_model=16, num_heads=2, num_kv_heads=1, ffn_dim=32, qkv_bias=True)
    abstract = nnx.split(nnx.eval_shape(lambda: Decoder(m, AttentionBackend(), nnx.Rngs(0))),
                         nnx.Param)[1]
    mask = decay_mask(abstract)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape), a.dtype),
                          nnx.to_pure_dict(abstract))
    t = train_cfg(lr=0.1, warmup_steps=0, steps=10, weight_decay=0.5, grad_clip=0.0)
    opt = make_optimizer(t, mask)
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = jax.jit(opt.update)(zeros, opt.init(params), params)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    spared = []
    for (path, p), u, decays in zip(flat, jax.tree.leaves(updates), jax.tree.leaves(mask)):
        name = jax.tree_util.keystr(path)
        if decays:
            np.testing.assert_allclose(u, -0.1 * 0.5 * p, rtol=1e-6, atol=1e-9, err_msg=name)
        else:
            assert not np.any(u), name
            spared.append(name)
    norms = [n for n in (jax.tree_util.keystr(k) for k, _ in flat) if "norm" in n]
    biases = [f"['blocks']['attn']['{b}']" for b in ("bq", "bk", "bv")]
    assert sorted(spared) == sorted(norms + biases)
