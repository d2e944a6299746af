"""Next-token cross-entropy over chunks of tokens: the [B, L, V] logits never exist whole.

At long context the head's fp32 logits (and their gradient, and the softmax's temporaries) are
among the largest tensors of a step: 32k tokens of a 32k vocabulary are 4 GB per device. Here
the final norm, the head projection and the cross-entropy run in a ``lax.scan`` over chunks of
each device's slice of the sequence (model/chunks.py), each chunk under ``jax.checkpoint``:
the forward keeps only the per-token losses, the backward recomputes one chunk's logits at a
time. A slice that is one chunk runs without remat: the loss is the forward's last op and the
backward's first, so its insides are alive in between anyway (recomputing them cost a matmul).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from model.chunks import cast_before_gather, map_chunks
from model.layers import matmul_rows, rms_norm


def _scoped(name):
    """Runs a function under a jax name scope: training/profile.py's rows read it."""
    def wrap(f):
        @functools.wraps(f)
        def scoped(*args, **kw):
            with jax.named_scope(name):
                return f(*args, **kw)
        return scoped
    return wrap


@_scoped("loss")
def chunked_token_losses(x_BLD, labels_BL, mask_BL, norm_scale_D, head_DV=None, *, eps: float,
                         chunk: int, mesh=None, compute_dtype=jnp.float32, greedy_vocab=None,
                         softcap: float = 0.0, head_VD=None):
    """Per-token masked cross-entropy ``[B, L]`` (fp32, 0 where masked) of hidden states
    ``x_BLD`` (before the final RMSNorm of ``norm_scale_D``) against ``labels_BL``, in the
    batch's layout. The vocabulary is split over the mesh's tensor axis (padded to divide).

    ``greedy_vocab=U`` (evaluation): ``[B, L, 2]`` instead, the loss and 1.0 where the label
    is the likeliest of the first U tokens (a tie counts as likeliest), as greedy decoding
    restricted to the tokenizer's U ids would pick it. ``softcap`` C > 0: the logits are
    C * tanh(logits / C) (Gemma's final soft-capping). The head is ``head_DV`` [D, V], or
    ``head_VD`` [V, D] (a tied embedding table, read as it is)."""
    if (head_DV is None) == (head_VD is None):
        raise ValueError("give the head as one of head_DV [D, V] or head_VD [V, D]")
    acc = jnp.promote_types(compute_dtype, jnp.float32)  # fp32 logits (fp64 in the tests)
    vocab_axis = 0 if head_VD is not None else 1
    head = cast_before_gather(head_DV if head_VD is None else head_VD, compute_dtype)
    V = head.shape[vocab_axis]
    t = mesh.shape["tensor"] if mesh is not None else 1
    if V % t:
        head = jnp.pad(head, [(0, t - V % t) if a == vocab_axis else (0, 0) for a in range(2)])

    def one_chunk(w, x_BcD, labels_Bc, mask_Bc, axis):
        scale_D, head_w = w
        logits_Bcv = matmul_rows(rms_norm(x_BcD, scale_D, eps), head_w,
                                 preferred_element_type=acc, w_transposed=vocab_axis == 0)
        if softcap:
            logits_Bcv = jnp.tanh(logits_Bcv / softcap) * softcap
        v = logits_Bcv.shape[-1]
        first = jax.lax.axis_index(axis) * v if axis else 0  # this shard's first vocab id
        ids_v = first + jnp.arange(v)
        if v * t != V:  # the padding that made the vocabulary divide the tensor axis
            logits_Bcv = jnp.where(ids_v < V, logits_Bcv, jnp.finfo(acc).min)
        m_Bc = jax.lax.stop_gradient(logits_Bcv.max(-1))
        if axis:
            m_Bc = jax.lax.pmax(m_Bc, axis)
        sum_Bc = jnp.exp(logits_Bcv - m_Bc[..., None]).sum(-1)
        # The label's logit as a masked sum (0 where the label is on another shard): exact, and
        # its gradient is a select fused into the softmax's, not a scatter into a [c, V] zero
        # tensor and its transposed copy (0.55 s of SmolLM2's 2,048-token step on a CPU).
        picked_Bc = jnp.where(ids_v == labels_Bc[..., None], logits_Bcv, 0).sum(-1)
        if axis:
            sum_Bc, picked_Bc = jax.lax.psum(sum_Bc, axis), jax.lax.psum(picked_Bc, axis)
        loss_Bc = (jnp.log(sum_Bc) + m_Bc - picked_Bc) * mask_Bc
        if greedy_vocab is None:
            return loss_Bc
        usable_Bc = jnp.where(ids_v < greedy_vocab, logits_Bcv,
                              jnp.finfo(acc).min).max(-1)
        if axis:
            usable_Bc = jax.lax.pmax(usable_Bc, axis)
        return jnp.stack([loss_Bc, (picked_Bc >= usable_Bc).astype(acc)], -1)

    head_spec = P("tensor", None) if vocab_axis == 0 else P(None, "tensor")
    return map_chunks(one_chunk, (norm_scale_D, head), (P(), head_spec),
                      (x_BLD, labels_BL, mask_BL.astype(acc)), chunk, mesh,
                      out_rank=2 if greedy_vocab is None else 3, remat_one=False)
