"""How the decoder's weights start, and the gated MLPs' activations: shared by its dense layers
(model/layers.py) and its mixture of experts (model/moe.py)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

ACTIVATIONS = {"silu": jax.nn.silu,  # SwiGLU (Llama, Qwen)
               "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}  # GeGLU (Gemma)


def _param(rngs: nnx.Rngs, shape, axes, std: float) -> nnx.Param:
    """A normal-initialised fp32 weight carrying its logical ``axes`` (parallel/mesh.py RULES)."""
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32), axes=axes)


def _bias(shape, axes) -> nnx.Param:
    """A zero-initialised bias; ``weight_decay=False`` keeps AdamW's decay off it
    (training/optim.py decay_mask)."""
    return nnx.Param(jnp.zeros(shape, jnp.float32), axes=axes, weight_decay=False)
