"""AdamW with warmup + cosine, global-norm clipping, no weight decay on norm scales."""
from __future__ import annotations

import jax
import optax
from flax import nnx


def schedule(t) -> optax.Schedule:
    # A smoke run shorter than the warmup just warms up; it is not an error.
    warmup = min(t.warmup_steps, t.steps)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=t.lr, warmup_steps=warmup,
        decay_steps=warmup + max(t.steps - warmup, 1), end_value=t.lr * t.min_lr_ratio)


def decay_mask(abstract_params):
    """True where weight decay applies: every Param except norm scales and biases.

    Read from metadata rather than ndim: stacked per-layer norm scales are 2-D, and a bias
    (model/layers.py _bias, marked ``weight_decay=False``) is 3-D once stacked."""
    def decays(v):
        meta = v.get_metadata()
        return "norm" not in (meta.get("axes") or ()) and meta.get("weight_decay", True)

    return nnx.to_pure_dict(jax.tree.map(
        decays, abstract_params, is_leaf=lambda x: isinstance(x, nnx.Variable)))


def make_optimizer(t, mask) -> optax.GradientTransformation:
    parts = [optax.clip_by_global_norm(t.grad_clip)] if t.grad_clip > 0 else []
    parts.append(optax.adamw(schedule(t), b1=t.b1, b2=t.b2, eps=t.eps,
                             weight_decay=t.weight_decay, mask=mask))
    return optax.chain(*parts)
