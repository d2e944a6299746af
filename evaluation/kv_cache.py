"""Generation with a KV cache on the run's mesh: the prompt prefilled once with the run's
context-parallel attention (any layout and strategy), the cache kept sharded over the
``sequence`` axis, and each new token's attention merged across devices by logsumexp.

The cache of one layer is ``[B, Hkv, S * C, D]`` over S sequence shards (heads before slots:
a query's scores and weighted sum then read the cache in place, where ``[B, slots, Hkv, D]``
would be transposed at every layer of every token). Device ``d`` holds
``C = Cp + G`` slots: its ``Cp`` prompt tokens, in the layout's order exactly as the prefill
left them (no reshuffle), then ``G`` slots for new tokens, which are dealt round-robin (new
token ``t`` goes to device ``t % S``, slot ``Cp + t // S``) so that every device holds an equal
share of the generation. Beside it, each slot's true position (``EMPTY`` for padding and
unwritten slots: later than any query, so causally invisible) is all the mask needs.

A decode step runs the model on one token per row. Each device attends its query over its own
slots and keeps the unnormalised fp32 softmax state (max, denominator, numerator); the states
combine over ``sequence`` by ``pmax`` and ``psum``, the merge a ring round uses, then with the
token's own key. Its keys and values are written in place (the cache is donated).

Rows of different prompt lengths share a batch: each row keeps its own positions. A dynamic
(NTK) RoPE scaling reads the batch's largest position when keys are computed, as Hugging
Face's cached generation does: its cached keys keep the base of the step that made them.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Iterable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from parallel.kernels import predicate
from parallel.kernels.accumulators import M_INIT
from parallel.mesh import BATCH_AXES

EMPTY = 2**30  # the position of a slot holding no token
CACHE = P(None, BATCH_AXES, "tensor", "sequence", None)  # [layers, B, Hkv, slots, D]
ROWS = P(BATCH_AXES, "sequence")  # [B, slots]
TOKEN = P(BATCH_AXES, None, "tensor", None)  # one token's q, k or v [B, 1, H, D]
LAYER = P(BATCH_AXES, "tensor", "sequence", None)  # one layer's cache [B, Hkv, slots, D]
CACHE_TOKEN = P(None, BATCH_AXES, "tensor", None, None)  # every layer's new k or v [layers, B, Hkv, 1, D]


class Cache(NamedTuple):
    k: jax.Array  # [layers, B, Hkv, S * C, D], the compute dtype as held_dtype holds it
    v: jax.Array
    pos: jax.Array  # [B, S * C] int32 true positions; EMPTY where no token


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How a token is picked from the next-token logits."""
    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0  # 0: among all tokens

    def describe(self) -> str:
        if self.greedy:
            return "greedy"
        return f"temperature {self.temperature}, top-k {self.top_k or 'all'}"


def stop_set(eos: int | Iterable[int] | None) -> frozenset[int]:
    """The token ids that end a row: ``eos`` as one id, a collection of them (an instruct
    model's ends of turn and of text: checkpoints/rundir.py ``Run.stop_ids``), or None."""
    if eos is None:
        return frozenset()
    if isinstance(eos, (int, np.integer)):
        return frozenset({int(eos)})
    return frozenset(int(i) for i in eos)


def pick(logits_BV, key, sampling: Sampling, usable_vocab: int):
    """One token per row; embedding rows past the tokenizer's vocabulary were never trained
    on, so they are never picked."""
    logits_BV = jnp.where(jnp.arange(logits_BV.shape[-1]) < usable_vocab, logits_BV, -jnp.inf)
    if sampling.greedy:
        return jnp.argmax(logits_BV, -1).astype(jnp.int32)
    logits_BV = logits_BV / sampling.temperature
    if sampling.top_k:
        kth_B = jax.lax.top_k(logits_BV, min(sampling.top_k, usable_vocab))[0][:, -1]
        logits_BV = jnp.where(logits_BV < kth_B[:, None], -jnp.inf, logits_BV)
    # a key per row: row r draws the same token whatever the batch (and so the mesh) is
    keys = jax.vmap(jax.random.fold_in, (None, 0))(key, jnp.arange(logits_BV.shape[0]))
    return jax.vmap(jax.random.categorical)(keys, logits_BV).astype(jnp.int32)


def _attend_local(q_B1HD, k_B1KD, v_B1KD, k_BKCD, v_BKCD, pos_BC, pos_B, sinks_H=None, *,
                  window):
    """Per device: one query per row against this device's cached slots of one layer, merged
    across ``sequence`` by logsumexp, then with the token's own key (which sees itself) and
    the attention sinks' ``exp(sink)`` in the denominator (this tensor shard's heads)."""
    b, _, hq, d = q_B1HD.shape
    hkv = k_B1KD.shape[2]
    f32 = jnp.float32
    q_BKGD = q_B1HD[:, 0].reshape(b, hkv, hq // hkv, d).astype(f32) * (1.0 / math.sqrt(d))
    s_BKGC = jnp.einsum("bkgd,bkcd->bkgc", q_BKGD, k_BKCD.astype(f32))
    seen_BC = predicate.visible(pos_B[:, None], pos_BC, None, None, causal=True,
                                window=window)[:, 0]
    s_BKGC = jnp.where(seen_BC[:, None, None, :], s_BKGC, -jnp.inf)
    m_BKG = jnp.maximum(s_BKGC.max(-1), M_INIT)  # finite even where nothing is visible
    p_BKGC = jnp.exp(s_BKGC - m_BKG[..., None])
    big_m = jax.lax.pmax(m_BKG, "sequence")
    scale = jnp.exp(m_BKG - big_m)
    l_BKG = jax.lax.psum(p_BKGC.sum(-1) * scale, "sequence")
    o_BKGD = jax.lax.psum(jnp.einsum("bkgc,bkcd->bkgd", p_BKGC, v_BKCD.astype(f32))
                          * scale[..., None], "sequence")
    s_self = jnp.einsum("bkgd,bkd->bkg", q_BKGD, k_B1KD[:, 0].astype(f32))
    m_all = jnp.maximum(big_m, s_self)
    a, c = jnp.exp(big_m - m_all), jnp.exp(s_self - m_all)
    o_BKGD = o_BKGD * a[..., None] + v_B1KD[:, 0].astype(f32)[:, :, None, :] * c[..., None]
    denom_BKG = l_BKG * a + c
    if sinks_H is not None:
        denom_BKG = denom_BKG + jnp.exp(sinks_H.astype(f32).reshape(1, hkv, -1) - m_all)
    o_BKGD = o_BKGD / denom_BKG[..., None]
    return o_BKGD.reshape(b, 1, hq, d).astype(q_B1HD.dtype)


def held_dtype(dtype, platform: str):
    """The dtype a cache of keys and values in ``dtype`` is held in on ``platform``: on a CPU a
    2-byte float (bf16) as its raw bits (uint16), else ``dtype`` itself. XLA's CPU backend has
    no bf16 dynamic-slice or dynamic-update-slice: a decode step slicing a bf16 cache layer by
    layer and writing its slot would convert the whole stacked cache to fp32 and back at every
    token. Bits move as they are; a layer's slice is bf16 again where it is read (a bitcast)."""
    dtype = jnp.dtype(dtype)
    return jnp.dtype(jnp.uint16) if platform == "cpu" and dtype.itemsize == 2 else dtype


def _hold(x, platform: str):
    held = held_dtype(x.dtype, platform)
    return x if held == x.dtype else jax.lax.bitcast_convert_type(x, held)


def _unhold(x, dtype):
    return x if x.dtype == jnp.dtype(dtype) else jax.lax.bitcast_convert_type(x, dtype)


def _write_local(cache, new_LBK1D, slot, owner):
    """Writes the token's keys (or values) of every layer into ``slot`` on device ``owner``, in
    place: the other devices write back what the slot held."""
    mine = jax.lax.axis_index("sequence") == owner
    old = jax.lax.dynamic_slice_in_dim(cache, slot, 1, axis=3)
    return jax.lax.dynamic_update_slice_in_dim(
        cache, jnp.where(mine, new_LBK1D.astype(cache.dtype), old), slot, axis=3)


def _write_pos_local(pos_BC, pos_B, slot, owner):
    mine = jax.lax.axis_index("sequence") == owner
    old = jax.lax.dynamic_slice_in_dim(pos_BC, slot, 1, axis=1)
    return jax.lax.dynamic_update_slice_in_dim(pos_BC, jnp.where(mine, pos_B[:, None], old),
                                               slot, axis=1)


class Generator:
    """Prefill and decode programs for one run on one mesh (``sharded``: the run's
    model.sharded.ShardedModel, or a training.state.Trainer, whose graphdef and shardings the
    programs use)."""

    def __init__(self, sharded, usable_vocab: int):
        self.sharded, self.mesh, self.config = sharded, sharded.mesh, sharded.config
        self.usable_vocab = int(usable_vocab)
        self.shards = int(self.mesh.shape["sequence"])
        self.platform = self.mesh.devices.flat[0].platform

    # -- programs --------------------------------------------------------------------------
    @functools.lru_cache(maxsize=None)
    def _prefill(self, gen_slots: int, sampling: Sampling):
        """(params, tokens, positions, segments, last_B, key) -> (Cache, first token [B])."""
        graphdef, mesh, vocab = self.sharded.graphdef, self.mesh, self.usable_vocab
        platform = self.platform

        def grow_local(c):  # [layers, b, Cp, h, d] -> [layers, b, h, Cp + G, d]
            return jnp.pad(c.swapaxes(2, 3), ((0, 0), (0, 0), (0, 0), (0, gen_slots), (0, 0)))

        grow = jax.shard_map(grow_local, mesh=mesh,
                             in_specs=P(None, BATCH_AXES, "sequence", "tensor", None),
                             out_specs=CACHE)

        def prefill(params, tokens_BL, positions_BL, segments_BL, cache_pos, last_B, key):
            model = nnx.merge(graphdef, params)
            x_BLD, (k, v) = model.hidden(tokens_BL, positions_BL, segments_BL, keep_kv=True)
            x_BD = jnp.take_along_axis(x_BLD, last_B[:, None, None], axis=1)[:, 0]
            cache = Cache(grow(_hold(k, platform)), grow(_hold(v, platform)), cache_pos)
            return cache, pick(model.next_logits(x_BD), key, sampling, vocab)

        return jax.jit(prefill, in_shardings=(self.sharded.param_shardings, *[self._rows()] * 4,
                                              None, None),
                       out_shardings=(self._cache_shardings(), None))

    @functools.lru_cache(maxsize=None)
    def _decode(self, prompt_slots: int, sampling: Sampling):
        """(params, cache, token [B], position [B], t, key) -> (cache, next token [B]): the
        token's keys and values written at slot ``prompt_slots + t // S`` of device ``t % S``."""
        graphdef, mesh, vocab, S = self.sharded.graphdef, self.mesh, self.usable_vocab, self.shards
        platform = self.platform

        def attend_for(window, sinks):  # a layer's cache read under its own window
            return jax.shard_map(functools.partial(_attend_local, window=window), mesh=mesh,
                                 in_specs=(TOKEN, TOKEN, TOKEN, LAYER, LAYER, ROWS,
                                           P(BATCH_AXES)) + ((P("tensor"),) if sinks else ()),
                                 out_specs=TOKEN)
        write = jax.shard_map(_write_local, mesh=mesh, in_specs=(CACHE, CACHE_TOKEN, P(), P()),
                              out_specs=CACHE)
        write_pos = jax.shard_map(_write_pos_local, mesh=mesh,
                                  in_specs=(ROWS, P(BATCH_AXES), P(), P()), out_specs=ROWS)

        token_rows = NamedSharding(mesh, P(BATCH_AXES, None, None))

        def decode(params, cache: Cache, token_B, pos_B, t, key):
            model = nnx.merge(graphdef, params)
            slot, owner = prompt_slots + t // S, t % S
            pos_B1 = pos_B[:, None]
            dtype = model.dtype

            # The cache is read layer by layer as the scan's input, not carried: a carried
            # cache written inside the loop is copied whole by XLA at every layer (layers x
            # cache bytes a token). Each layer's new keys and values come out of the scan and
            # are written at once, in place, after it.
            def layer(x_B1D, block, xs, kind):
                kc_BKCD, vc_BKCD = (_unhold(c, dtype) for c in xs)
                # one token per row: whole on every sequence device (the weights' embed axis
                # is split over fsdp x sequence, which would otherwise split D here)
                x_B1D = jax.lax.with_sharding_constraint(x_B1D, token_rows)
                def attention(q, k, v, sinks_H):
                    attend = attend_for(kind.window, sinks_H is not None)
                    return attend(q, k, v, kc_BKCD, vc_BKCD, cache.pos, pos_B,
                                  *(() if sinks_H is None else (sinks_H,)))
                return block.attend(x_B1D, pos_B1, None, kind=kind, attention=attention)

            # the model's own walk over its layers (one scan, each step switching to its
            # layer's kind), each layer's weights and cache read in place
            x_B1D, (k_LB1KD, v_LB1KD) = model.over_layers(
                layer, model.embed_tokens(token_B[:, None]), (cache.k, cache.v))
            def written(held, new_LB1KD):  # every layer's new keys (or values), held
                return write(held, _hold(new_LB1KD.astype(dtype).swapaxes(2, 3), platform),
                             slot, owner)

            new = Cache(written(cache.k, k_LB1KD), written(cache.v, v_LB1KD),
                        write_pos(cache.pos, pos_B, slot, owner))
            return new, pick(model.next_logits(x_B1D[:, 0]), key, sampling, vocab)

        return jax.jit(decode, donate_argnums=(1,),
                       in_shardings=(self.sharded.param_shardings, self._cache_shardings(),
                                     self._batch(), self._batch(), None, None),
                       out_shardings=(self._cache_shardings(), None))

    def _rows(self):
        return NamedSharding(self.mesh, ROWS)

    def _batch(self):
        return NamedSharding(self.mesh, P(BATCH_AXES))

    def _cache_shardings(self):
        s = NamedSharding(self.mesh, CACHE)
        return Cache(s, s, self._rows())

    # -- host side -------------------------------------------------------------------------
    def generate(self, params, prompts: list[list[int]], max_new_tokens: int, *, length: int,
                 eos: int | Iterable[int] | None, sampling: Sampling = Sampling(),
                 seed: int = 0, stop=None, real: int | None = None) -> list[list[int]]:
        """Up to ``max_new_tokens`` new tokens per prompt (a row of the batch each; the batch
        a multiple of the data x fsdp axes), ending at any id of ``eos`` (one id, a collection
        of ids or None: ``stop_set``; not included) or where
        ``stop(row, tokens)`` says. ``length``: the padded prompt length, one the layout
        accepts (evaluation.lengths.Buckets) and at least the longest prompt. ``real``: the
        rows that count (the others fill the batch): generation ends when they are done."""
        from data.batching import to_layout
        from evaluation.lengths import pad_rows
        from parallel.layouts import inverse, permutation
        a, S = self.config.attention, self.shards
        B, L = len(prompts), int(length)
        ends = stop_set(eos)
        n_B = np.array([len(p) for p in prompts])
        if n_B.min() < 1 or n_B.max() > L:
            raise ValueError(f"prompts of {n_B.min()}-{n_B.max()} tokens do not fit rows of {L}")
        gen_slots = max(1, -(-(max_new_tokens - 1) // S))
        natural, real_BL = pad_rows(prompts, L)
        natural["cache_pos"] = np.where(real_BL, np.arange(L), EMPTY).astype(np.int32)
        rows = to_layout(natural, a.layout, S, int(a.stripe))
        cache_pos = np.concatenate(  # each device's prompt slots, then its G empty ones
            [rows["cache_pos"].reshape(B, S, L // S),
             np.full((B, S, gen_slots), EMPTY, np.int32)], axis=2).reshape(B, -1)
        last_B = inverse(permutation(a.layout, L, S, int(a.stripe)))[n_B - 1].astype(np.int32)
        key = jax.random.key(seed)
        key, sub = jax.random.split(key)
        cache, token_B = self._prefill(gen_slots, sampling)(
            params, rows["tokens"], rows["positions"], rows["segment_ids"], cache_pos, last_B, sub)
        decode = self._decode(L // S, sampling)
        out: list[list[int]] = [[] for _ in prompts]
        done = np.arange(B) >= (B if real is None else real)
        pos_B = jnp.asarray(n_B.astype(np.int32))
        for t in range(max_new_tokens):
            ahead = None
            if t + 1 < max_new_tokens:  # dispatched before this token is read
                key, sub = jax.random.split(key)
                cache, ahead = decode(params, cache, token_B, pos_B + t, jnp.int32(t), sub)
            for i, tok in enumerate(np.asarray(token_B).tolist()):
                if done[i]:
                    continue
                if tok in ends:
                    done[i] = True
                    continue
                out[i].append(tok)
                if len(out[i]) == max_new_tokens or (stop is not None and stop(i, out[i])):
                    done[i] = True
            if done.all() or ahead is None:
                break
            token_B = ahead
        return out
