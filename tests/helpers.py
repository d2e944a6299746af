"""Shared test helpers: the float64 reference attention, random inputs and packed documents,
running context-parallel attention in every layout, checking that a table of test cases covers
every pair of values, counting the collectives of a jaxpr, and the tiny two-process training
runs."""
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

from parallel.attention import context_parallel_attention
from parallel.layouts import inverse, permutation

B, L, D = 2, 64, 16


def ring_mesh(n, axis_types=AxisType.Auto):
    return jax.make_mesh((n,), ("sequence",), axis_types=(axis_types,), devices=jax.devices()[:n])


# ----------------------------------------------------------------------------- reference


def reference(q, k, v, dout, positions, segment_ids, causal=True, window=0, sinks=None):
    """float64 attention and its gradients (w.r.t. q, k, v for the cotangent ``dout``);
    ``window`` W > 0: a query at p also needs ``k_pos > p - W`` (Mistral's sliding window);
    ``sinks [Hq]``: gpt-oss's attention sinks, a logit per head as one more column of every
    row's softmax, dropped after it (transformers' ``eager_attention_forward``): then the
    sinks' gradient is returned too.

    Written independently of the code under test: K/V are repeated per query head group.
    """
    q, k, v, dout = (np.asarray(x, np.float64) for x in (q, k, v, dout))
    hq, hkv = q.shape[2], k.shape[2]
    g = hq // hkv
    kr, vr = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    scale = 1.0 / math.sqrt(q.shape[-1])
    mask = np.ones((q.shape[0], q.shape[1], q.shape[1]), bool)
    if causal:
        mask &= positions[:, None, :] <= positions[:, :, None]
    if window:
        mask &= positions[:, None, :] > positions[:, :, None] - window
    if segment_ids is not None:
        mask &= segment_ids[:, None, :] == segment_ids[:, :, None]
    mask = mask[:, None]  # [B, 1, Lq, Lk]
    s = np.einsum("bqhd,bkhd->bhqk", q, kr) * scale
    s = np.where(mask, s, -np.inf)
    if sinks is not None:  # the sink's column, last
        column = np.broadcast_to(np.asarray(sinks, np.float64)[None, :, None, None],
                                 (*s.shape[:3], 1))
        s = np.concatenate([s, column], axis=-1)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(m), m, 0.0))
    denom = p.sum(-1, keepdims=True)
    p = p / np.where(denom > 0, denom, 1.0)
    if sinks is not None:
        p, p_sink = p[..., :-1], p[..., -1]
    out = np.einsum("bhqk,bkhd->bqhd", p, vr)
    dp = np.einsum("bqhd,bkhd->bhqk", dout, vr)
    delta = np.einsum("bqhd,bqhd->bhq", dout, out)
    ds = p * (dp - delta[..., None])
    dq = np.einsum("bhqk,bkhd->bqhd", ds, kr) * scale
    dk = np.einsum("bhqk,bqhd->bkhd", ds, q) * scale
    dv = np.einsum("bhqk,bqhd->bkhd", p, dout)
    group = lambda x: x.reshape(*x.shape[:2], hkv, g, x.shape[-1]).sum(3)
    if sinks is not None:  # the sink's value is 0: its score's gradient is p_sink * (0 - delta)
        return out, dq, group(dk), group(dv), -(p_sink * delta).sum(axis=(0, 2))
    return out, dq, group(dk), group(dv)


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def random_segments(rng, batch, length, max_docs=5):
    """Packed documents: per row, sorted cut points into segments numbered 0, 1, ..."""
    seg = np.zeros((batch, length), np.int32)
    for b in range(batch):
        cuts = rng.choice(np.arange(1, length), size=rng.integers(1, max_docs), replace=False)
        seg[b, np.sort(cuts)] = 1
    return np.cumsum(seg, axis=1).astype(np.int32)


def inputs(rng, hq, hkv, length=L, batch=B, dtype=np.float32):
    mk = lambda h: rng.standard_normal((batch, length, h, D)).astype(np.float32)
    q, k, v, dout = mk(hq), mk(hkv), mk(hkv), mk(hq)
    if dtype != np.float32:  # the reference sees exactly the rounded values
        q, k, v, dout = (np.asarray(jnp.asarray(x, dtype).astype(jnp.float32)) for x in (q, k, v, dout))
    return q, k, v, dout


def ring_outputs(q, k, v, dout, *, mesh, layout, segment_ids=None, positions=None, dtype=jnp.float32,
                 jit=False, **kw):
    """Runs the ring on layout-ordered copies of natural-order inputs; returns natural order.

    Eager by default: the ring's compiled programs are then shared by every layout with the
    same shapes (positions are runtime data), which keeps this file fast; ``jit=True`` traces
    the whole thing (positions become compile-time constants).
    """
    n = mesh.shape["sequence"]
    perm = permutation(layout, q.shape[1], n, kw.get("stripe", 1))
    inv = inverse(perm)
    lay = lambda x: None if x is None else jnp.asarray(x[:, perm])
    cast = lambda x: lay(x).astype(dtype)

    def run(q, k, v, dout, seg, pos):
        f = lambda q, k, v: context_parallel_attention(
            q, k, v, mesh=mesh, layout=layout, positions=pos, segment_ids=seg, **kw)
        out, vjp = jax.vjp(f, q, k, v)
        return (out, *vjp(dout))

    res = (jax.jit(run) if jit else run)(cast(q), cast(k), cast(v), cast(dout), lay(segment_ids),
                                         lay(positions))
    for r in res:
        assert r.dtype == dtype
    return [np.asarray(r.astype(jnp.float32))[:, inv] for r in res]


def run_all_layouts(rng, n, heads, mask, impl="ring", dtype=jnp.float32, tol=1e-5,
                    layouts=(("contiguous", 1), ("striped", 1), ("zigzag", 1)), causal=True, **kw):
    """One case (ring size, (Hq, Hkv), mask, dtype, causal or not) in every given (layout,
    stripe) against the float64 reference; the layouts reuse one compiled program (positions
    are data). ``mask``: "packed" (documents in every row), "mixed" (in every row but the last,
    which is one document) or anything else (no segment ids)."""
    q, k, v, dout = inputs(rng, *heads, dtype=dtype)
    seg = random_segments(rng, B, L) if mask in ("packed", "mixed") else None
    if mask == "mixed":  # the last row one document: its tiles need no mask
        seg[-1] = 0
    pos = np.broadcast_to(np.arange(L, dtype=np.int32), (B, L))
    want = reference(q, k, v, dout, pos, seg, causal, kw.get("window", 0))
    for layout, stripe in layouts:
        got = ring_outputs(q, k, v, dout, mesh=ring_mesh(n), layout=layout, stripe=stripe,
                           segment_ids=seg, dtype=dtype, impl=impl, causal=causal, **kw)
        check(got, want, tol)


def missing_pairs(cases, factors=None):
    """The (factor i, value, factor j, value) pairs that no case holds, over the given factors
    (indices into each case tuple; all by default) and the values each factor takes somewhere.
    A covering table of test cases holds every pair: ``assert not missing_pairs(CASES)``."""
    factors = range(len(cases[0])) if factors is None else factors
    values = {i: sorted({c[i] for c in cases}, key=str) for i in factors}
    seen = {(i, c[i], j, c[j]) for c in cases for i in factors for j in factors if i < j}
    return [(i, a, j, b) for i in factors for j in factors if i < j
            for a in values[i] for b in values[j] if (i, a, j, b) not in seen]


def check(got, want, tol):
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert np.all(np.isfinite(g)), f"{name} has non-finite values"
        err = rel_err(g, w)
        assert err < tol, f"{name}: relative error {err:.2e} >= {tol:.0e}"


# ----------------------------------------------------------------------------- collectives


def ppermute_hops(jaxpr, mult=1):
    """{(dtype, shape): transfers} over a jaxpr, loops (scans) counted by their trip count."""
    hops = {}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "ppermute":
            for var in eqn.invars:
                key = (str(var.aval.dtype), tuple(var.aval.shape))
                hops[key] = hops.get(key, 0) + mult
        inner = mult * (eqn.params["length"] if eqn.primitive.name == "scan" else 1)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    for key, count in ppermute_hops(sub, inner).items():
                        hops[key] = hops.get(key, 0) + count
    return hops


def collectives(jaxpr, out=None):
    """[(primitive, dtype, shape)] of every collective in a jaxpr and its sub-jaxprs."""
    out = [] if out is None else out
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("all_gather", "reduce_scatter", "psum_scatter", "psum",
                                  "psum_invariant", "ppermute", "all_to_all"):
            out.append((eqn.primitive.name, str(eqn.invars[0].aval.dtype),
                        tuple(eqn.invars[0].aval.shape)))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    collectives(sub, out)
    return out


# ----------------------------------------------------------------------------- processes

# A two-process run of the tiny model, one CPU device each, a 2-device ring over them.
TWO_PROCESS_TINY = [
    "--config.train.steps=2", "--config.train.log_every=1", "--config.train.eval_batches=0",
    "--config.data.max_docs=120", "--config.model.vocab_size=512", "--config.data.batch_size=2",
    "--config.data.seq_len=256", "--config.mesh.fsdp=1", "--config.mesh.sequence=2"]


def launcher_env() -> dict:
    """A user's CPU shell for a launcher: it sets each process's own device count."""
    from conftest import user_process_env
    return user_process_env(JAX_PLATFORMS="cpu")


# ----------------------------------------------------------------------------- parameters


def initial_params(rng, config, abstract_params, biases=False):
    """Parameters drawn from ``rng`` as the model's initialiser draws them, as numpy arrays in the
    structure of ``abstract_params`` (a trainer's ``abstract_state.params``): normal at
    ``init_std``, the untied embedding at std 1, the output projections (wo, w_down) at
    ``init_std / sqrt(2 layers)``, norm scales 1 (0 with ``model.norm_unit_offset``, whose
    scale is 1 + w), q/k/v biases 0 (``biases``: drawn at
    ``init_std`` too, so that the forward uses them). Nothing of the initialiser compiles (its
    program takes seconds to); that it draws the same parameters from a seed on any mesh:
    tests/test_state.py, test_the_initialiser_draws_the_same_parameters_on_one_device_and_on_a_mesh
    """
    m = config.model
    out_std = m.init_std / math.sqrt(2 * m.num_layers)
    tied = bool(m.get("tie_embeddings", False))

    def draw(path, x):
        name = path[-1].key
        if name == "scale":
            return (np.zeros if m.get("norm_unit_offset", False) else np.ones)(x.shape, x.dtype)
        if name in ("bq", "bk", "bv") and not biases:
            return np.zeros(x.shape, x.dtype)
        std = {"embed": m.init_std if tied else 1.0, "wo": out_std, "w_down": out_std}.get(
            name, m.init_std)
        return (std * rng.standard_normal(x.shape)).astype(x.dtype)

    return jax.tree_util.tree_map_with_path(draw, abstract_params)


def initial_state(trainer, params):
    """What ``trainer.init`` returns, with ``params`` (numpy or placed) for its parameters."""
    return jax.jit(trainer.state_of, out_shardings=trainer.state_shardings)(
        jax.device_put(params, trainer.param_shardings))


def logged_step(metrics) -> int:
    """The newest complete record of a run's metrics.jsonl while it is being written (0 before
    the first): a half-written last line is skipped."""
    steps = [0]
    for line in metrics.read_text().splitlines() if metrics.exists() else []:
        try:
            steps.append(json.loads(line)["step"])
        except ValueError:  # a line still being written
            pass
    return max(steps)
