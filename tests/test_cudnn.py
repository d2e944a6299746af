"""The ``cudnn`` per-round kernel (``parallel/kernels/cudnn.py``).

cuDNN cannot run on a CPU, so the round decomposition (each round's case from its positions,
the strictly-lower slice, the zigzag halves, the fp32 LSE merge, the backward fed the global
output and LSE) runs here with the dense stand-in behind the same contract, against the float64
reference in every layout and window, and through the strategies' own round shapes. The real cuDNN calls are checked by exporting
the whole ring, forward and backward, for ``cuda``: which calls, which masks, which operands.
"""
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from errors import KernelError
from helpers import (B, L, inputs, reference, check, ring_mesh, ring_outputs,
                     run_all_layouts)
from parallel import kernels
from parallel.kernels import cudnn, predicate
from parallel.layouts import permutation

LAYOUTS = [("contiguous", 1), ("striped", 1), ("striped", 2), ("zigzag", 1)]
# On a GPU (scripts/device_check.sh) the real cuDNN runs, and its fallback is the real Triton
# kernel, whose tiles are 16 and more; the stand-in's xla fallback runs many small tiles.
REAL = not kernels.interpret("cudnn", jax.devices()[0].platform)
TILES = {"block_q": 16, "block_kv": 16} if REAL else {"block_q": 4, "block_kv": 8}
# A ring of one runs only the diagonal round, which every ring of 2 or more runs in its round 0:
# its cases run on a one-GPU host (scripts/device_check.sh: the real cuDNN, with
# STRIPEDJAX_FULL_KERNEL_MATRIX=1) and with the full matrix, not by default on a CPU.
ONE_DEVICE = REAL or os.environ.get("STRIPEDJAX_FULL_KERNEL_MATRIX") == "1"


# ----------------------------------------------------------------------------- classification


@pytest.mark.parametrize("layout,kw,want", [
    ("contiguous", {}, {"diagonal": 4, "full": 6, "skip": 6}),
    ("striped", {}, {"diagonal": 10, "lower": 6}),
    ("zigzag", {}, {"diagonal": 4, "kv_head": 6, "q_tail": 6}),
    ("contiguous", {"window": 5}, {"diagonal_window": 4, "skip": 9, "other": 3}),
    ("striped", {"window": 5}, {"other": 16}),
    ("striped", {"causal": False}, {"full": 16}),
    ("striped", {"seg": np.zeros(L, int)}, {"diagonal": 10, "lower": 6}),
    ("contiguous", {"seg": np.repeat([0, 1], [40, 24])},
     {"diagonal": 3, "full": 1, "skip": 8, "other": 4}),
])
def test_round_cases_of_every_layout(layout, kw, want):
    """Which rounds of a 4-device ring cuDNN runs, and how: every causal round of the three
    layouts is a cuDNN call (or nothing); a window off the diagonal, or two documents in a
    round, leave that round to the fallback kernel."""
    assert cudnn.round_cases(permutation(layout, L, 4), 4, **kw) == want


def _mask_of(r: cudnn.Round, cq, ck):
    """The visibility ``[cq, ck]`` one case's cuDNN call computes (top-left mask on its slices)."""
    seen = np.zeros((cq, ck), bool)
    q1, k1 = r.q1 or cq, r.k1 or ck
    i, j = np.arange(q1 - r.q0)[:, None], np.arange(k1 - r.k0)[None]
    part = (j <= i) if r.causal else np.ones_like(i == j)
    if r.window:
        part = part & (j > i - r.window)
    seen[r.q0:q1, r.k0:k1] = part
    return seen


def test_every_case_computes_exactly_the_visible_pairs(rng):
    """For rounds of every layout and ring size, windows, one-document segments and shuffled
    positions: whatever case ``classify`` picks (on numpy, and the same under jit), its cuDNN
    call sees exactly the pairs the one predicate makes visible."""
    jit_classify = jax.jit(cudnn.classify, static_argnames=("causal", "window"))
    seen_cases, seen_jit = set(), set()
    for layout, stripe in LAYOUTS:
        for n in (1, 2, 4, 8):
            pos = permutation(layout, L, n, stripe).reshape(n, -1)
            c = L // n
            for window in (0, 3, c // 2 + 1, c + 1):
                for d in range(n):
                    for src in range(n):
                        q, k = pos[d][None].astype(np.int32), pos[src][None].astype(np.int32)
                        if rng.random() < 0.1:  # positions in no order: never a cuDNN case
                            k = rng.permutation(k[0])[None]
                        case = cudnn.classify(q, k, window=window)
                        # under jit on a ring of 4 (a program per chunk and window: the shapes
                        # of the other rings run the same code), which reaches every case
                        if n == 4:
                            assert case == int(jit_classify(jnp.asarray(q), jnp.asarray(k),
                                                            window=window))
                            seen_jit.add(case)
                        seen_cases.add(case)
                        if case == cudnn.OTHER:
                            continue
                        want = predicate.visible(q, k, None, None, causal=True, window=window)[0]
                        spec = types_spec(window)
                        r = cudnn.rounds_of(spec, c).get(case)
                        got = np.zeros_like(want) if case == cudnn.SKIP else _mask_of(r, c, c)
                        np.testing.assert_array_equal(got, want, err_msg=f"{layout} {n} {d} "
                                                      f"{src} w={window} {cudnn.CASES[case]}")
    assert seen_cases == seen_jit == set(range(len(cudnn.CASES)))


def types_spec(window):
    from parallel.kernels.spec import RoundSpec, Tile
    t = Tile(8, 8)
    return RoundSpec("cudnn", t, t, t, 1, 1, 8, 1.0, True, False, True, window)


# ----------------------------------------------------------------------------- exactness (stand-in)

# (ring size, (Hq, Hkv), mask, dtype): every layout runs in each. "packed": segment ids of
# several documents (rounds holding two run the fallback), then of one document in every row
# (every round is then a cuDNN case, as without segment ids), under the same compiled program
# (segment ids are data). A ring of 2 runs every round case of every layout (contiguous
# diagonal, full and skip; striped lower; zigzag kv_head and q_tail: see
# test_round_cases_of_every_layout); larger rings only loop longer (the engine's,
# kernel-independent: test_attention). Causal without segment ids and GQA, in fp32: the
# window's and the strategies' cases below.
CASES = ([(1, (4, 1), "causal", "bfloat16")] if ONE_DEVICE else []) + [
    (2, (4, 4), "packed", "bfloat16")]
TOL = {"float32": 1e-5, "bfloat16": 2e-2}


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_cudnn_ring_matches_reference(rng, case):
    n, heads, mask, dtype = case
    dtype = jnp.dtype(dtype)
    run_all_layouts(rng, n, heads, mask, dtype=dtype, tol=TOL[dtype.name], layouts=LAYOUTS,
                    kernel="cudnn", **TILES)
    if mask == "packed":  # one document in every row
        q, k, v, dout = inputs(rng, *heads, dtype=dtype)
        seg = np.zeros((B, L), np.int32)
        want = reference(q, k, v, dout, np.broadcast_to(np.arange(L), (B, L)), seg)
        for layout, stripe in LAYOUTS:
            check(ring_outputs(q, k, v, dout, mesh=ring_mesh(n), layout=layout, stripe=stripe,
                               segment_ids=seg, dtype=dtype, kernel="cudnn", **TILES), want,
                  TOL[dtype.name])


# (ring size, W, dtype): W inside the diagonal block (cuDNN's sliding_window_length) on one device;
# on 2 devices (chunks of 32) W = 21 cuts the diagonal round (cuDNN's windowed call, in the
# contiguous and zigzag layouts) and leaves the rounds off it to the fallback, in every layout,
# under one program (the window reaches every round: no early stop; the early-stopping ring is
# the engine's, kernel-independent: test_window).
WINDOWS = ([(1, 5, "bfloat16")] if ONE_DEVICE else []) + [(2, 21, "float32")]


@pytest.mark.parametrize("n,window,dtype", WINDOWS)
def test_cudnn_ring_with_a_window(rng, n, window, dtype):
    run_all_layouts(rng, n, (4, 2), "causal", layouts=LAYOUTS if n > 1 else LAYOUTS[:1],
                    dtype=jnp.dtype(dtype), tol=TOL[dtype], kernel="cudnn", window=window,
                    **TILES)


# Ulysses (the round chunk pair by chunk pair after the all-to-all, which also brings cudnn's
# backward the global output it reads) and the ring without causality (every round cuDNN's
# unmasked case), fp32. usp runs the same all-to-all and chunk pairs in each round of its ring
# of groups, and allgather the chunk pairs of one chunk of queries (with a fused kernel:
# test_kernels' group_of_7[allgather-pallas_tpu]).
@pytest.mark.parametrize("impl,n,kw,causal", [("ulysses", 2, {}, True),
                                              ("ring", 2, {}, False)])
def test_cudnn_in_every_strategy(rng, impl, n, kw, causal):
    run_all_layouts(rng, n, (4, 2), "causal", impl, causal=causal, kernel="cudnn", **TILES, **kw)


def test_cudnn_activations_must_be_bf16_or_fp16(monkeypatch, rng):
    monkeypatch.setenv("STRIPEDJAX_PALLAS_INTERPRET", "0")  # the real calls, traced only
    q, k, v, dout = inputs(rng, 4, 2)
    with pytest.raises(KernelError, match="cudnn runs bf16 or fp16 activations, got float32"):
        ring_outputs(q, k, v, dout, mesh=ring_mesh(2), layout="striped", kernel="cudnn",
                     block_q=16, block_kv=16)


def test_the_registry_knows_cudnn():
    assert "cudnn" in kernels.KERNELS and kernels.resolve("cudnn", "gpu") == "cudnn"
    assert kernels.interpret("cudnn", "cpu") and not kernels.interpret("cudnn", "gpu")


# ----------------------------------------------------------------------------- the real calls


def _export_ring(monkeypatch, layout, n, window=0, seg=False):
    """The ring's forward and backward with kernel=cudnn exported for cuda: its StableHLO text."""
    from jax._src.cudnn import fused_attention_stablehlo as fa
    from parallel.attention import context_parallel_attention
    monkeypatch.setattr(fa, "check_cudnn_version", lambda: 91000)  # no cuDNN on a CPU
    monkeypatch.setenv("STRIPEDJAX_PALLAS_INTERPRET", "0")
    # The fallback's rounds as xla: JAX 0.12 lowers a Triton kernel only with a GPU (or an
    # abstract one) present; scripts/gpu_compile.py checks pallas_gpu's own lowering.
    monkeypatch.setattr(cudnn, "fallback", lambda spec: "xla")
    mesh = ring_mesh(n)

    def f(q, k, v, do, pos, *segs):
        g = lambda q, k, v: context_parallel_attention(
            q, k, v, mesh=mesh, layout=layout, positions=pos, segment_ids=segs[0] if segs else None,
            kernel="cudnn", window=window)
        out, vjp = jax.vjp(g, q, k, v)
        return (out, *vjp(do))

    sds = jax.ShapeDtypeStruct
    q = sds((1, 256, 4, 64), jnp.bfloat16)
    kv = sds((1, 256, 2, 64), jnp.bfloat16)
    pos = sds((1, 256), jnp.int32)
    checks = [export.DisabledSafetyCheck.custom_call(t) for t in
              ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward")]
    exp = export.export(jax.jit(f), platforms=["cuda"], disabled_checks=checks)(
        q, kv, kv, q, pos, *((pos,) if seg else ()))
    return exp.mlir_module()


def _cudnn_calls(text):
    """[(target, mask type, window, operand types)] of every cuDNN custom call."""
    calls = []
    for line in text.splitlines():
        m = re.search(r"stablehlo\.custom_call @(__cudnn\$\w+)\(", line)
        if not m:
            continue
        # backend_config is a JSON string inside the text: its quotes are \22
        mask = re.search(r'mask_type\\22:\s*\\22(\w+)', line)
        window = re.search(r'sliding_window_length\\22:\s*(\d+)', line)
        types = re.search(r":\s*\(([^)]*)\)\s*->", line)
        calls.append((m.group(1), mask.group(1), int(window.group(1)) if window else 0,
                      tuple(t.strip() for t in types.group(1).split(", "))))
    return calls


def test_the_ring_exports_for_cuda_with_one_cudnn_call_per_case(monkeypatch):
    """A ring of 4 devices: every case is one cuDNN forward and one backward with its mask on its
    slices (the case is chosen at run time, so the program holds them all, whatever the
    layout); the backward's operands are Q, K, V, the global LSE ``[B, N, T]`` fp32, dO and O."""
    calls = _cudnn_calls(_export_ring(monkeypatch, "striped", 4))
    fwd = {(mask, ops[0], ops[1]) for t, mask, _, ops in calls if t == "__cudnn$fmhaSoftmax"}
    q, kv, half_q, half_kv = ("tensor<1x64x4x64xbf16>", "tensor<1x64x2x64xbf16>",
                              "tensor<1x32x4x64xbf16>", "tensor<1x32x2x64xbf16>")
    lower_q, lower_kv = "tensor<1x63x4x64xbf16>", "tensor<1x63x2x64xbf16>"
    assert fwd == {("NO_MASK", q, kv), ("CAUSAL", q, kv), ("CAUSAL", lower_q, lower_kv),
                   ("NO_MASK", q, half_kv), ("NO_MASK", half_q, kv)}
    bwd = [c for c in calls if c[0] == "__cudnn$fmhaSoftmaxBackward"]
    assert {(mask, ops[0], ops[1]) for _, mask, _, ops in bwd} == fwd
    for _, _, _, ops in bwd:
        t = int(re.search(r"1x(\d+)x4", ops[0]).group(1))
        assert ops[2] == ops[1] and ops[3] == f"tensor<1x4x{t}xf32>"
        assert ops[4] == ops[5] == ops[0]
    assert not any(w for *_, w, _ in calls)


def test_a_window_exports_as_sliding_window_length(monkeypatch):
    calls = _cudnn_calls(_export_ring(monkeypatch, "contiguous", 1, window=48))
    assert {(t, mask, w) for t, mask, w, _ in calls} >= {
        ("__cudnn$fmhaSoftmax", "CAUSAL", 48), ("__cudnn$fmhaSoftmaxBackward", "CAUSAL", 48)}


def test_the_startup_line_says_which_kernel_runs_which_rounds():
    striped = permutation("striped", L, 4)
    assert cudnn.startup_note(striped, 4, documents=True) == (
        "of 16 device-rounds per layer, cuDNN runs diagonal 10, lower 6; a round holding more "
        "than one packed document runs pallas_gpu")
    assert cudnn.startup_note(permutation("contiguous", L, 4), 4, window=5, interpreted=True) == (
        "a dense fp32 stand-in for cuDNN on this CPU (exact, not fast); of 16 device-rounds per "
        "layer, cuDNN runs diagonal_window 4 (9 see no key: skipped); xla runs 3 that cuDNN's "
        "masks cannot express")


def test_a_head_dim_cudnn_cannot_run_is_one_line(monkeypatch):
    """cuDNN's head-dim rule is the kernel's own (a multiple of 8 up to 128 without a Hopper at
    trace time); a head dim Triton cannot tile (96) leaves the fallback rounds to xla instead."""
    from parallel.kernels.spec import Tile, RoundSpec
    monkeypatch.setenv("STRIPEDJAX_PALLAS_INTERPRET", "0")
    q = jnp.zeros((1, 64, 4, 12), jnp.bfloat16)
    from parallel.attention import context_parallel_attention
    with pytest.raises(KernelError, match="head dim 12 .*cudnn needs a multiple of 8 up to 128"):
        context_parallel_attention(q, q, q, mesh=ring_mesh(2), layout="striped", kernel="cudnn")
    t = Tile(64, 64)
    spec = lambda d: RoundSpec("cudnn", t, t, t, 1, 4, d, 0.1, True, False, False)
    assert cudnn.fallback(spec(128)) == "pallas_gpu" and cudnn.fallback(spec(96)) == "xla"
    assert cudnn.fits("bfloat16", 96) and not cudnn.fits("bfloat16", 12)
    assert not cudnn.fits("float32", 128) and not cudnn.fits("bfloat16", 256)
