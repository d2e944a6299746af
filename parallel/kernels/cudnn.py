"""The ``cudnn`` kernel: one ring round as cuDNN's fused flash attention (JAX's own cuDNN custom
call, the one ``jax.nn.dot_product_attention(implementation="cudnn")`` lowers to), the rounds
merged by their fp32 natural-log LSE like a fused Pallas round (``accumulators.merge``).

cuDNN takes a mask type, not positions, so every round is classified at run time from the true
positions of its queries and keys (:func:`classify`, the same function on numpy for the startup
line) and ``lax.switch`` runs the cuDNN call that expresses it exactly:

- ``skip``: every key in the future (or older than the window): nothing runs;
- ``full``: every key visible to every query: NO_MASK;
- ``diagonal``: key ``i`` visible to queries ``i, i+1, ...`` only (the block's own positions, or
  a striped round from an earlier device): CAUSAL; with a sliding window, the block's own
  positions stepping by 1 (the contiguous and zigzag layouts' own block with a window inside it,
  one device): CAUSAL + ``sliding_window_length``;
- ``lower``: keys start just after their queries (a striped round from a later device): query
  ``i`` sees keys ``j < i``, which is CAUSAL on ``q[1:]`` against ``k[:-1]`` (row 0 sees nothing);
- ``kv_head`` / ``q_tail``: a zigzag round: every query sees the first half of the keys and none
  of the second, or the second half of the queries sees every key and the first half none;
  NO_MASK on the halves;
- ``other`` (a round holding several packed documents, a window cutting a round off the
  diagonal, unordered positions): the ``pallas_gpu`` kernel (``xla`` when cuDNN is stood in)
  runs that round. With segment ids, a round inside one document (a long document spanning it)
  is still one of the cases above.

The backward is cuDNN's own, bound with the ring's global output and global LSE (so its row sums
``dO . O`` and probabilities are the whole row's, as the split requires), per round, with dQ
accumulated and dK/dV returned in fp32 across rounds.

cuDNN cannot run on a CPU. There (``spec.interpret``, like a Pallas kernel's interpret mode) a
stand-in computes the same two calls densely in fp32 behind the same contract (output in the
input dtype, LSE ``[B, N, T]`` fp32 natural log; the backward fed the global output and LSE), so
the whole round decomposition above is exact-tested against the float64 reference; the real
calls are checked by exporting the ring for ``cuda`` (``tests/test_cudnn.py``).
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from errors import KernelError
from parallel import kernels
from parallel.kernels import accumulators as ac
from parallel.kernels import pallas_gpu
from parallel.kernels.spec import RoundSpec

ANY_CHUNKS = False  # one chunk a side: positions inside each increase (the cases need it)
NEEDS_OUT = True  # the backward reads the global output (cuDNN computes dO . O itself)

CASES = ("skip", "full", "diagonal", "diagonal_window", "lower", "kv_head", "q_tail", "other")
SKIP, FULL, DIAG, DIAG_W, LOWER, KV_HEAD, Q_TAIL, OTHER = range(len(CASES))
CUDNN_DTYPES = ("bfloat16", "float16")
HEAD_DIM_MAX = 128  # what JAX's cuDNN attention allows without a Hopper device at trace time

# Tiles are the fallback's (``pallas_gpu``): cuDNN picks its own.
default_tiles = pallas_gpu.default_tiles
device_arch = pallas_gpu.device_arch


def check_tile(names, tile, group, head_dim, chunk):
    """cuDNN's own rule (the head dim); the fallback's tiles are checked by :func:`fallback`."""
    if head_dim % 8 or head_dim > HEAD_DIM_MAX:
        raise KernelError(f"head dim {head_dim} (model.head_dim, or d_model / num_heads): "
                          f"attention.kernel=cudnn needs a multiple of 8 up to {HEAD_DIM_MAX}; "
                          f"use attention.kernel=pallas_gpu or xla")


def fallback(spec: RoundSpec) -> str:
    """The kernel of the rounds cuDNN cannot express: ``pallas_gpu`` where Triton can run these
    tiles and head dim, else ``xla`` (and ``xla`` behind the stand-in)."""
    if spec.interpret:
        return "xla"
    try:
        for tile in (spec.fwd, spec.dq, spec.dkv):
            pallas_gpu.check_tile(("block_q", "block_kv"), tile, spec.group, spec.head_dim, 0)
    except KernelError:
        return "xla"
    return "pallas_gpu"


# ----------------------------------------------------------------------------- classification


def classify(q_pos, k_pos, q_seg=None, k_seg=None, *, causal=True, window=0):
    """The case (an index into :data:`CASES`) of one round from the true positions ``[B, C]`` of
    its queries and keys (and their segment ids, or None): numpy in, a Python int out; jax in,
    an int32 scalar out. A case holds only when it holds for every row; segment ids allow a
    case only where the round holds one document (a long document spanning the round)."""
    xp = np if isinstance(q_pos, np.ndarray) and isinstance(k_pos, np.ndarray) else jnp
    every = lambda x: xp.all(x)
    q_min, q_max, k_min, k_max = q_pos.min(), q_pos.max(), k_pos.min(), k_pos.max()
    one_doc = True
    if q_seg is not None:
        one_doc = ((q_seg.min() == q_seg.max()) & (k_seg.min() == k_seg.max())
                   & (q_seg.min() == k_seg.min()))
    if not causal:
        conds = [(one_doc, FULL)]
    else:
        conds = _causal_cases(xp, every, q_pos, k_pos, q_min, q_max, k_min, k_max, window)
        if q_seg is not None:  # skipping never needs one document; the other cases do
            apart = (k_seg.min() > q_seg.max()) | (k_seg.max() < q_seg.min())
            conds = [(conds[0][0] | apart, SKIP)] + [(cond & one_doc, c) for cond, c in conds[1:]]
    if xp is np:
        return next((c for cond, c in conds if bool(cond)), OTHER)
    case = jnp.int32(OTHER)
    for cond, c in reversed(conds):  # first true wins
        case = jnp.where(jnp.asarray(cond), jnp.int32(c), case)
    return case


def _causal_cases(xp, every, q_pos, k_pos, q_min, q_max, k_min, k_max, window):
    """[(condition, case)] in order of precedence for a causal round."""
    false = q_min != q_min
    # every query sees every key it would see causally: the window reaches past the block
    wide = (q_max - window < k_min) if window else ~false
    skip = (k_min > q_max) | ((k_max <= q_min - window) if window else false)
    inc = lambda p: every(p[:, 1:] > p[:, :-1])
    step1 = lambda p: every(p[:, 1:] - p[:, :-1] == 1)
    same = every(q_pos == k_pos) & inc(q_pos)
    # key i visible to queries i.. and not before: the block's own positions, or a striped
    # round from an earlier device
    diagonal = (every(k_pos <= q_pos) & every(k_pos[:, 1:] > q_pos[:, :-1]) & inc(q_pos)
                & inc(k_pos))
    lower = (every(k_pos > q_pos) & every(k_pos[:, :-1] <= q_pos[:, 1:]) & inc(q_pos)
             & inc(k_pos)) if q_pos.shape[1] > 1 else false
    h = q_pos.shape[1] // 2
    if q_pos.shape[1] % 2 == 0:
        kv_head = (k_pos[:, :h].max() <= q_min) & (k_pos[:, h:].min() > q_max) & wide
        tail_wide = (q_pos[:, h:].max() - window < k_min) if window else ~false
        q_tail = (q_pos[:, :h].max() < k_min) & (k_max <= q_pos[:, h:].min()) & tail_wide
    else:
        kv_head = q_tail = false
    return [(skip, SKIP), ((k_max <= q_min) & wide, FULL), (diagonal & wide, DIAG),
            ((same & step1(q_pos)) if window else false, DIAG_W), (lower & wide, LOWER),
            (kv_head, KV_HEAD), (q_tail, Q_TAIL)]


def round_cases(perm, shards, *, causal=True, window=0, seg=None):
    """{case name: rounds} over every (device, round) of a ring on ``perm`` (a layout's
    permutation of ``arange(L)``; ``seg``: the segment id of each position, in natural order, or
    None), for the startup line and the tests."""
    pos = np.asarray(perm, np.int64).reshape(shards, -1)
    segs = None if seg is None else np.asarray(seg)[pos]
    counts = {}
    for d in range(shards):
        for r in range(shards):
            src = (d - r) % shards
            seg_args = () if segs is None else (segs[d][None], segs[src][None])
            case = classify(pos[d][None], pos[src][None], *seg_args, causal=causal,
                            window=window)
            counts[CASES[case]] = counts.get(CASES[case], 0) + 1
    return counts


def startup_note(perm, shards, *, window=0, documents=False, interpreted=False) -> str:
    """Which kernel runs which rounds of a ring on ``perm``: the training startup line's."""
    cases = round_cases(perm, shards, window=window)
    fb = "xla" if interpreted else "pallas_gpu"
    ran = ", ".join(f"{name} {n}" for name, n in sorted(cases.items())
                    if name not in ("other", "skip"))
    note = f"of {shards * shards} device-rounds per layer, cuDNN runs {ran or 'none'}"
    if cases.get("skip"):
        note += f" ({cases['skip']} see no key: skipped)"
    if cases.get("other"):
        note += f"; {fb} runs {cases['other']} that cuDNN's masks cannot express"
    if documents:
        note += f"; a round holding more than one packed document runs {fb}"
    if interpreted:
        note = "a dense fp32 stand-in for cuDNN on this CPU (exact, not fast); " + note
    return note


# ----------------------------------------------------------------------------- cuDNN calls


@functools.lru_cache(maxsize=None)
def _fa():
    from jax._src.cudnn import fused_attention_stablehlo as fa
    return fa


def _mask(fa, causal):
    return fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK


def cudnn_forward(q_BTNH, k_BSKH, v_BSKH, *, scale, causal, window):
    """cuDNN's forward: output ``[B, T, N, H]`` (input dtype) and LSE ``[B, N, T]`` fp32."""
    fa = _fa()
    out, lse = fa.dot_product_attention(
        q_BTNH, k_BSKH, v_BSKH, scale=scale, mask_type=_mask(fa, causal), qkv_layout="BTNH",
        sliding_window_length=window or None, return_residual=True)
    return out, lse.astype(jnp.float32)


def cudnn_backward(q_BTNH, k_BSKH, v_BSKH, out_BTNH, lse_BNT, dout_BTNH, *, scale, causal, window):
    """cuDNN's backward fed the ring's global output and LSE: (dq, dk, dv) in the input dtype."""
    fa = _fa()
    unused = jnp.zeros(0, q_BTNH.dtype)
    extra = {"score_mod": None} if _takes_score_mod() else {}  # JAX >= 0.12
    grads = fa._dot_product_attention_bwd_p_wrapper.bind(
        q_BTNH, k_BSKH, v_BSKH, *(unused,) * 7, lse_BNT, out_BTNH, dout_BTNH, scale=scale,
        seed=42, dropout_rate=0.0, variadic_args=(False, False), mask_type=_mask(fa, causal),
        layout=fa.AttentionLayout.BTNH.value, sliding_window_length=window or None, **extra)
    return tuple(grads[:3])


@functools.lru_cache(maxsize=None)
def _takes_score_mod():
    return "score_mod" in inspect.signature(_fa()._dot_product_attention_bwd_rule).parameters


def _scores(q_BTNH, k_BSKH, scale, causal, window):
    """The stand-in's fp32 scores ``[B, K, G, T, S]`` with cuDNN's top-left mask."""
    b, t, n, h = q_BTNH.shape
    kh = k_BSKH.shape[2]
    q = q_BTNH.astype(jnp.float32).reshape(b, t, kh, n // kh, h)
    s = jnp.einsum("btkgh,bskh->bkgts", q, k_BSKH.astype(jnp.float32)) * scale
    if causal or window:
        i, j = jnp.arange(t)[:, None], jnp.arange(k_BSKH.shape[1])[None]
        seen = (j <= i) if causal else (i == i)
        if window:
            seen = seen & (j > i - window)
        s = jnp.where(seen, s, -jnp.inf)
    return s


def standin_forward(q_BTNH, k_BSKH, v_BSKH, *, scale, causal, window):
    """:func:`cudnn_forward`'s contract, densely in fp32 (a CPU)."""
    b, t, n, h = q_BTNH.shape
    s = _scores(q_BTNH, k_BSKH, scale, causal, window)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.exp(s - lse[..., None])
    out = jnp.einsum("bkgts,bskh->btkgh", p, v_BSKH.astype(jnp.float32)).reshape(b, t, n, h)
    return out.astype(q_BTNH.dtype), lse.reshape(b, n, t)


def standin_backward(q_BTNH, k_BSKH, v_BSKH, out_BTNH, lse_BNT, dout_BTNH, *, scale, causal,
                     window):
    """:func:`cudnn_backward`'s contract, densely in fp32 (a CPU)."""
    b, t, n, h = q_BTNH.shape
    kh = k_BSKH.shape[2]
    g = n // kh
    s = _scores(q_BTNH, k_BSKH, scale, causal, window)
    p = jnp.exp(s - lse_BNT.reshape(b, kh, g, t)[..., None])
    grouped = lambda x: x.astype(jnp.float32).reshape(b, t, kh, g, h)
    do, o = grouped(dout_BTNH), grouped(out_BTNH)
    delta = jnp.einsum("btkgh,btkgh->bkgt", do, o)
    dv = jnp.einsum("bkgts,btkgh->bskh", p, do)
    dp = jnp.einsum("btkgh,bskh->bkgts", do, v_BSKH.astype(jnp.float32))
    ds = p * (dp - delta[..., None]) * scale
    dq = jnp.einsum("bkgts,bskh->btkgh", ds, k_BSKH.astype(jnp.float32)).reshape(b, t, n, h)
    dk = jnp.einsum("bkgts,btkgh->bskh", ds, grouped(q_BTNH))
    return dq.astype(q_BTNH.dtype), dk.astype(k_BSKH.dtype), dv.astype(v_BSKH.dtype)


def fits(dtype, head_dim=None) -> bool:
    """Whether cuDNN can run these activations: bf16/fp16, a head dim a multiple of 8 up to
    HEAD_DIM_MAX (None: not known here)."""
    ok_dim = head_dim is None or (head_dim % 8 == 0 and head_dim <= HEAD_DIM_MAX)
    return dtype is not None and np.dtype(dtype).name in CUDNN_DTYPES and ok_dim


@functools.lru_cache(maxsize=None)
def probe() -> tuple[bool, str]:
    """Whether cuDNN attention runs here, and why: on the first GPU, every call shape the ring
    makes (causal square, causal on an odd length as the strictly-lower slice runs, unmasked with
    fewer keys than queries and the reverse, causal with a sliding window), forward and backward,
    checked against the stand-in. What ``attention.kernel=auto`` reads on a GPU. Runs eagerly
    even when first asked for inside a trace, so that its cached answer is the device's."""
    try:
        gpu = jax.devices("gpu")[0]
    except RuntimeError:
        return False, "no GPU"
    try:
        with jax.ensure_compile_time_eval():
            version = _fa().check_cudnn_version()
            for t, s, causal, window in ((128, 128, True, 0), (127, 127, True, 0),
                                         (128, 64, False, 0), (64, 128, False, 0),
                                         (128, 128, True, 32)):
                why = _probe_one(gpu, t, s, causal, window)
                if why:
                    return False, why
    except Exception as e:  # noqa: BLE001 - any failure means: do not pick it
        return False, f"cuDNN attention failed its probe ({str(e).splitlines()[0][:120]})"
    return True, f"cuDNN {version} passed a forward+backward probe of every round shape"


def _probe_one(gpu, t, s, causal, window) -> str | None:
    keys = jax.random.split(jax.random.key(t + s), 4)
    q, do = (jax.random.normal(k, (1, t, 2, 64), jnp.bfloat16) for k in keys[:2])
    k, v = (jax.random.normal(k, (1, s, 1, 64), jnp.bfloat16) for k in keys[2:])
    q, k, v, do = jax.device_put((q, k, v, do), gpu)
    kw = dict(scale=0.125, causal=causal, window=window)

    def both(f, g):
        out, lse = f(q, k, v, **kw)
        return out, lse, g(q, k, v, out, lse, do, **kw)

    got = jax.jit(lambda: both(cudnn_forward, cudnn_backward))()
    want = jax.jit(lambda: both(standin_forward, standin_backward))()
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if not np.allclose(a, b, atol=5e-2 * (np.abs(b).max() + 1e-6)):
            return (f"cuDNN attention disagreed with the reference ({t} queries, {s} keys, "
                    f"{'causal' if causal else 'unmasked'}{f', window {window}' if window else ''})")
    return None


def _calls(spec: RoundSpec):
    return (standin_forward, standin_backward) if spec.interpret else (cudnn_forward,
                                                                       cudnn_backward)


# ----------------------------------------------------------------------------- one round


class Round(NamedTuple):
    """How a case runs as one cuDNN call: query rows ``[q0, q1)``, keys ``[k0, k1)`` (None: to
    the end), the mask, the window (positions stepping by 1 only)."""

    q0: int
    q1: int | None
    k0: int
    k1: int | None
    causal: bool
    window: int


def rounds_of(spec: RoundSpec, chunk: int) -> dict[int, Round | None]:
    """Each case's call; None where the case cannot occur (:func:`classify` never picks it), so
    that no dead cuDNN call is compiled."""
    h = chunk // 2
    even = chunk % 2 == 0
    return {FULL: Round(0, None, 0, None, False, 0), DIAG: Round(0, None, 0, None, True, 0),
            DIAG_W: Round(0, None, 0, None, True, spec.window) if spec.window else None,
            LOWER: Round(1, None, 0, chunk - 1, True, 0) if chunk > 1 else None,
            KV_HEAD: Round(0, None, 0, h, False, 0) if even else None,
            Q_TAIL: Round(h, None, 0, None, False, 0) if even else None}


class Query(NamedTuple):
    q: jax.Array  # [B, C, Hq, D] input dtype, unscaled (cuDNN's BTNH)
    pos: jax.Array  # [B, C]
    seg: jax.Array | None
    other: tuple  # the fallback kernel's own queries


def _fallback(spec):
    fb = fallback(spec)
    return dataclasses.replace(spec, kernel=fb), kernels.rounds(fb)


def _check_dtype(spec, dtype):
    if spec.interpret:
        return
    if jnp.dtype(dtype).name not in CUDNN_DTYPES:
        raise KernelError(f"attention.kernel=cudnn runs bf16 or fp16 activations, got "
                          f"{jnp.dtype(dtype).name}; set model.dtype=bfloat16 or use "
                          f"attention.kernel=pallas_gpu")
    check_tile(None, None, spec.group, spec.head_dim, None)


def queries(spec: RoundSpec, q_BSHD, pos_BS, seg_BS) -> Query:
    _check_dtype(spec, q_BSHD.dtype)
    fspec, fmod = _fallback(spec)
    return Query(q_BSHD, pos_BS, seg_BS, fmod.queries(fspec, q_BSHD, pos_BS, seg_BS))


def _case(spec, query, kv):
    return classify(query.pos, kv.pos, query.seg, kv.seg, causal=spec.causal,
                    window=spec.window)


def _q_major_lse(lse_BNT, kv_heads):
    b, n, t = lse_BNT.shape
    return lse_BNT.reshape(b, kv_heads, n // kv_heads, t).transpose(0, 1, 3, 2)


def _rows(x, r: Round, axis=1):
    return lax.slice_in_dim(x, r.q0, x.shape[axis] if r.q1 is None else r.q1, axis=axis)


def _keys(x, r: Round, axis=1):
    return lax.slice_in_dim(x, r.k0, x.shape[axis] if r.k1 is None else r.k1, axis=axis)


def _pad(x, start, size, axis, value=0.0):
    """``x`` placed at ``start`` of a length-``size`` axis, ``value`` elsewhere."""
    pad = [(0, 0)] * x.ndim
    pad[axis] = (start, size - start - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def attend(spec: RoundSpec, query: Query, kv: ac.KV, acc: ac.Acc) -> ac.Acc:
    fwd, _ = _calls(spec)
    c = query.q.shape[1]
    k, v = ac.from_kv_major(kv.k), ac.from_kv_major(kv.v)

    def run(r: Round):
        def branch(acc):
            o, lse = fwd(_rows(query.q, r), _keys(k, r), _keys(v, r), scale=spec.scale,
                         causal=r.causal, window=r.window)
            o = _pad(ac.to_q_major(o.astype(jnp.float32), spec.kv_heads), r.q0, c, 2)
            lse = _pad(_q_major_lse(lse, spec.kv_heads), r.q0, c, 2, -jnp.inf)
            return ac.merge(acc, o, lse)
        return branch

    fspec, fmod = _fallback(spec)
    keep = lambda acc: acc
    branches = [keep] + [run(r) if r else keep for _, r in sorted(rounds_of(spec, c).items())]
    branches += [lambda acc: fmod.attend(fspec, query.other, kv, acc)]
    return lax.switch(_case(spec, query, kv), branches, acc)


class GradQuery(NamedTuple):
    query: Query
    do: jax.Array  # [B, C, Hq, D] input dtype
    out: jax.Array  # [B, C, Hq, D]: the global output
    lse: jax.Array  # [B, Hq, C] fp32: the global LSE
    other: tuple  # the fallback's grad queries


def grad_queries(spec: RoundSpec, q_BSHD, pos_BS, seg_BS, do_BKSGD, lse_BKSG, delta_BKSG,
                 out_BKSGD=None):
    fspec, fmod = _fallback(spec)
    b, k, s, g = lse_BKSG.shape
    lse_BNS = lse_BKSG.transpose(0, 1, 3, 2).reshape(b, k * g, s)
    return GradQuery(queries(spec, q_BSHD, pos_BS, seg_BS),
                     ac.from_q_major(do_BKSGD).astype(q_BSHD.dtype),
                     ac.from_q_major(out_BKSGD).astype(q_BSHD.dtype), lse_BNS,
                     fmod.grad_queries(fspec, q_BSHD, pos_BS, seg_BS, do_BKSGD, lse_BKSG,
                                       delta_BKSG))


def attend_grads(spec: RoundSpec, gq: GradQuery, kv: ac.KV, dq_BKCGD):
    """``dq`` accumulated (unscaled, like every kernel's), this block's fp32 ``dk``/``dv``."""
    _, bwd = _calls(spec)
    query = gq.query
    c, ck = query.q.shape[1], kv.k.shape[2]
    k, v = ac.from_kv_major(kv.k), ac.from_kv_major(kv.v)
    zeros = jnp.zeros_like(kv.k, dtype=jnp.float32)

    def run(r: Round):
        def branch(dq):
            dq_r, dk, dv = bwd(_rows(query.q, r), _keys(k, r), _keys(v, r), _rows(gq.out, r),
                               _rows(gq.lse, r, axis=2), _rows(gq.do, r), scale=spec.scale,
                               causal=r.causal, window=r.window)
            dq_r = ac.to_q_major(dq_r.astype(jnp.float32), spec.kv_heads) / spec.scale
            to_kv = lambda x: _pad(ac.to_kv_major(x.astype(jnp.float32)), r.k0, ck, 2)
            return dq + _pad(dq_r, r.q0, c, 2), to_kv(dk), to_kv(dv)
        return branch

    fspec, fmod = _fallback(spec)
    nothing = lambda dq: (dq, zeros, zeros)
    branches = [nothing] + [run(r) if r else nothing
                            for _, r in sorted(rounds_of(spec, c).items())]
    branches += [lambda dq: fmod.attend_grads(fspec, gq.other, kv, dq)]
    return lax.switch(_case(spec, query, kv), branches, dq_BKCGD)
