"""The xla kernel (parallel/kernels/xla.py): rows with no visible key yet, and the dense
reference attention, against float64 numpy attention."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import B, D, L, check, inputs, random_segments, reference, rel_err
from parallel.kernels import accumulators as ac
from parallel.kernels import predicate, xla
from parallel.kernels.xla import dense_attention


# ----------------------------------------------------------------------------- rows with no key yet


def test_rows_with_no_visible_key_in_first_blocks(rng):
    """A row whose visible keys all come in a later K/V block stays exact and NaN-free.

    Block A holds keys that every query of tile 1 sees except the first row of each q tile,
    which starts a new document; block B brings that row its keys. The running state after A
    must be harmless, and A∪B must equal the reference; a row that never sees a key gives 0.
    """
    c, hq, hkv = 16, 4, 2
    q = rng.standard_normal((1, c, hq, D)).astype(np.float32)
    kv = [rng.standard_normal((1, c, hkv, D)).astype(np.float32) for _ in range(4)]
    q_pos = np.arange(c, 2 * c, dtype=np.int32)[None]
    q_seg = np.where(np.arange(c) % 8 == 0, 1, 0).astype(np.int32)[None]  # rows 0, 8: doc 1
    a_pos, b_pos = np.arange(c, dtype=np.int32)[None], np.arange(c, dtype=np.int32)[None]
    a_seg, b_seg = np.zeros((1, c), np.int32), np.ones((1, c), np.int32)
    scale = 1.0 / math.sqrt(D)
    q_s = ac.to_q_major(jnp.asarray(q) * scale, hkv)
    block = lambda k, v, pos, seg: ac.KV(ac.to_kv_major(jnp.asarray(k)), ac.to_kv_major(jnp.asarray(v)),
                                         jnp.asarray(pos), jnp.asarray(seg))
    # one compiled program for both blocks (eagerly, each of the kernel's ops compiled alone)
    run = jax.jit(lambda acc, blk: xla.attend_block(q_s, blk, jnp.asarray(q_pos),
                                                    jnp.asarray(q_seg), acc, block_q=8,
                                                    block_kv=4))
    finalize = jax.jit(ac.finalize)
    assert np.all(np.asarray(predicate.tile_cases(q_pos, a_pos, q_seg, a_seg, block_q=8, block_kv=4)) == predicate.MASKED)
    acc = run(ac.init_acc(q_s), block(kv[0], kv[1], a_pos, a_seg))
    out_a, lse_a = finalize(acc)
    assert np.all(np.isfinite(np.asarray(acc.o))) and np.all(np.isfinite(np.asarray(acc.m)))
    lonely = np.asarray(q_seg[0] == 1)
    assert np.all(np.asarray(ac.from_q_major(out_a))[0, lonely] == 0)
    assert np.all(np.isinf(np.asarray(lse_a)[0, :, lonely]))
    out, _ = finalize(run(acc, block(kv[2], kv[3], b_pos, b_seg)))
    k_all = np.concatenate([kv[0], kv[2]], 1)
    v_all = np.concatenate([kv[1], kv[3]], 1)
    s = np.einsum("qhd,khd->hqk", q[0].astype(np.float64), np.repeat(k_all[0], 2, 1)) * scale
    vis = np.concatenate([a_seg, b_seg], 1)[0][None, :] == q_seg[0][:, None]
    s = np.where(vis[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), np.repeat(v_all[0], 2, 1))
    assert rel_err(ac.from_q_major(out)[0], want) < 1e-5


# ----------------------------------------------------------------------------- dense reference


# Every mask once (each a compiled program), MHA and GQA each with and without causality and
# segment ids: the head grouping and the mask are independent parts of the computation.
@pytest.mark.parametrize("mask,heads", [("causal", (4, 4)), ("packed", (4, 1)),
                                        ("bidirectional", (4, 1)),
                                        ("bidirectional-packed", (4, 4))],
                         ids=["causal-mha", "packed-gqa4", "bidirectional-gqa4",
                              "bidirectional-packed-mha"])
def test_dense_attention_matches_reference(rng, mask, heads):
    q, k, v, dout = inputs(rng, *heads)
    seg = random_segments(rng, B, L) if mask.endswith("packed") else None
    pos = np.broadcast_to(np.arange(L, dtype=np.int32), (B, L))
    causal = not mask.startswith("bidirectional")

    @jax.jit
    def run(q, k, v, dout):
        f = lambda q, k, v: dense_attention(q, k, v, positions=jnp.asarray(pos),
                                            segment_ids=None if seg is None else jnp.asarray(seg),
                                            causal=causal)
        out, vjp = jax.vjp(f, q, k, v)
        return (out, *vjp(dout))

    check([np.asarray(r) for r in run(q, k, v, dout)], reference(q, k, v, dout, pos, seg, causal), 1e-5)


def test_dense_attention_bf16_and_default_positions(rng):
    q, k, v, _ = inputs(rng, 4, 2, dtype=jnp.bfloat16)
    out = jax.jit(dense_attention)(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)))
    assert out.dtype == jnp.bfloat16
    pos = np.broadcast_to(np.arange(L, dtype=np.int32), (B, L))
    assert rel_err(np.asarray(out.astype(jnp.float32)), reference(q, k, v, q, pos, None)[0]) < 2e-2
