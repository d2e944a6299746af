"""Next-token cross-entropy over chunks of tokens: the [B, L, V] logits never exist whole.

At long context the head's fp32 logits (and their gradient, and the softmax's temporaries) are
among the largest tensors of a step: 32k tokens of a 32k vocabulary are 4 GB per device. Here
the final norm, the head projection and the cross-entropy run in a ``lax.scan`` over chunks of
each device's slice of the sequence (model/chunks.py), each chunk under ``jax.checkpoint``:
the forward keeps only the per-token losses, the backward recomputes one chunk's logits at a
time.
"""
from __future__ import annotations

import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from model.chunks import BATCH_AXES, constrain, map_chunks, num_chunks  # noqa: F401


def chunked_token_losses(x_BLD, labels_BL, mask_BL, norm, head_DV, *, chunk: int, mesh=None,
                         compute_dtype=jnp.float32):
    """Per-token masked cross-entropy ``[B, L]`` (fp32, 0 where masked) of hidden states
    ``x_BLD`` (before the final ``norm``) against ``labels_BL``, in the batch's layout."""
    # Gather the head over fsdp x sequence once, outside the loop (as FSDP does for every
    # weight): each chunk then multiplies by a local [D, V / tensor] block.
    head_DV = constrain(head_DV, mesh, P(None, "tensor")).astype(compute_dtype)
    acc = jnp.promote_types(compute_dtype, jnp.float32)  # fp32 logits (fp64 in the tests)

    def one_chunk(x_BScD, labels_BSc, mask_BSc):
        logits_BScV = jnp.einsum("bscd,dv->bscv", norm(x_BScD), head_DV,
                                 preferred_element_type=acc)
        logits_BScV = constrain(logits_BScV, mesh, P(BATCH_AXES, "sequence", None, "tensor"))
        ce_BSc = optax.softmax_cross_entropy_with_integer_labels(logits_BScV, labels_BSc)
        return ce_BSc * mask_BSc

    return map_chunks(one_chunk, (x_BLD, labels_BL, mask_BL.astype(acc)), chunk, mesh)
