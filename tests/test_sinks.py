"""Attention sinks (gpt-oss: a logit per query head in every row's softmax denominator) in
every kernel, layout and strategy, against float64 attention with the sink as one more column
(``helpers.reference``): the outputs and the gradients of q, k, v and the sinks.

The sink joins once, after the last round (``accumulators.with_sink``), and the backward reads
the sinked output and logsumexp, so what could go wrong is where the per-head sinks meet the
heads a device holds: all of them (ring, all-gather), a Ulysses member's share, a tensor
shard's; and the early-stopped ring of a sliding window. Each case is one row of the table
below; the layouts of a case share its compiled programs (positions are data).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from helpers import B, L, check, inputs, random_segments, reference
from parallel.attention import context_parallel_attention
from parallel.layouts import inverse, permutation

LAYOUTS = ("contiguous", "striped", "zigzag")
TOL = {"float32": 1e-5, "bfloat16": 2e-2}

# (kernel, impl, Ulysses degree, mesh (fsdp, sequence, tensor), heads (Hq, Hkv), mask, window,
# dtype, layouts)
CASES = {
    # every layout on the ring, GQA, packed documents
    "ring-xla": ("xla", "ring", None, (1, 4, 1), (4, 2), "packed", 0, "float32", LAYOUTS),
    # heads over tensor: each tensor shard's sinks; batch over fsdp
    "ring-tensor": ("xla", "ring", None, (2, 2, 2), (4, 2), "causal", 0, "float32", ("striped",)),
    "allgather": ("xla", "allgather", None, (1, 4, 1), (4, 4), "causal", 0, "float32",
                  ("zigzag",)),
    # a Ulysses member's share of the heads, and of a tensor shard's
    "ulysses": ("xla", "ulysses", None, (1, 4, 1), (8, 4), "packed", 0, "float32", ("striped",)),
    "usp-tensor": ("xla", "usp", 2, (1, 4, 2), (8, 4), "causal", 0, "bfloat16", ("zigzag",)),
    # a window that stops the contiguous ring early (its own positions), and striped's full ring
    "window": ("xla", "ring", None, (1, 4, 1), (4, 2), "causal", 12, "float32",
               ("contiguous", "striped")),
    # the fused kernels (interpret mode) and cuDNN's per-round stand-in
    "pallas_gpu": ("pallas_gpu", "ring", None, (1, 2, 1), (4, 2), "causal", 0, "float32",
                   ("striped",)),
    "pallas_tpu": ("pallas_tpu", "ring", None, (1, 2, 1), (4, 4), "packed", 0, "float32",
                   ("zigzag",)),
    "cudnn": ("cudnn", "ring", None, (1, 2, 1), (4, 2), "packed", 0, "bfloat16",
              ("contiguous",)),
}


def run(q, k, v, sinks, dout, *, mesh, layout, seg, **kw):
    """The attention and its gradients w.r.t. q, k, v and the sinks, inputs and results in
    natural order."""
    n = mesh.shape["sequence"]
    perm = permutation(layout, q.shape[1], n)
    qspec = NamedSharding(mesh, P(("fsdp",), "sequence", "tensor", None))
    put = lambda x, dtype: jax.device_put(jnp.asarray(x[:, perm], dtype), qspec)
    seg_l = None if seg is None else jnp.asarray(seg[:, perm])

    def f(q, k, v, sinks):
        return context_parallel_attention(q, k, v, mesh=mesh, layout=layout, segment_ids=seg_l,
                                          sinks=sinks, **kw)

    dtype = kw.pop("dtype")
    out, vjp = jax.vjp(f, *(put(x, dtype) for x in (q, k, v)), jnp.asarray(sinks))
    grads = vjp(put(dout, dtype))
    inv = inverse(perm)
    return ([np.asarray(x.astype(jnp.float32))[:, inv] for x in (out, *grads[:3])]
            + [np.asarray(grads[3])])


@pytest.mark.parametrize("case", CASES)
def test_sinks_in_every_kernel_layout_and_strategy(rng, case):
    kernel, impl, u, (fsdp, n, tensor), heads, mask, window, dtype, layouts = CASES[case]
    mesh = jax.make_mesh((fsdp, n, tensor), ("fsdp", "sequence", "tensor"),
                         devices=jax.devices()[:fsdp * n * tensor])
    q, k, v, dout = inputs(rng, *heads, dtype=jnp.dtype(dtype))
    # sinks around the rows' own logsumexps (about log L): each takes a real share of the mass
    sinks = rng.normal(2.0, 1.5, heads[0]).astype(np.float32)
    seg = random_segments(rng, B, L) if mask == "packed" else None
    pos = np.broadcast_to(np.arange(L, dtype=np.int32), (B, L))
    want = reference(q, k, v, dout, pos, seg, True, window, sinks=sinks)
    plain = reference(q, k, v, dout, pos, seg, True, window)[0]  # the sinks change the output
    assert np.abs(plain - want[0]).max() > 0.1 * np.abs(want[0]).max()
    for layout in layouts:
        got = run(q, k, v, sinks, dout, mesh=mesh, layout=layout, seg=seg, kernel=kernel,
                  impl=impl, ulysses=u, window=window, block_q=4, block_kv=4,
                  dtype=jnp.dtype(dtype))
        check(got[:4], want[:4], TOL[dtype])
        err = np.abs(got[4] - want[4]).max() / np.abs(want[4]).max()
        assert err < TOL[dtype], f"{layout}: the sinks' gradient is off by {err:.2e}"


def test_sinks_of_the_wrong_shape_are_one_line(rng):
    q, k, v, _ = inputs(rng, 4, 2)
    mesh = jax.make_mesh((2,), ("sequence",), devices=jax.devices()[:2])
    with pytest.raises(ValueError, match=r"one logit per query head, \[4\]; got \(2,\)"):
        context_parallel_attention(q, k, v, mesh=mesh, layout="striped", sinks=np.zeros(2))
