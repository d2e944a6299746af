"""The fused per-round kernels (Pallas GPU / TPU) against the float64 reference.

On a CPU both run in Pallas interpret mode; on a GPU/TPU host the native one runs for real
(``STRIPEDJAX_PALLAS_INTERPRET=0`` forces real kernels everywhere). Shapes are small: a ring
program compiles once per (kernel, ring size, heads, mask, dtype) and every layout reuses it,
so the layouts are the cheap axis of the matrix.
"""
import functools
import itertools
import math
import os
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from errors import KernelError
from parallel import kernels
from parallel.attention import context_parallel_attention
from parallel.kernels import accumulators as ac
from parallel.kernels import fused, predicate, tables, tiling, xla
from parallel.kernels.spec import RoundSpec, Tile
from parallel.layouts import LAYOUTS as LAYOUT_NAMES, permutation
from helpers import (B, D, L, check, inputs, missing_pairs, reference, rel_err, random_segments,
                     ring_mesh, ring_outputs, run_all_layouts)

PALLAS = ("pallas_gpu", "pallas_tpu")
LAYOUTS = [("contiguous", 1), ("striped", 1), ("striped", 2), ("zigzag", 1)]
HEADS = {"mha": (4, 4), "gqa4": (4, 1), "gqa3": (6, 2)}
# Kernel x ring size x heads x mask x dtype. Every layout runs in every case (the layouts share
# the case's compiled program: positions are data; a ring of one, where every layout is the
# identity, runs one: layouts_for). By default the six cases below hold every
# pair of values of any two factors (each kernel at ring sizes 1, 2 and 4, so every pair with
# the kernel too; asserted below, with gqa3 and gqa4 both GQA): a case compiles a forward and a
# backward program in interpret mode (~7 s), and the product would be 48. One GQA case runs
# group 3 (6 query heads over 2 kv heads): an uneven group over several q and kv tiles, which the
# Triton dK/dV program steps through query head by query head (pallas_gpu.py).
# STRIPEDJAX_FULL_KERNEL_MATRIX=1 runs the whole product for both kernels, and that case (a
# GPU/TPU host running the real kernels: scripts/device_check.sh does).
FULL_MATRIX = os.environ.get("STRIPEDJAX_FULL_KERNEL_MATRIX") == "1"
UNEVEN = ("pallas_gpu", 4, "gqa3", "causal", "bfloat16")
if FULL_MATRIX:
    CASES = list(itertools.product(PALLAS, (1, 2, 4), ("mha", "gqa4"), ("causal", "packed"),
                                   ("float32", "bfloat16"))) + [UNEVEN]
else:
    CASES = [("pallas_gpu", 1, "gqa4", "packed", "float32"),
             ("pallas_gpu", 2, "mha", "causal", "float32"),
             UNEVEN,
             ("pallas_tpu", 1, "mha", "causal", "bfloat16"),
             ("pallas_tpu", 2, "gqa4", "packed", "bfloat16"),
             ("pallas_tpu", 4, "mha", "packed", "float32")]
assert not missing_pairs([(k, n, h[:3], m, t) for k, n, h, m, t in CASES])


def tiles(kernel):
    """Small tiles in interpret mode (many tiles per chunk); Triton's dots need 16 and more."""
    real = not kernels.interpret(kernel, jax.devices()[0].platform)
    return (16, 16) if real else (4, 8)
TOL = {"float32": 1e-5, "bfloat16": 2e-2}
# A ring of one holds the whole row in every layout (each permutation is the identity): every
# layout would run the same inputs through the same program, so a ring of one runs one layout.
assert all(np.array_equal(permutation(lay, L, 1, s), np.arange(L)) for lay, s in LAYOUTS)


def layouts_for(n, layouts=LAYOUTS):
    return layouts if n > 1 else layouts[:1]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_fused_ring_matches_reference(rng, case):
    kernel, n, heads, mask, dtype = case
    bq, bk = tiles(kernel)
    run_all_layouts(rng, n, HEADS[heads], mask, dtype=jnp.dtype(dtype), tol=TOL[dtype],
                    layouts=layouts_for(n), block_q=bq, block_kv=bk, kernel=kernel)


# Per kernel, a packed fp32 case of CASES whose compiled program the test below reuses.
UNORDERED = {"pallas_gpu": (1, "gqa4"), "pallas_tpu": (4, "mha")}
assert all((k, n, h, "packed", "float32") in CASES for k, (n, h) in UNORDERED.items())


@pytest.mark.parametrize("kernel", PALLAS)
def test_unordered_positions_stay_exact(rng, kernel):
    """Positions in no particular order within a shard (a user's): the visit table's range then
    includes skipped tiles, which run masked, so the answer is still exact. The ring size, heads,
    tiles and packed fp32 inputs of a test_fused_ring_matches_reference case (UNORDERED):
    positions are data, so this runs that case's compiled programs."""
    n, heads = UNORDERED[kernel]
    q, k, v, dout = inputs(rng, *HEADS[heads])
    seg = random_segments(rng, B, L)
    pos = np.stack([rng.permutation(L) for _ in range(B)]).astype(np.int32)
    order = np.argsort(pos, axis=1)  # the reference's natural order is by position
    take = lambda x: np.take_along_axis(x, order[..., None, None], 1)
    seg_sorted = np.take_along_axis(seg, order, 1)
    want = reference(take(q), take(k), take(v), take(dout), np.sort(pos, 1), seg_sorted)
    bq, bk = tiles(kernel)
    got = ring_outputs(q, k, v, dout, mesh=ring_mesh(n), layout="contiguous", positions=pos,
                       segment_ids=np.take_along_axis(seg_sorted, np.argsort(order, 1), 1),
                       block_q=bq, block_kv=bk, kernel=kernel)
    check([take(g) for g in got], want, 1e-5)


def test_auto_resolves_per_platform():
    assert kernels.resolve("auto", "cpu") == "xla"
    assert kernels.resolve("auto", "gpu") == "pallas_gpu"
    assert kernels.resolve("auto", "tpu") == "pallas_tpu"
    assert kernels.resolve("pallas_tpu", "cpu") == "pallas_tpu"
    assert kernels.interpret("pallas_gpu", "cpu") and kernels.interpret("pallas_tpu", "gpu")
    assert not kernels.interpret("xla", "cpu")
    with pytest.raises(kernels.KernelError, match="valid: auto, xla, pallas_gpu, pallas_tpu, cudnn"):
        kernels.resolve("triton", "gpu")


# ----------------------------------------------------------------------------- non-causal


# Every strategy at a ring size its heads allow: (N, (Hq, Hkv), arguments). dense is a ring of
# one, which is what attention.impl=dense runs with a fused kernel (with xla it is XLA's dense
# attention: test_attention's test_dense_attention_matches_reference, bidirectional too).
STRATEGIES = {"dense": (1, (4, 2), {}), "ring": (4, (4, 2), {}), "allgather": (4, (4, 2), {}),
              "ulysses": (2, (4, 2), {}), "usp": (4, (4, 2), {"ulysses": 2})}
# (strategy, kernel, mask). "mixed" packs documents in one row and leaves the other one
# document, whose tiles a fused kernel runs unmasked (its visit tables are per row). By default
# each fused kernel runs as the ring of one, and xla in the ring without segment ids (every tile
# unmasked) and in usp with them (its all-to-all, chunk pairs and ring of groups: ulysses is usp
# with U = N, and allgather moves the same blocks in one round; causality is the tile
# predicate's, the same for every strategy); a compilation each, ~3-5 s. The full matrix runs
# every strategy with every kernel, with and without segment ids.
if FULL_MATRIX:
    NON_CAUSAL = [c for c in itertools.product(STRATEGIES, ("xla", *PALLAS), ("whole", "mixed"))
                  if c[:2] != ("dense", "xla")]
else:
    NON_CAUSAL = [("dense", "pallas_gpu", "mixed"), ("dense", "pallas_tpu", "mixed"),
                  ("ring", "xla", "whole"), ("usp", "xla", "mixed")]


@pytest.mark.parametrize("case", NON_CAUSAL, ids=lambda c: "-".join(c))
def test_non_causal_matches_reference(rng, case):
    """causal=False: every key of the row visible (of the query's document with segment ids),
    so no tile is skipped for lying in the future; outputs and dQ/dK/dV in every layout (a ring
    of one: in one, layouts_for) against the float64 reference."""
    impl, kernel, mask = case
    n, heads, kw = STRATEGIES[impl]
    bq, bk = tiles(kernel) if kernel != "xla" else (4, 8)
    run_all_layouts(rng, n, heads, mask, "ring" if impl == "dense" else impl, causal=False,
                    layouts=layouts_for(n, [(layout, 1) for layout in LAYOUT_NAMES]),
                    block_q=bq, block_kv=bk, kernel=kernel, **kw)


# ----------------------------------------------------------------------------- default tiles

CHUNKS = [1 << i for i in range(7, 16)]  # 128 .. 32768 tokens per device


@pytest.mark.parametrize("kernel,arch", [("pallas_gpu", "sm_80"), ("pallas_gpu", "sm_86"),
                                         ("pallas_gpu", "sm_90"), ("pallas_tpu", None)])
def test_default_tiles_fit_every_model(kernel, arch):
    """Every query-head group 1..16, head dim and chunk: the default tiles divide the chunk (the
    chunk itself when shorter), and every array a Triton program holds is a power of two >= 16
    (its q rows are block_q of one head: pallas_gpu.py), or Mosaic's tile rules hold."""
    for group, head_dim, chunk, dtype in itertools.product(range(1, 17), (64, 128, 256), CHUNKS,
                                                           ("bfloat16", "float16")):
        tiles = tiling.plan(kernel, None, None, group=group, head_dim=head_dim, dtype=dtype,
                            chunk=chunk, seq_len=chunk * 8, shards=8, interpret=False,
                            arch=arch or "sm_90")
        for t in tiles:
            assert chunk % t.block_q == 0 and chunk % t.block_kv == 0, (group, head_dim, chunk, t)
            if kernel == "pallas_gpu":
                for side in (t.block_q, t.block_kv, head_dim):
                    assert side >= 16 and side & (side - 1) == 0, (group, head_dim, chunk, t)
            else:
                assert (t.block_q * group) % 8 == 0 and t.block_q * group <= max(512, group * 8)
                assert t.block_kv % 128 == 0


@pytest.mark.parametrize("kernel,block_q,block_kv,message", [
    ("pallas_gpu", 24, 16, "block_q=24 does not divide the per-device chunk of 128 tokens"),
    ("pallas_gpu", 8, 16, "block_q=8: the Triton kernel (pallas_gpu) needs powers of two >= 16"),
    ("pallas_tpu", 8, 64, "block_kv=64: the Mosaic kernel (pallas_tpu) needs a multiple of 128"),
])
def test_a_tile_the_kernel_cannot_run_is_one_line(kernel, block_q, block_kv, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        tiling.plan(kernel, block_q, block_kv, group=3, head_dim=128, dtype="bfloat16", chunk=128,
                    seq_len=512, shards=4, interpret=False)
    assert "\n" not in str(e.value)
    # interpret mode (a CPU) runs any tile that divides the chunk
    if "divide" not in message:
        tiling.plan(kernel, block_q, block_kv, group=3, head_dim=128, dtype="bfloat16", chunk=128,
                    seq_len=512, shards=4, interpret=True)


def test_a_new_kernel_is_one_module_and_one_registry_entry(rng, monkeypatch):
    """A kernel no code names: its module (built here: xla's round interface behind its own tile
    rules) and its REGISTRY entry are all that tiling.plan, the registry and the ring need."""
    name, seen = "test_only_kernel", []
    mod = types.ModuleType(f"parallel.kernels.{name}")
    mod.ANY_CHUNKS, mod.queries, mod.grad_queries = xla.ANY_CHUNKS, xla.queries, xla.grad_queries
    mod.default_tiles = lambda group, head_dim, dtype, arch: (Tile(8, 16, 2, 1), Tile(4, 8),
                                                               Tile(16, 4))

    def check_tile(names, tile, group, head_dim, chunk):
        if tile.block_kv % 4:
            raise KernelError(f"{names[1]}={tile.block_kv}: the test kernel needs a multiple of 4")

    def attend(spec, query, kv, acc):
        seen.append(("fwd", spec.kernel, spec.fwd))
        return xla.attend(spec, query, kv, acc)

    def attend_grads(spec, query, kv, dq):
        seen.append(("dq", spec.kernel, spec.dq))
        return xla.attend_grads(spec, query, kv, dq)

    mod.check_tile, mod.attend, mod.attend_grads = check_tile, attend, attend_grads
    monkeypatch.setitem(sys.modules, mod.__name__, mod)  # both undone after the test
    monkeypatch.setitem(kernels.REGISTRY, name, kernels.Kernel(platform=None, fused=False))
    assert kernels.resolve(name, "cpu") == name and kernels.rounds(name) is mod
    assert not kernels.interpret(name, "cpu")

    def plan(chunk, block_q=None, block_kv=None, interpret=False):
        return tiling.plan(name, block_q, block_kv, group=2, head_dim=D, dtype="float32",
                           chunk=chunk, seq_len=4 * chunk, shards=4, interpret=interpret)

    # its defaults; fitted to a chunk they do not divide (24: the largest power of two that
    # does) or that is shorter (8: the chunk); a user's tile for all three, checked by its rule
    assert plan(32) == (Tile(8, 16, 2, 1), Tile(4, 8, 4, 2), Tile(16, 4, 4, 2))
    assert plan(24) == plan(8) == (Tile(8, 8, 2, 1), Tile(4, 8, 4, 2), Tile(8, 4, 4, 2))
    assert plan(24, 12, 8) == (Tile(12, 8, 2, 1), Tile(12, 8, 4, 2), Tile(12, 8, 4, 2))
    with pytest.raises(KernelError, match=r"^block_kv=6: the test kernel needs a multiple of 4$"):
        plan(24, 12, 6)
    assert plan(24, 12, 6, interpret=True)[0] == Tile(12, 6, 2, 1)  # its rule: real kernel only
    with pytest.raises(ValueError, match="block_q=5 does not divide the per-device chunk of 24"):
        plan(24, 5, 8)

    # the ring runs it with the planned tiles (chunk L / 2 = 32), exact against float64
    run_all_layouts(rng, 2, (4, 2), "packed", layouts=[("striped", 1)], kernel=name)
    assert {x[2] for x in seen if x[0] == "fwd"} == {Tile(8, 16, 2, 1)}
    assert {x[2] for x in seen if x[0] == "dq"} == {Tile(4, 8, 4, 2)}
    assert {x[1] for x in seen} == {name}


# With the full matrix only (a GPU/TPU host: scripts/device_check.sh, where the default tiles
# are the real kernels' own), all four groups with both kernels. By default, groups that are
# no power of two run in test_fused_ring_matches_reference (group 3, pallas_gpu) and in
# test_group_of_7_query_heads_per_kv_head_in_every_strategy_and_kernel (group 7, both kernels),
# and a default tile clamped to a CPU's chunk is one tile a chunk, which the Pallas train.py run
# below runs (its 64-position tiles on chunks of 32).
if FULL_MATRIX:  # collected with the full matrix only (covered by default as said above)
    @pytest.mark.parametrize("kernel,group", [(k, g) for k in PALLAS for g in (3, 5, 6, 7)])
    def test_any_group_with_default_tiles(rng, kernel, group):
        """GQA groups that are no power of two, with the kernels' default tiles (clamped to the
        chunk here), packed documents, every layout, against the float64 reference. A ring of
        two on the simulated CPU devices; of one on a one-GPU host (scripts/device_check.sh)."""
        n = min(2, len(jax.devices()))
        run_all_layouts(rng, n, (group, 1), "packed", layouts=LAYOUTS, kernel=kernel)


# Qwen2.5-7B's 7 query heads per kv head (28/4) through every strategy: (N, (Hq, Hkv), arguments,
# layout). Ulysses splits whole head groups, so 7/1 cannot split U=2 ways: those two run 14/2
# (still group 7); test_group_7_that_cannot_split_is_one_line names the refusal.
GROUP_7 = {"ring": (2, (7, 1), {}, "striped"), "allgather": (2, (7, 1), {}, "zigzag"),
           "ulysses": (2, (14, 2), {}, "contiguous"), "usp": (4, (14, 2), {"ulysses": 2}, "zigzag")}
# By default each fused kernel through a strategy that calls it chunk pair by chunk pair:
# allgather (one chunk of queries against each gathered chunk) and ulysses (after the all-to-all
# that splits the 7-groups, every chunk of queries against every chunk: several q chunks, whose
# dQ the pair loop slices and puts back). usp runs the same all-to-all and chunk pairs in each
# round of its ring of groups (the ring with a fused kernel: test_fused_ring_matches_reference;
# usp with xla: test_usp); an odd group in the ring: test_fused_ring_matches_reference's group
# 3 (xla treats every group alike: a reshape, run by every GQA case). The full matrix runs
# every strategy with every kernel (about 2 minutes on 2 cores instead of 15 s).
if FULL_MATRIX:
    GROUP_7_CASES = list(itertools.product(GROUP_7, ("xla", *PALLAS)))
else:
    GROUP_7_CASES = [("allgather", "pallas_tpu"), ("ulysses", "pallas_gpu")]


@pytest.mark.parametrize("case", GROUP_7_CASES, ids=lambda c: "-".join(c))
def test_group_of_7_query_heads_per_kv_head_in_every_strategy_and_kernel(rng, case):
    """Outputs and dQ/dK/dV against the float64 reference, packed documents, several q and kv
    tiles per chunk (one layout per strategy: the layouts share the program)."""
    impl, kernel = case
    n, heads, kw, layout = GROUP_7[impl]
    bq, bk = tiles(kernel) if kernel != "xla" else (4, 8)
    run_all_layouts(rng, n, heads, "packed", impl, layouts=[(layout, 1)], block_q=bq,
                    block_kv=bk, kernel=kernel, **kw)


@pytest.mark.parametrize("impl,n,u,message", [
    ("ulysses", 2, None, r"^ulysses splits heads over the 2-way sequence axis, but query heads "
     r"\(7\) and kv heads \(1\) per tensor shard are not both divisible by 2; sequence axis sizes "
     r"that work: 1 \(or usp/ring/allgather\)$"),
    ("usp", 4, 2, r"^usp ulysses degree 2 must divide the sequence axis \(4\) and both query "
     r"heads \(7\) and kv heads \(1\) per tensor shard; valid: 1$"),
])
def test_group_7_that_cannot_split_is_one_line(impl, n, u, message):
    """7 query heads over 1 kv head (Qwen2.5-7B's 28/4 over mesh.tensor=4) split over no
    Ulysses degree but 1: the head check says so before anything runs."""
    q, kv = jnp.zeros((1, 8 * n, 7, D)), jnp.zeros((1, 8 * n, 1, D))
    with pytest.raises(ValueError, match=message):
        context_parallel_attention(q, kv, kv, mesh=ring_mesh(n), layout="striped", impl=impl,
                                   ulysses=u)


# ----------------------------------------------------------------------------- visit tables


def _brute(q_pos, k_pos, q_seg, k_seg, bq, bk):
    """[B, nq, nk] any-visible and all-visible per tile pair, from the elementwise mask."""
    vis = predicate.visible(q_pos, k_pos, q_seg, k_seg)  # [B, Cq, Ck]
    t = vis.reshape(vis.shape[0], q_pos.shape[1] // bq, bq, k_pos.shape[1] // bk, bk)
    return t.any((2, 4)), t.all((2, 4))


def _covered(table, n_inner):
    """[B, n_outer, n_inner] visited and unmasked masks from a (lo, flo, fhi, hi) table."""
    j = np.arange(n_inner)
    lo, flo, fhi, hi = (np.asarray(table)[..., i, None] for i in range(4))
    return (j >= lo) & (j < hi), (j >= flo) & (j < fhi)


@pytest.mark.parametrize("ordered", [True, False])
def test_visit_table_covers_every_visible_pair(rng, ordered):
    """Every tile pair with a visible (q, k) pair is visited; every pair run unmasked is fully
    visible (forward/dQ table and the transposed dK/dV table). On layout positions with packed
    segments the visited set is exactly the predicate's computed tiles: no extra work."""
    n, bq, bk = 4, 4, 2
    seg = random_segments(rng, B, L, max_docs=6)
    # one compiled program for every round (eagerly, each call ran a few dozen small ops)
    visits = jax.jit(functools.partial(tables.visits, block_q=bq, block_kv=bk))
    for layout in ("contiguous", "striped", "zigzag"):
        perm = permutation(layout, L, n)
        chunk = L // n
        for d in range(n):
            for src in range(n):
                q_pos = np.broadcast_to(perm[d * chunk:(d + 1) * chunk], (B, chunk)).copy()
                k_pos = np.broadcast_to(perm[src * chunk:(src + 1) * chunk], (B, chunk)).copy()
                if not ordered:
                    q_pos, k_pos = rng.permuted(q_pos, axis=1), rng.permuted(k_pos, axis=1)
                q_seg = np.take_along_axis(seg, q_pos, 1)
                k_seg = np.take_along_axis(seg, k_pos, 1)
                t = visits(q_pos, k_pos, q_seg, k_seg)
                some, every = _brute(q_pos, k_pos, q_seg, k_seg, bq, bk)
                for table, s, e in ((t.by_q, some, every),
                                    (t.by_kv, some.transpose(0, 2, 1), every.transpose(0, 2, 1))):
                    visited, unmasked = _covered(table, s.shape[-1])
                    assert np.all(visited[s]), "a tile with a visible pair is not visited"
                    assert np.all(e[unmasked]), "a tile run without the mask has a hidden pair"
                    if ordered:
                        cases = np.stack([predicate.tile_cases(q_pos[r], k_pos[r], q_seg[r], k_seg[r],
                                                        block_q=bq, block_kv=bk) for r in range(B)])
                        if table is t.by_kv:
                            cases = cases.transpose(0, 2, 1)
                        assert np.array_equal(visited, cases != predicate.SKIP)
                        assert np.array_equal(unmasked, cases == predicate.FULL)
                # an empty round is skipped whole only when nothing is visible
                assert bool(t.any) >= bool(some.any())
                if ordered:
                    assert bool(t.any) == bool(some.any())


# ----------------------------------------------------------------------------- edge rows


def _spec(kernel, hq, hkv, has_seg=True):
    interp = kernels.interpret(kernel, jax.devices()[0].platform)
    tile = Tile(8, 4) if interp else Tile(16, 16)
    return RoundSpec(kernel, tile, tile, tile, hq // hkv, hkv, D, 1.0 / math.sqrt(D), True,
                     has_seg, interp)


# The kernel calls of the test below, each jitted as the ring runs them (eagerly, its few dozen
# small ops compiled one by one cost more than the kernels): one program per stage and kernel.
@functools.partial(jax.jit, static_argnums=0)
def _round_query(spec, q, q_pos, q_seg, kv):
    """(the prepared queries, fresh accumulators, whether the block's visit table has work)."""
    query = fused.prepare(q, q_pos, q_seg, spec)
    acc0 = ac.init_acc(ac.to_q_major(q, spec.kv_heads).astype(jnp.float32))
    return query, acc0, fused._visits(spec, spec.fwd, query, kv).any


_attend = jax.jit(fused.attend, static_argnums=0)
_finalize = jax.jit(lambda acc: (ac.from_q_major(ac.finalize(acc)[0]), ac.finalize(acc)[1]))


@functools.partial(jax.jit, static_argnums=0)
def _round_grads(spec, query, q, q_pos, q_seg, kv, acc, do):
    """fused.grads of one block, given its accumulators (``out``, ``lse``) and dO; and the xla
    kernel's backward on the same inputs."""
    out, lse = ac.finalize(acc)
    do_q = ac.to_q_major(do, spec.kv_heads)
    delta = jnp.sum(do_q * out, -1)
    dq0 = jnp.zeros_like(out)
    got = fused.grads(spec, query, kv, fused.fold_rows(do_q),
                      fused.fold_rows(lse), fused.fold_rows(delta), dq0)
    with jax.default_matmul_precision("highest"):  # a GPU's XLA rounds fp32 dots to TF32
        want = xla.attend_block_bwd(ac.to_q_major(q, spec.kv_heads) * spec.scale, kv, q_pos,
                                    q_seg, do_q, lse, delta, dq0, block_q=8, block_kv=4)
    return got, want


@pytest.mark.parametrize("kernel", PALLAS)
def test_rows_with_no_visible_key_and_empty_rounds(rng, kernel):
    """A round with nothing visible changes nothing; rows whose keys come in a later block stay
    exact and NaN-free; with the global lse of a row that saw no key (+inf) every gradient is
    finite and that row's dQ is exactly 0."""
    c, hq, hkv = 16, 4, 2
    spec = _spec(kernel, hq, hkv)
    q = jnp.asarray(rng.standard_normal((1, c, hq, D)), jnp.float32)
    kv = [rng.standard_normal((1, c, hkv, D)).astype(np.float32) for _ in range(6)]
    q_pos = jnp.arange(c, 2 * c, dtype=jnp.int32)[None]
    q_seg = jnp.asarray(np.where(np.arange(c) % 8 == 0, 1, 0), jnp.int32)[None]  # rows 0, 8: doc 1
    block = lambda k, v, pos, seg: ac.KV(jnp.asarray(k.transpose(0, 2, 1, 3)),
                                         jnp.asarray(v.transpose(0, 2, 1, 3)),
                                         jnp.asarray(pos, jnp.int32)[None],
                                         jnp.asarray(seg, jnp.int32)[None])
    a = block(kv[0], kv[1], np.arange(c), np.zeros(c))
    b = block(kv[2], kv[3], np.arange(c), np.ones(c))
    future = block(kv[4], kv[5], np.arange(2 * c, 3 * c), np.zeros(c))

    query, acc0, any_future = _round_query(spec, q, q_pos, q_seg, future)
    assert not bool(any_future)
    after_future = _attend(spec, query, future, acc0)
    for x, y in zip(after_future, acc0):
        assert np.array_equal(np.asarray(x), np.asarray(y))

    acc = _attend(spec, query, a, acc0)
    out_a, lse_a = _finalize(acc)
    lonely = np.asarray(q_seg[0] == 1)
    assert np.all(np.isfinite(np.asarray(acc.o))) and np.all(np.isfinite(np.asarray(acc.m)))
    assert np.all(np.asarray(out_a)[0, lonely] == 0)
    assert np.all(np.isinf(np.asarray(lse_a)[0, :, lonely]))

    out = np.asarray(_finalize(_attend(spec, query, b, acc))[0])
    k_all, v_all = np.concatenate([kv[0], kv[2]], 1), np.concatenate([kv[1], kv[3]], 1)
    s = np.einsum("qhd,khd->hqk", np.asarray(q[0], np.float64),
                  np.repeat(k_all[0], 2, 1)) / math.sqrt(D)
    vis = np.concatenate([np.zeros(c), np.ones(c)])[None, :] == np.asarray(q_seg[0])[:, None]
    p = np.exp(np.where(vis[None], s, -np.inf) - s.max(-1, keepdims=True))
    want = np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), np.repeat(v_all[0], 2, 1))
    assert rel_err(out[0], want) < 1e-5

    # backward with only block A seen: the lonely rows' lse is +inf
    do = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    (dq, dk, dv), (want_dq, want_dk, want_dv) = _round_grads(spec, query, q, q_pos, q_seg, a,
                                                             acc, do)
    for g in (dq, dk, dv):
        assert np.all(np.isfinite(np.asarray(g)))
    assert np.all(np.asarray(dq).transpose(0, 2, 1, 3, 4)[0, lonely] == 0)
    # and it agrees with the XLA kernel's backward on the same inputs
    for g, w in ((dq, want_dq), (dk, want_dk), (dv, want_dv)):
        assert rel_err(g, w) < 1e-5


# ----------------------------------------------------------------------------- Mosaic lowering


def test_tpu_kernels_lower_to_mosaic():
    """The TPU kernels go through Mosaic's lowering rules (not interpret mode): every primitive
    they use has a TPU lowering. A CPU has no TPU to tell the chip, so v5e's is given; Mosaic's
    own layout passes run later, in the TPU compiler, and are not checked here."""
    from jax._src.pallas.mosaic import tpu_info
    from parallel.kernels import pallas_tpu
    kind = jax.devices()[0].device_kind
    tpu_info.registry.setdefault(kind, lambda: tpu_info.get_tpu_info_for_chip(
        tpu_info.ChipVersion.TPU_V5E, 1))
    g, kh, c = 2, 2, 1024
    tile = Tile(128, 128)
    spec = RoundSpec("pallas_tpu", tile, tile, tile, g, kh, 128, 128 ** -0.5, True, True, False)
    sds = jax.ShapeDtypeStruct
    q, k = sds((kh, c * g, 128), jnp.bfloat16), sds((kh, c, 128), jnp.bfloat16)
    table, rows = sds((1, c // 128, 4), jnp.int32), sds((1, c * g), jnp.int32)
    keys, vec = sds((1, c), jnp.int32), sds((kh, c * g), jnp.float32)
    calls = [(pallas_tpu.forward, (table, q, k, k, rows, keys, rows, keys)),
             (pallas_tpu.backward_dq, (table, q, k, k, q, vec, vec, rows, keys, rows, keys)),
             (pallas_tpu.backward_dkv, (table, q, k, k, q, vec, vec, rows, keys, rows, keys))]
    for f, args in calls:
        text = jax.jit(lambda *a, f=f: f(spec, *a)).trace(*args).lower(
            lowering_platforms=("tpu",)).as_text()
        assert "tpu_custom_call" in text, f.__name__


# ----------------------------------------------------------------------------- dense via fused


def test_dense_impl_uses_the_fused_kernel(rng):
    """attention.impl=dense with a Pallas kernel runs it as a ring of one, equal to XLA dense.
    The heads, tiles and packed fp32 inputs of test_fused_ring_matches_reference[pallas_gpu-1-
    gqa4-packed-float32]: the backend's ring of one runs that case's compiled forward."""
    from model.layers import AttentionBackend
    q, k, v, _ = inputs(rng, *HEADS["gqa4"])
    seg = jnp.asarray(random_segments(rng, B, L))
    bq, bk = tiles("pallas_gpu")  # a real Triton kernel (a GPU host) needs tiles of 16 or more
    fused_dense = AttentionBackend(impl="dense", kernel="pallas_gpu", block_q=bq, block_kv=bk)
    assert fused_dense._fused_dense()
    got = fused_dense(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), seg)
    with jax.default_matmul_precision("highest"):  # a GPU's XLA rounds fp32 dots to TF32
        want = jax.jit(AttentionBackend(impl="dense"))(q, k, v, seg)
    assert rel_err(got, want) < 1e-5


# ----------------------------------------------------------------------------- benchmark


def test_bench_kernels_runs_and_agrees(tmp_path, capsys):
    """scripts/bench_kernels.py's main (in this process: its compiles are the cost, a second
    JAX start-up would add to them; scripts/device_check.sh runs it as a command on a GPU)
    stays working on a CPU (interpret mode, tiny sizes): a row per kernel (the cudnn round
    through its stand-in; bare cuDNN needs a GPU) in its table and its JSON, every kernel's
    output equal to xla's to bf16 rounding, and the causal fraction exact. One case, the
    striped ring's strictly lower round ((C-1)/2C visible: the round most of a striped ring's
    time goes to, and cuDNN's sliced call): each case compiles every kernel's forward and
    backward, the Pallas one in interpret mode (~8 s a case). The diagonal and full rounds run
    on a GPU in scripts/device_check.sh; here test_cudnn runs every round case in the ring
    against float64 and exports each one's cuDNN call."""
    import json
    from scripts import bench_kernels as bench
    out = tmp_path / "bench.json"
    assert bench.main(["--chunks", "32", "--heads", "2", "--kv-heads", "1", "--head-dim", "16",
                       "--block", "8", "--xla-block", "8", "--repeats", "1", "--cases", "striped",
                       "--json", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "| chunk | case | kernel |" in stdout
    rows = json.loads(out.read_text())["rows"]
    assert [(r["case"], r["kernel"]) for r in rows] == [
        ("striped", kernel) for kernel in ("xla", "pallas_gpu", "cudnn")]
    for r in rows:
        assert f"| 32 | striped | {r['kernel']} |" in stdout
    assert "skipping cudnn_bare: no GPU" in stdout
    c = 32
    for r in rows:
        assert r["visible_fraction"] == (c - 1) / (2 * c)
        assert r["max_err_vs_first"] < 2e-2 and r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0


# ----------------------------------------------------------------------------- end to end


def test_train_with_the_pallas_kernel_matches_xla(tmp_path):
    """``train.py --config.attention.kernel=pallas_gpu`` on the tiny config (ring of 4, striped,
    GQA, packed documents; 2 rows of 128 tokens) runs in interpret mode here, says so in its
    startup line and records the kernel in config.json; and its two losses are those of the xla
    kernel: the same two steps (the run's own config.json, seed and batches from the same data
    pipeline and cache) run here in-process through training.state.Trainer with
    attention.kernel=xla. The second step's loss depends on the first step's gradients, so both
    directions are checked. The run is train.py's entry after its flags, in this process (8
    simulated devices, as a train.py process of the tiny config has): the kernel, not the
    process, is what is checked. (train.py with the default kernel, auto = xla on a CPU, as a
    user runs it, in a process of its own: test_train_e2e.)"""
    import json
    import ml_collections
    import trained_run
    from configs.loading import load
    from data.pipeline import make_pipeline
    from parallel.mesh import make_mesh
    from test_train_e2e import losses
    from training.state import Trainer
    workdir = tmp_path / "pallas_gpu"
    sets = ["train.steps=2", "train.log_every=1", "train.eval_batches=0", "data.max_docs=24",
            "model.vocab_size=512", f"data.cache_dir={tmp_path / 'cache'}",
            "attention.kernel=pallas_gpu", "data.seq_len=128", "data.batch_size=2",
            "checkpoint.every=0"]
    proc = trained_run.entry_of(load("configs/tiny.py", sets), workdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = ml_collections.ConfigDict(json.loads((workdir / "config.json").read_text()))
    assert config.attention.kernel == "pallas_gpu"
    assert "kernel pallas_gpu (Pallas interpret mode" in proc.stdout + proc.stderr
    got = losses(workdir)
    assert len(got) == 2

    config.attention.kernel = "xla"
    mesh = make_mesh(config.mesh)
    trainer = Trainer(config, mesh)
    pipe = make_pipeline(config, mesh)
    try:
        state, want = trainer.init(config.train.seed), []
        for _ in range(2):
            state, metrics = trainer.train_step(state, next(pipe.train))
            want.append(float(metrics["loss"]))
    finally:
        pipe.train.close()
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_device_check_stage_limits_fit_its_eight_minutes():
    """scripts/device_check.sh's stage limits on a GPU (its non-rehearsal settings) add up to
    what its header and docs/kernels.md say, within the 8 minutes a lent GPU gives it."""
    import pathlib
    import re
    root = pathlib.Path(__file__).resolve().parent.parent
    text = (root / "scripts" / "device_check.sh").read_text()
    gpu = dict(re.findall(r"(\w+)=(\S+)", re.search(r"^else\n(.*?)^fi", text, re.M | re.S)[1]))
    defaults = dict(re.findall(r"^(\w+)=\$\{\w+:-([^}]*)\}", text, re.M))  # X=${X:-default}

    def limits(script):  # a stage inside a loop counts once per item (the default items)
        loop = re.search(r"^ *for \w+ in ([^;]+); do\n(.*?)^ *done", script, re.M | re.S)
        if loop:
            items = " ".join(defaults.get(w.lstrip("$"), w) for w in loop[1].split())
            inner = limits(loop[2]) * len(items.split())
            return limits(script[:loop.start()]) + inner + limits(script[loop.end():])
        return [int(gpu.get(x.lstrip("$"), x)) for x in re.findall(r"timeout -k \d+ (\S+)", script)]
    said = re.search(r"add up to (\d) min (\d+) s", text)
    total = int(said[1]) * 60 + int(said[2])
    got = limits(text)
    assert len(got) == 7 and sum(got) == total <= 8 * 60, (got, said[0])
    assert f"add up to {said[1]} min {said[2]} s" in " ".join(
        (root / "docs" / "kernels.md").read_text().split())
