"""All-gather context parallelism (parallel/strategies/allgather.py) against the float64
reference: every layout, MHA and GQA, packed documents, N in {2, 4}, fp32 and bf16, outputs and
gradients of q, k, v. Through a fused kernel: test_kernels' group_of_7[allgather-pallas_tpu].

Every layout of a case reuses one compiled program (positions are runtime data), so each case
costs one compilation; the cases cover every value of each dimension.
"""
import jax
import jax.numpy as jnp
import pytest

from helpers import D, collectives, ring_mesh, run_all_layouts
from parallel.attention import context_parallel_attention

LAYOUTS = [("contiguous", 1), ("striped", 1), ("zigzag", 1)]
HEADS = {"mha": (4, 4), "gqa4": (4, 1)}
TOL = {"float32": 1e-5, "bfloat16": 2e-2}


# 2 and 4 devices (8 gathers more blocks through the same program), MHA in fp32 and GQA in
# bf16 (fp32 GQA on 4 devices: test_allgather_with_reduce_scatter below; a fused kernel:
# test_kernels' group_of_7[allgather-pallas_tpu]); causal without segment ids: the
# reduce-scatter test.
@pytest.mark.parametrize("n,heads,mask,dtype", [(2, "mha", "packed", "float32"),
                                                (4, "gqa4", "packed", "bfloat16")])
def test_allgather_matches_reference(rng, n, heads, mask, dtype):
    layouts = LAYOUTS + [("striped", 2)] if n == 4 else LAYOUTS
    run_all_layouts(rng, n, HEADS[heads], mask, "allgather", layouts=layouts, block_q=4,
                    block_kv=2, dtype=jnp.dtype(dtype), tol=TOL[dtype])


@pytest.fixture
def scatter_mode(monkeypatch):
    """Sets which platforms all-reduce instead of reduce-scattering dK/dV; the compiled
    programs (cached per configuration) are dropped before and after."""
    from parallel.strategies import allgather, engine

    def set_mode(platforms):
        engine.backward_program.cache_clear()
        monkeypatch.setattr(allgather, "ALL_REDUCE_INSTEAD_OF_SCATTER", platforms)
    yield set_mode
    engine.backward_program.cache_clear()


def test_allgather_with_reduce_scatter(rng, scatter_mode):
    """The accelerators' path (reduce-scatter) is exact too."""
    scatter_mode(set())
    run_all_layouts(rng, 4, (4, 2), "causal", "allgather", layouts=[("zigzag", 1)], block_q=4, block_kv=4)


@pytest.mark.parametrize("scatter", [True, False], ids=["reduce_scatter", "cpu_all_reduce"])
def test_allgather_traffic(scatter_mode, scatter):
    """Forward: K/V (the Hkv heads only, input dtype) and positions gathered once, nothing
    else moves. Backward: gathered again (residuals stay sharded), fp32 dK/dV reduce-scattered
    (on a CPU: all-reduced, then each device keeps its chunk)."""
    scatter_mode(set() if scatter else {"cpu"})
    n = 4
    q = jnp.zeros((1, 8 * n, 4, D), jnp.bfloat16)
    kv = jnp.zeros((1, 8 * n, 1, D), jnp.bfloat16)
    f = lambda q, k, v: context_parallel_attention(q, k, v, mesh=ring_mesh(n), layout="striped",
                                                   block_q=4, impl="allgather")
    fwd = collectives(jax.make_jaxpr(f)(q, kv, kv).jaxpr)
    block = (1, 1, 8, D)  # [B, Hkv, chunk, D] per device
    assert sorted(fwd) == sorted([("all_gather", "bfloat16", block)] * 2 + [("all_gather", "int32", (1, 8))])
    both = collectives(jax.make_jaxpr(lambda q, k, v: jax.vjp(f, q, k, v)[1](q))(q, kv, kv).jaxpr)
    reduce = [c for c in both if c[0] in ("reduce_scatter", "psum_scatter", "psum", "psum_invariant")]
    assert [c[1:] for c in reduce] == [("float32", (1, 1, 8 * n, D))] * 2
    assert all((c[0] in ("reduce_scatter", "psum_scatter")) == scatter for c in reduce)
    assert not [c for c in both if c[0] in ("ppermute", "all_to_all")]
    assert len([c for c in both if c[0] == "all_gather"]) == 2 * len(fwd)
