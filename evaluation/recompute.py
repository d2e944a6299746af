"""Generation without a cache, the reference the KV cache (evaluation/kv_cache.py) is checked
and benchmarked against: every new token runs the whole window again.

One device, dense attention, contiguous layout (the parameters depend on neither the mesh nor
the layout). The window is a fixed buffer, so one compiled program serves every token: the
smallest multiple of 64 that holds the prompt and the new tokens, capped at the run's
data.seq_len (a window that fills up slides left by one token). Slots past the current length
n get position 0, so the largest position in the pass is n - 1, as it is for an unpadded
prompt (a dynamic RoPE scaling reads it); causal masking by slot keeps them unseen.
"""
from __future__ import annotations

import functools
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from evaluation.kv_cache import Sampling, pick, stop_set


def window_size(prompt_len: int, max_new_tokens: int, seq_len: int) -> int:
    """The smallest multiple of 64 holding prompt and new tokens, at most the run's seq_len."""
    return min(seq_len, -(-(prompt_len + max_new_tokens) // 64) * 64)


@functools.cache
def make_step(graphdef, window: int, usable_vocab: int, sampling: Sampling):
    """step(params, buf [window], n, key) -> (buf, n + 1, token): appends one picked token. One
    jitted step per (model, window, vocabulary, sampling), kept for the process: a second prompt
    or a benchmark's repeat runs the compiled program instead of tracing and compiling again."""
    slots = jnp.arange(window, dtype=jnp.int32)
    segments = jnp.ones((1, window), jnp.int32)

    @jax.jit
    def step(params, buf, n, key):
        full = n >= window
        buf = jnp.where(full, jnp.roll(buf, -1), buf)
        n = jnp.where(full, window - 1, n)
        positions = jnp.where(slots < n, slots, 0)[None]
        logits_V = nnx.merge(graphdef, params)(buf[None], positions, segments)[0, n - 1]
        token = pick(logits_V[None], key, sampling, usable_vocab)[0].astype(buf.dtype)
        return buf.at[n].set(token), n + 1, token

    return step


def generate(graphdef, params, ids: list[int], max_new_tokens: int, *, seq_len: int,
             usable_vocab: int, eos: int | Iterable[int] | None,
             sampling: Sampling = Sampling(),
             seed: int = 0) -> list[int]:
    """Up to ``max_new_tokens`` tokens after ``ids`` (non-empty), ending at any id of ``eos``
    (one id, a collection of ids or None: kv_cache.stop_set; not included)."""
    ends = stop_set(eos)
    window = window_size(len(ids), max_new_tokens, seq_len)
    ids = ids[-window:]
    buf = np.zeros(window, np.int32)
    buf[:len(ids)] = ids
    step = make_step(graphdef, window, usable_vocab, sampling)
    buf, n, key = jnp.asarray(buf), jnp.int32(len(ids)), jax.random.key(seed)
    # The step returns the buffer and counter on the parameters' device, committed: start them
    # (and the key) there too, or its first call compiles it for uncommitted inputs and the
    # second again.
    first = jax.tree.leaves(params)[0]
    if getattr(first, "committed", False) and len(first.sharding.device_set) == 1:
        buf, n, key = jax.device_put((buf, n, key), next(iter(first.sharding.device_set)))
    out = []
    for _ in range(max_new_tokens):
        key, sub = jax.random.split(key)
        buf, n, token = step(params, buf, n, sub)
        token = int(token)
        if token in ends:
            break
        out.append(token)
    return out
