"""How the decoder's weights start, and the gated MLPs' activations: shared by its dense layers
(model/layers.py) and its mixture of experts (model/moe.py)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

ACTIVATIONS = {"silu": jax.nn.silu,  # SwiGLU (Llama, Qwen)
               "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}  # GeGLU (Gemma)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def gate(activation: str, g, u):
    """``act(g) * u`` (``act``: ACTIVATIONS' name), whose backward keeps only ``g`` and ``u``
    and recomputes ``act(g)`` (elementwise): JAX's own would also keep ``act(g)`` and the
    activation's insides (for silu, ``sigmoid(g)``), each a [tokens, ffn] tensor a layer, the
    largest a step keeps. The gated MLP's, LoRA's and the experts' (model/moe.py)."""
    return ACTIVATIONS[activation](g) * u


def _gate_fwd(activation, g, u):
    return gate(activation, g, u), (g, u)


def _gate_bwd(activation, res, dh):
    g, u = res
    a, act_vjp = jax.vjp(ACTIVATIONS[activation], g)
    return act_vjp(dh * u)[0], dh * a


gate.defvjp(_gate_fwd, _gate_bwd)


def _param(rngs: nnx.Rngs, shape, axes, std: float) -> nnx.Param:
    """A normal-initialised fp32 weight carrying its logical ``axes`` (parallel/mesh.py RULES)."""
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32), axes=axes)


def _bias(shape, axes) -> nnx.Param:
    """A zero-initialised bias; ``weight_decay=False`` keeps AdamW's decay off it
    (training/optim.py decay_mask)."""
    return nnx.Param(jnp.zeros(shape, jnp.float32), axes=axes, weight_decay=False)
