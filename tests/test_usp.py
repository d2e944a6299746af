"""Ulysses and the hybrid usp (parallel/strategies/usp.py) against the float64 reference: every
layout, MHA and GQA, packed documents, outputs and gradients of q, k, v; Ulysses over N in
{2, 4}, usp with (Ulysses degree, ring length) (4, 2), and (2, 2) on a mesh with Explicit axes
and heads over tensor; the head divisibility errors; the traffic of the hybrid.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from helpers import (B, D, L, check, collectives, inputs, ppermute_hops, random_segments,
                     reference, ring_mesh, run_all_layouts)
from parallel.attention import context_parallel_attention
from parallel.layouts import inverse, permutation

LAYOUTS = [("contiguous", 1), ("striped", 1), ("zigzag", 1)]


# Heads must split N ways: GQA (4 query heads per kv head) where the kv heads allow. Ulysses over
# 2 and 4 devices (8 runs the same one-round program on more devices, with the same all-to-all).
@pytest.mark.parametrize("n,heads,mask", [(2, (8, 2), "packed"), (4, (4, 4), "causal")],
                         ids=["n2-gqa4-packed", "n4-mha-causal"])
def test_ulysses_matches_reference(rng, n, heads, mask):
    layouts = LAYOUTS + [("striped", 2)] if n == 4 else LAYOUTS
    run_all_layouts(rng, n, heads, mask, "ulysses", layouts=layouts, block_q=4, block_kv=2)


# Ulysses groups of 4 in a ring of 2 groups, every layout. Groups of 2 in a ring of 2: the
# explicit-mesh test below (heads also over tensor, zigzag), test_kernels' non-causal
# [usp-xla-mixed] (every layout; a fused kernel under the same all-to-all: group_of_7's
# [ulysses-pallas_gpu], ulysses being usp with U = N); in a ring of
# 4 groups: test_window's test_window_in_every_strategy[usp-8-2-heads0] (with a window, which
# cuts it short in the contiguous layout, and the full ring); usp in bf16: test_kv_cache.
@pytest.mark.parametrize("u,ring,heads,mask", [(4, 2, (8, 4), "packed")],
                         ids=["u4-ring2-gqa2-packed"])
def test_usp_matches_reference(rng, u, ring, heads, mask):
    run_all_layouts(rng, u * ring, heads, mask, "usp", ulysses=u, block_q=2, block_kv=4)


def test_usp_with_heads_over_tensor_on_an_explicit_mesh(rng):
    """Heads also split over the tensor axis (U divides the local heads), a mesh with Explicit
    axes, under jit: the groups of the all-to-all are the sequence axis' neighbours."""
    mesh = jax.make_mesh((1, 4, 2), ("fsdp", "sequence", "tensor"), axis_types=(AxisType.Explicit,) * 3)
    q, k, v, dout = inputs(rng, 8, 4)
    seg = random_segments(rng, B, L)
    pos = np.broadcast_to(np.arange(L, dtype=np.int32), (B, L))
    spec = NamedSharding(mesh, P(None, "sequence", "tensor", None))
    perm = permutation("zigzag", L, 4)
    place = lambda x: jax.device_put(x[:, perm], spec)

    @jax.jit
    def run(q, k, v, dout, seg):
        f = lambda q, k, v: context_parallel_attention(q, k, v, mesh=mesh, layout="zigzag",
                                                       segment_ids=seg, block_q=4, block_kv=4,
                                                       impl="usp", ulysses=2)
        out, vjp = jax.vjp(f, q, k, v)
        return (out, *vjp(dout))

    with jax.set_mesh(mesh):
        res = run(place(q), place(k), place(v), place(dout),
                  jax.device_put(seg[:, perm], NamedSharding(mesh, P(None, "sequence"))))
    assert res[0].sharding.spec == spec.spec
    check([np.asarray(r)[:, inverse(perm)] for r in res], reference(q, k, v, dout, pos, seg), 1e-5)


def test_usp_traffic():
    """N=4, U=2: q/k/v go through one all-to-all each inside the pairs, then the ring of 2
    groups moves a K/V block of the ring's size (U chunks of Hkv/U heads) once forward."""
    n, u = 4, 2
    q = jnp.zeros((1, 8 * n, 4, D), jnp.bfloat16)
    kv = jnp.zeros((1, 8 * n, 2, D), jnp.bfloat16)
    f = lambda q, k, v: context_parallel_attention(q, k, v, mesh=ring_mesh(n), layout="striped",
                                                   block_q=4, impl="usp", ulysses=u)
    jaxpr = jax.make_jaxpr(f)(q, kv, kv).jaxpr
    block = (1, 2 // u, u * 8, D)  # [B, Hkv/U, U*C, D] per device
    assert ppermute_hops(jaxpr) == {("bfloat16", block): 2 * (n // u - 1), ("int32", (1, u * 8)): n // u - 1}
    a2a = [c for c in collectives(jaxpr) if c[0] == "all_to_all"]
    assert sorted(a2a) == sorted([("all_to_all", "bfloat16", (1, 8, 4, D)),  # q in
                                  ("all_to_all", "bfloat16", (1, 8 * u, 4 // u, D))]  # out back
                                 + [("all_to_all", "bfloat16", (1, 8, 2, D))] * 2)  # k, v in


@pytest.mark.parametrize("impl,n,u,heads,message", [
    ("ulysses", 4, None, (4, 2), r"^ulysses splits heads over the 4-way sequence axis, but query "
     r"heads \(4\) and kv heads \(2\) per tensor shard are not both divisible by 4; sequence axis "
     r"sizes that work: 1, 2 \(or usp/ring/allgather\)$"),
    ("ulysses", 8, None, (8, 1), r"sequence axis sizes that work: 1 \("),
    ("usp", 8, 4, (4, 2), r"^usp ulysses degree 4 must divide the sequence axis \(8\) and both "
     r"query heads \(4\) and kv heads \(2\) per tensor shard; valid: 1, 2$"),
    ("usp", 4, 3, (6, 6), r"degree 3 must divide the sequence axis \(4\) .* valid: 1, 2$"),
])
def test_heads_not_dividing_are_rejected_in_one_line(impl, n, u, heads, message):
    q, kv = jnp.zeros((1, 8 * n, heads[0], D)), jnp.zeros((1, 8 * n, heads[1], D))
    with pytest.raises(ValueError, match=message):
        context_parallel_attention(q, kv, kv, mesh=ring_mesh(n), layout="striped", impl=impl, ulysses=u)
