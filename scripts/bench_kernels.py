"""Benchmark one ring round's attention kernel: xla vs the fused Pallas kernel vs cuDNN.

For each chunk length (the tokens one device holds), bf16, causal, one device:

- ``diagonal``: a device's own block (round 0 of any layout: causal within the chunk);
- ``striped``: a later round of the striped layout whose keys all sit after the queries they
  pair with (ring of 8, device 3 holding device 5's block): a strictly lower triangle, no
  diagonal, the round most of a striped ring's time goes to;
- ``full``: a contiguous ring's earlier block: every key visible (``--cases`` adds it).

Forward and forward+backward (the ring's own round functions: accumulate, finalize, then the
dQ and dK/dV of the round) are timed as medians of ``--repeats`` after warm-up, compile
excluded. TFLOP/s count only the visible (causal) pairs: 4·B·Hq·D per visible pair forward,
2.5x that backward. ``cudnn`` is the ``attention.kernel=cudnn`` round (``parallel/kernels/
cudnn.py``: the case from the positions, cuDNN's call, the LSE merge; its dense stand-in on a
CPU); ``cudnn_bare`` is ``jax.nn.dot_product_attention(implementation="cudnn")`` on the same
visible pairs (causal, unmasked, or causal on ``q[1:]`` / ``k[:-1]``), the reference the ring
API's overhead is measured against (GPU only). Every kernel's output is checked against the
first kernel's (``max err``).

    python scripts/bench_kernels.py --chunks 4096,8192,16384,32768 --heads 16 --json out.json

On a CPU the Pallas kernels run in interpret mode (exact, slow): use tiny sizes there, e.g.
``--chunks 128 --heads 2 --head-dim 32 --block 32``; the numbers then say nothing about speed.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunks", default="4096,8192,16384,32768", help="tokens per device, comma list")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=0, help="0: same as --heads (MHA)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--kernels", default="xla,pallas,cudnn,cudnn_bare",
                   help="xla, pallas (the platform's: pallas_gpu on a GPU, pallas_tpu on a TPU, "
                        "pallas_gpu interpreted on a CPU), cudnn (the ring's round; a dense "
                        "stand-in on a CPU), cudnn_bare (jax.nn's cuDNN call; GPU only)")
    p.add_argument("--cases", default="diagonal,striped", help="diagonal, striped, full")
    p.add_argument("--block", type=int, default=0, help="Pallas tile (positions); 0: the kernel's default")
    p.add_argument("--xla-block", type=int, default=512, help="xla kernel tile")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--json", default="", help="write {'rows': [...], ...} here")
    return p.parse_args(argv)


def positions(case, chunk):
    import numpy as np
    if case == "diagonal":
        return np.arange(chunk), np.arange(chunk)
    if case == "full":  # a contiguous ring: the block of the device before
        return chunk + np.arange(chunk), np.arange(chunk)
    n, d, src = 8, 3, 5  # striped ring of 8: device 3 holds 3, 11, ...; block of device 5
    return d + n * np.arange(chunk), src + n * np.arange(chunk)


def build(kernel, args, chunk, case, platform):
    """(fwd, fwd_bwd) jitted functions of (q, k, v, do) for one kernel, and its flop counts."""
    import jax
    import jax.numpy as jnp
    from parallel.kernels import accumulators as ac
    from parallel.kernels import xla
    from parallel import kernels
    from parallel.kernels import fused, tiling
    from parallel.kernels.spec import RoundSpec

    hq, hkv, d = args.heads, args.kv_heads or args.heads, args.head_dim
    qp, kp = positions(case, chunk)
    q_pos = jnp.broadcast_to(jnp.asarray(qp, jnp.int32), (args.batch, chunk))
    k_pos = jnp.broadcast_to(jnp.asarray(kp, jnp.int32), (args.batch, chunk))
    scale = 1.0 / math.sqrt(d)

    if kernel == "cudnn_bare":
        lower = case == "striped"  # causal on q[1:] against k[:-1]: row 0 sees nothing

        def attend(q, k, v):
            if lower:
                q, k, v = q[:, 1:], k[:, :-1], v[:, :-1]
            return jax.nn.dot_product_attention(q, k, v, is_causal=case != "full",
                                                implementation="cudnn")

        def fwd(q, k, v, do):  # row 0 of the strictly lower round sees nothing: 0
            out = attend(q, k, v)
            return jnp.pad(out, ((0, 0), (1, 0), (0, 0), (0, 0))) if lower else out

        def fwd_bwd(q, k, v, do):
            out, vjp = jax.vjp(attend, q, k, v)
            return vjp(do[:, 1:] if lower else do)
    elif kernel == "cudnn":
        from parallel.kernels import cudnn
        spec = RoundSpec("cudnn", *tiling.plan(
            "cudnn", args.block, args.block, group=hq // hkv, head_dim=d, dtype=args.dtype,
            chunk=chunk, seq_len=chunk, shards=1, interpret=kernels.interpret("cudnn", platform)),
            hq // hkv, hkv, d, scale, True, False, kernels.interpret("cudnn", platform))

        def forward(q, k, v):
            query = cudnn.queries(spec, q, q_pos, None)
            kv = ac.KV(ac.to_kv_major(k), ac.to_kv_major(v), k_pos, None)
            acc0 = ac.init_acc(ac.to_q_major(q, hkv).astype(jnp.float32))
            return kv, ac.finalize(cudnn.attend(spec, query, kv, acc0))

        def fwd(q, k, v, do):
            return ac.from_q_major(forward(q, k, v)[1][0]).astype(q.dtype)

        def fwd_bwd(q, k, v, do):
            kv, (out, lse) = forward(q, k, v)
            do_q = ac.to_q_major(do, hkv)
            delta = jnp.sum(do_q.astype(jnp.float32) * out, -1)
            gq = cudnn.grad_queries(spec, q, q_pos, None, do_q, lse, delta, out.astype(q.dtype))
            return cudnn.attend_grads(spec, gq, kv, jnp.zeros(out.shape, jnp.float32))
    elif kernel == "xla":
        blk = min(args.xla_block, chunk)

        def fwd(q, k, v, do):
            q_s = ac.to_q_major(q.astype(jnp.float32) * scale, hkv)
            kv = ac.KV(ac.to_kv_major(k), ac.to_kv_major(v), k_pos, None)
            acc = xla.attend_block(q_s, kv, q_pos, None, ac.init_acc(q_s), block_q=blk, block_kv=blk)
            return ac.from_q_major(ac.finalize(acc)[0]).astype(q.dtype)

        def fwd_bwd(q, k, v, do):
            q_s = ac.to_q_major(q.astype(jnp.float32) * scale, hkv)
            kv = ac.KV(ac.to_kv_major(k), ac.to_kv_major(v), k_pos, None)
            acc = xla.attend_block(q_s, kv, q_pos, None, ac.init_acc(q_s), block_q=blk, block_kv=blk)
            out, lse = ac.finalize(acc)
            do_q = ac.to_q_major(do.astype(jnp.float32), hkv)
            delta = jnp.sum(do_q * out, -1)
            return xla.attend_block_bwd(q_s, kv, q_pos, None, do_q, lse, delta, jnp.zeros_like(q_s),
                                       block_q=blk, block_kv=blk)
    else:
        interpret = kernels.interpret(kernel, platform)
        tiles = tiling.plan(kernel, args.block, args.block, group=hq // hkv, head_dim=d,
                            dtype=args.dtype, chunk=chunk, seq_len=chunk, shards=1,
                            interpret=interpret, arch=tiling.device_arch(kernel, jax.devices()[0]))
        spec = RoundSpec(kernel, *tiles, hq // hkv, hkv, d, scale, True, False, interpret)

        def forward(q, k, v):
            query = fused.prepare(q, q_pos, None, spec)
            kv = ac.KV(ac.to_kv_major(k), ac.to_kv_major(v), k_pos, None)
            acc0 = ac.init_acc(ac.to_q_major(q, hkv).astype(jnp.float32))
            return query, kv, ac.finalize(fused.attend(spec, query, kv, acc0))

        def fwd(q, k, v, do):
            return ac.from_q_major(forward(q, k, v)[2][0]).astype(q.dtype)

        def fwd_bwd(q, k, v, do):
            query, kv, (out, lse) = forward(q, k, v)
            do_q = ac.to_q_major(do, hkv)
            delta = jnp.sum(do_q.astype(jnp.float32) * out, -1)
            return fused.grads(spec, query, kv, fused.fold_rows(do_q), fused.fold_rows(lse),
                               fused.fold_rows(delta), jnp.zeros(out.shape, jnp.float32))

    visible = int((kp[None, :] <= qp[:, None]).sum())
    flops = 4 * args.batch * hq * d * visible
    return jax.jit(fwd), jax.jit(fwd_bwd), flops, visible / chunk ** 2


def timed(f, inputs, repeats, warmup):
    import jax
    for _ in range(warmup):
        jax.block_until_ready(f(*inputs))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(f(*inputs))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run(args, save=lambda rows, failures: None):
    """Times every kernel; ``save(rows, failures)`` after each one, so a run stopped at a time
    limit on a lent device still leaves what it measured."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from parallel import kernels

    platform = jax.devices()[0].platform
    pallas = kernels.AUTO.get(platform, "pallas_gpu")
    names = []
    for name in args.kernels.split(","):
        if name == "cudnn_bare" and platform != "gpu":
            print(f"skipping cudnn_bare: no GPU (platform {platform})")
            continue
        names.append(pallas if name == "pallas" else name)
    hq, hkv, d = args.heads, args.kv_heads or args.heads, args.head_dim
    dtype = jnp.dtype(args.dtype)
    rows, failures = [], []
    for chunk in (int(c) for c in args.chunks.split(",")):
        rng = np.random.default_rng(chunk)
        mk = lambda h: jnp.asarray(rng.standard_normal((args.batch, chunk, h, d)), dtype)
        inputs = (mk(hq), mk(hkv), mk(hkv), mk(hq))
        for case in args.cases.split(","):
            ref = None
            for name in names:
                if name == "cudnn_bare" and hq != hkv:
                    continue
                try:
                    fwd, fwd_bwd, flops, frac = build(name, args, chunk, case, platform)
                    out = np.asarray(fwd(*inputs).astype(jnp.float32))
                    t_f = timed(fwd, inputs, args.repeats, args.warmup)
                    t_fb = timed(fwd_bwd, inputs, args.repeats, args.warmup)
                except Exception as e:  # one kernel failing on a device must not lose the rest
                    line = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
                    print(f"  {chunk:>6} {case:<8} {name:<10} FAILED: {type(e).__name__}: {line}", flush=True)
                    failures.append({"chunk": chunk, "case": case, "kernel": name,
                                     "error": f"{type(e).__name__}: {line}"})
                    save(rows, failures)
                    continue
                ref = out if ref is None else ref
                row = {"chunk": chunk, "case": case, "kernel": name, "fwd_ms": t_f * 1e3,
                       "fwd_bwd_ms": t_fb * 1e3, "fwd_tflops": flops / t_f / 1e12,
                       "fwd_bwd_tflops": 3.5 * flops / t_fb / 1e12, "visible_fraction": frac,
                       "max_err_vs_first": float(np.max(np.abs(out - ref))),
                       "interpret": kernels.interpret(name, platform) if name.startswith("pallas") else False}
                if name == "xla":  # its speed depends on the tile: the planner checks it
                    row["xla_block"] = min(args.xla_block, chunk)
                rows.append(row)
                save(rows, failures)
                print(f"  {chunk:>6} {case:<8} {name:<10} fwd {row['fwd_ms']:9.2f} ms "
                      f"{row['fwd_tflops']:7.2f} TF/s   fwd+bwd {row['fwd_bwd_ms']:9.2f} ms "
                      f"{row['fwd_bwd_tflops']:7.2f} TF/s   max err {row['max_err_vs_first']:.1e}", flush=True)
    return rows, failures, platform


def table(rows):
    lines = ["| chunk | case | kernel | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | "
             "fwd vs first | fwd+bwd vs first | max err vs first |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    first = {}
    for r in rows:
        base = first.setdefault((r["chunk"], r["case"]), r)
        lines.append(f"| {r['chunk']} | {r['case']} | {r['kernel']} | {r['fwd_ms']:.2f} | "
                     f"{r['fwd_tflops']:.2f} | {r['fwd_bwd_ms']:.2f} | {r['fwd_bwd_tflops']:.2f} | "
                     f"{base['fwd_ms'] / r['fwd_ms']:.2f}x | {base['fwd_bwd_ms'] / r['fwd_bwd_ms']:.2f}x | "
                     f"{r['max_err_vs_first']:.1e} |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)

    def save(rows, failures, platform=None):
        if not args.json:
            return
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"platform": platform, "args": vars(args), "rows": rows,
                       "failures": failures}, f, indent=1)

    rows, failures, platform = run(args, save)
    print()
    print(table(rows))
    for f in failures:
        print(f"FAILED {f['chunk']} {f['case']} {f['kernel']}: {f['error']}")
    if args.json:
        save(rows, failures, platform)
        print(f"wrote {args.json}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
