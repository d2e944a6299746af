"""Next-token cross-entropy over chunks of tokens: the [B, L, V] logits never exist whole.

At long context the head's fp32 logits (and their gradient, and the softmax's temporaries) are
the largest tensors of a step: 32k tokens of a 32k vocabulary are 4 GB per device. Here the
final norm, the head projection and the cross-entropy run in a ``lax.scan`` over chunks of
each device's slice of the sequence, each chunk under ``jax.checkpoint``: the forward keeps
only the per-token losses, the backward recomputes one chunk's logits at a time.

Chunks cut each device's local slice, never the global sequence: the sequence axis is sharded
over the mesh's ``sequence`` axis (in layout order), so ``[B, L]`` is viewed as
``[B, S, C]`` (S ring devices, C = L / S tokens each, the sharded dim staying whole) and C is
cut into chunks of ``chunk`` tokens. Every chunk is spread over all devices, each computing
``chunk`` of its own tokens: no communication, and the same work on every device.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P


def num_chunks(local_len: int, chunk: int) -> tuple[int, int]:
    """(chunks, tokens per chunk) for a local slice of ``local_len`` tokens; ``chunk`` 0 = one.

    A chunk that does not divide the slice is kept, and the last chunk padded (masked)."""
    if chunk <= 0 or chunk >= local_len:
        return 1, local_len
    return -(-local_len // chunk), chunk


def chunked_token_losses(x_BLD, labels_BL, mask_BL, norm, head_DV, *, chunk: int, mesh=None,
                         compute_dtype=jnp.float32):
    """Per-token masked cross-entropy ``[B, L]`` (fp32, 0 where masked) of hidden states
    ``x_BLD`` (before the final ``norm``) against ``labels_BL``, in the batch's layout."""
    B, L, D = x_BLD.shape
    S = mesh.shape["sequence"] if mesh is not None else 1
    C = L // S
    n, c = num_chunks(C, chunk)
    batch_axes = ("data", "fsdp")

    def constrain(a, spec):
        return a if mesh is None else jax.lax.with_sharding_constraint(a, NamedSharding(mesh, spec))

    def to_chunks(a_BL, fill):
        """[B, L, ...] -> [n, B, S, c, ...]: chunk i holds tokens i*c.. of every device's slice."""
        a = a_BL.reshape(B, S, C, *a_BL.shape[2:])
        a = constrain(a, P(batch_axes, "sequence", *(None,) * (a.ndim - 2)))
        if n * c != C:
            pad = [(0, 0)] * a.ndim
            pad[2] = (0, n * c - C)
            a = jnp.pad(a, pad, constant_values=fill)
        a = a.reshape(B, S, n, c, *a.shape[3:])
        return jnp.moveaxis(a, 2, 0)

    if mesh is not None:
        # Gather the head over fsdp x sequence once, outside the loop (as FSDP does for every
        # weight): each chunk then multiplies by a local [D, V / tensor] block.
        head_DV = constrain(head_DV, P(None, "tensor"))
    head_DV = head_DV.astype(compute_dtype)
    acc = jnp.promote_types(compute_dtype, jnp.float32)  # fp32 logits (fp64 in the tests)

    @jax.checkpoint
    def one_chunk(x_BScD, labels_BSc, mask_BSc):
        x_BScD = constrain(x_BScD, P(batch_axes, "sequence", None, None))
        logits_BScV = jnp.einsum("bscd,dv->bscv", norm(x_BScD), head_DV,
                                 preferred_element_type=acc)
        logits_BScV = constrain(logits_BScV, P(batch_axes, "sequence", None, "tensor"))
        ce_BSc = optax.softmax_cross_entropy_with_integer_labels(logits_BScV, labels_BSc)
        return ce_BSc * mask_BSc

    def body(carry, xs):
        return carry, one_chunk(*xs)

    xs = (to_chunks(x_BLD, 0), to_chunks(labels_BL, 0), to_chunks(mask_BL.astype(acc), 0))
    _, ce_nBSc = jax.lax.scan(body, None, xs)
    ce_BSC = jnp.moveaxis(ce_nBSc, 0, 2).reshape(B, S, n * c)[:, :, :C]
    return constrain(ce_BSC.reshape(B, L), P(batch_axes, "sequence"))
