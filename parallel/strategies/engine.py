"""The one engine every strategy runs on: per device, its queries meet K/V blocks for ``hops``
ring rounds, and the compiled (jit + shard_map) programs of the forward and the backward.

Forward: the next block's transfer is issued before the current block's compute (independent
of it, so XLA can overlap them); the last round sends nothing. Backward: dQ accumulates
locally; each block's dK/dV accumulator travels one hop behind the K/V prefetch and arrives
home after ``hops`` hops. One round (``hops == 1``: allgather, ulysses) moves nothing. A
sliding window in the contiguous layout leaves work in only the first ``rounds`` rounds: the
ring stops after them and each dK/dV accumulator jumps home in one transfer.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from parallel import kernels, strategies
from parallel.strategies.rounds import Rounds


def ring_forward(strategy, kv, acc, attend):
    """``strategy.rounds`` rounds (all ``hops`` of them unless a window stops the ring early)."""
    if strategy.rounds == 1:
        return attend(kv, acc)

    def round_(_, carry):
        kv, acc = carry
        kv_next = strategy.shift(kv)
        return kv_next, attend(kv, acc)

    kv, acc = lax.fori_loop(0, strategy.rounds - 1, round_, (kv, acc))
    return attend(kv, acc)


def ring_backward(strategy, kv, dq, grads):
    """Returns ``(dq, dk, dv)``; ``dk``/``dv`` of the block this device started with."""
    rounds = strategy.rounds
    if rounds == 1:  # the block never left: its gradient is already home
        return grads(kv, dq)
    shift = strategy.shift
    kv_next = shift(kv)
    dq, dk, dv = grads(kv, dq)

    def round_(kv_next, dq, dkv, prefetch):
        # dK/dV of the block computed last round move on while this round computes fresh
        # contributions for the block that just arrived; they meet afterwards.
        dkv_in = shift(dkv)
        kv = kv_next
        kv_next = shift(kv) if prefetch else None
        dq, dk, dv = grads(kv, dq)
        return kv_next, dq, (dkv_in[0] + dk, dkv_in[1] + dv)

    kv_next, dq, dkv = lax.fori_loop(1, rounds - 1, lambda _, c: round_(*c, prefetch=True),
                                     (kv_next, dq, (dk, dv)))
    _, dq, dkv = round_(kv_next, dq, dkv, prefetch=False)
    # The last block seen started rounds - 1 hops back: one transfer brings its gradient home
    # (one hop on the full ring; the rest of the circle when a window stopped it early).
    dk, dv = shift(dkv, hops=strategy.hops - rounds + 1)
    return dq, dk, dv


def forward_local(call):
    """Per device: sequence-sharded q, k, v, positions, segment ids (and the tensor shard's
    attention sinks ``[H]``, if any) -> output (sequence-sharded) and the logsumexp in whatever
    layout this strategy's backward reads."""
    strategy = strategies.get(call)

    def local(q_BCHD, k_BCKD, v_BCKD, pos_BC, seg_BC, sink_H=None):
        q, pos, seg, kv = strategy.meet(q_BCHD, k_BCKD, v_BCKD, pos_BC, seg_BC)
        r = Rounds(call, q, pos, seg, kv.k.shape[1], q_BCHD.shape[1])
        sink = None if sink_H is None else strategy.heads(sink_H)
        out, lse = r.finish(ring_forward(strategy, kv, r.init(), r.attend), sink)
        return strategy.to_seq(out), lse
    return local


def backward_local(call):
    strategy = strategies.get(call)
    needs_out = getattr(kernels.rounds(call.kernel), "NEEDS_OUT", False)

    def local(q_BCHD, k_BCKD, v_BCKD, pos_BC, seg_BC, out_BCHD, lse_BKSG, dout_BCHD,
              sink_H=None):
        # Row sums of dout * out where the output lives: [B, C, Hq] moves instead of the output.
        delta = jnp.sum(dout_BCHD.astype(jnp.float32) * out_BCHD.astype(jnp.float32), axis=-1)
        q, pos, seg, kv = strategy.meet(q_BCHD, k_BCKD, v_BCKD, pos_BC, seg_BC)
        out = strategy.to_heads(out_BCHD) if needs_out else None
        r = Rounds(call, q, pos, seg, kv.k.shape[1], q_BCHD.shape[1], lse_BKSG,
                   strategy.to_heads(dout_BCHD), strategy.to_heads(delta), out)
        dq, dk, dv = ring_backward(strategy, kv, r.zeros_dq(), r.grads)
        grads = (strategy.to_seq(r.finish_dq(dq)), strategy.home(dk, k_BCKD.dtype),
                 strategy.home(dv, v_BCKD.dtype))
        if sink_H is None:
            return grads
        # The sinks' gradient per query row, back where the queries live: [B, C, Hq] (summed
        # over rows outside, where the batch and sequence shards meet).
        return grads + (strategy.to_seq(r.sink_grads(strategy.heads(sink_H))),)
    return local


# One jitted program per configuration, reused across calls: eager callers (and layouts that
# differ only in the runtime positions) then share one compilation. Every strategy maps the
# same sequence-sharded inputs to the same outputs; the logsumexp residual is in whatever
# per-device layout the strategy's backward reads.
@functools.lru_cache(maxsize=None)
def forward_program(call, has_seg: bool, has_sink: bool = False):
    qspec = call.spec("b", "s", "h", None)
    return jax.jit(jax.shard_map(forward_local(call), mesh=call.mesh,
                                 in_specs=call.fwd_specs(has_seg, has_sink),
                                 out_specs=(qspec, call.lse_spec()),
                                 check_vma=call.kernel == "xla"))


@functools.lru_cache(maxsize=None)
def backward_program(call, has_seg: bool, has_sink: bool = False):
    qspec = call.spec("b", "s", "h", None)
    out_specs = (qspec, qspec, qspec) + ((call.spec("b", "s", "h"),) if has_sink else ())
    return jax.jit(jax.shard_map(backward_local(call), mesh=call.mesh,
                                 in_specs=call.bwd_specs(has_seg, has_sink),
                                 out_specs=out_specs, check_vma=call.kernel == "xla"))
