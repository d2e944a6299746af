"""Compile report of the fused attention kernels for GPUs (and TPUs) this machine does not have.

Every fused GPU kernel (forward, dQ, dK/dV), built through the ring's own code path with the
default tiles, warps and stages of ``parallel/kernels/pallas_gpu.py`` (or the ones given), lowered
for CUDA with ``jax.export`` and compiled for sm_80 / sm_90 by the ``triton`` package: registers
per thread, spill bytes, shared memory per block against the arch's limit, tensor-core
instructions (``mma`` on sm_80, ``wgmma`` on sm_90) in the PTX (``planning/gpu_kernels.py``).

    python scripts/gpu_compile.py                                   # the whole default matrix
    python scripts/gpu_compile.py --arch sm_90 --head-dims 128 --groups 1,4 --json out.json
    python scripts/gpu_compile.py --block-q 128 --block-kv 64 --warps 8 --stages 2  # a user tile
    python scripts/gpu_compile.py --arch sm_90 --head-dims 128 --window 4096  # Mistral's window
    python scripts/gpu_compile.py --sweep --json tiles.json         # how the defaults were chosen
    python scripts/gpu_compile.py --tpu                             # Mosaic lowering + VMEM

Exit status 1 when a kernel failed to lower or compile, spills, exceeds shared memory or has no
tensor-core instruction; 2 when the triton package is missing.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compiling for a GPU needs none

KERNELS = ("fwd", "dq", "dkv")


def parse_args(argv=None):
    ints = lambda s: [int(x) for x in s.split(",")]
    strs = lambda s: s.split(",")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=strs, default=["sm_80", "sm_90"],
                   help="sm_80 (A100), sm_86 (A10, L4, RTX 30/40: the rest of 8.x), sm_90 (H100)")
    p.add_argument("--head-dims", type=ints, default=[64, 128, 256])
    p.add_argument("--groups", type=ints, default=[1, 4, 7, 8],
                   help="query heads per kv head (configs/llama_*: 1; Llama 3 8B: 4; 70B: 8; "
                        "Qwen2 7B: 7)")
    p.add_argument("--dtypes", type=strs, default=["bfloat16", "float16"])
    p.add_argument("--kernels", type=strs, default=list(KERNELS), help="fwd,dq,dkv")
    p.add_argument("--seg", choices=("both", "yes", "no"), default="both",
                   help="with segment ids (packed documents), without, or both")
    p.add_argument("--chunk", type=int, default=4096, help="tokens per device")
    p.add_argument("--window", type=int, default=0,
                   help="model.sliding_window the kernels mask with (0: none)")
    p.add_argument("--block-q", type=int, default=0, help="q tile (positions); 0: the default")
    p.add_argument("--block-kv", type=int, default=0, help="kv tile (positions); 0: the default")
    p.add_argument("--warps", type=int, default=0, help="Triton num_warps; 0: the default")
    p.add_argument("--stages", type=int, default=0, help="Triton num_stages; 0: the default")
    p.add_argument("--sweep", action="store_true", help="search the defaults (slow: minutes)")
    p.add_argument("--tpu", action="store_true", help="the Mosaic kernels: lowering and VMEM")
    p.add_argument("--json", default="", help="write the rows here")
    return p.parse_args(argv)


def _case(args, kernel, arch, d, g, dtype, has_seg):
    from planning import kernel_export as kx
    case = kx.default_case(kernel, d, g, dtype, has_seg, args.chunk, arch)
    from parallel.kernels import tiling
    if args.block_q or args.block_kv:
        tiles = tiling.plan(kernel, args.block_q, args.block_kv, group=g, head_dim=d, dtype=dtype,
                            chunk=args.chunk, seq_len=args.chunk, shards=1, interpret=False,
                            arch=arch, names=("--block-q", "--block-kv"))
        case = case._replace(tiles=tiles)
    over = {k: v for k, v in (("num_warps", args.warps), ("num_stages", args.stages)) if v}
    return case._replace(tiles=tuple(t._replace(**over) for t in case.tiles), window=args.window)


def _segs(args):
    return {"both": (False, True), "yes": (True,), "no": (False,)}[args.seg]


def gpu_rows(args, log):
    from planning import gpu_kernels as gk
    rows, cache = [], {}
    for arch in args.arch:
        for d in args.head_dims:
            for g in args.groups:
                for dtype in args.dtypes:
                    for has_seg in _segs(args):
                        case = _case(args, "pallas_gpu", arch, d, g, dtype, has_seg)
                        base = {"arch": arch, "head_dim": d, "group": g, "dtype": dtype,
                                "seg": has_seg}
                        try:
                            found = gk.triton_kernels(case, args.chunk, arch)
                        except gk.CompileError as e:
                            found = {k: e for k in args.kernels}
                        for name in args.kernels:
                            tile = case.tiles[KERNELS.index(name)]
                            row = {**base, "kernel": name, **tile._asdict(), "error": ""}
                            try:
                                if isinstance(found[name], Exception):
                                    raise found[name]
                                key = (arch, found[name]["ttir"], tile)
                                cache[key] = cache.get(key) or gk.compile_kernel(found[name], arch)
                                row.update(cache[key])
                            except gk.CompileError as e:
                                row["error"] = str(e)
                            row["status"] = "; ".join(gk.problems(row)) or "ok"
                            log(_md_row(row))
                            rows.append(row)
    return rows


GPU_HEADER = ("| arch | kernel | head dim | group | dtype | seg | tile q x kv | warps / stages | "
              "registers | spill B | smem B / limit | tensor-core ops | status |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def _md_row(r):
    if r["error"]:
        stats = "| - | - | - | - "
    else:
        stats = (f"| {r['registers']} | {r['spill_bytes']} | {r['smem']:,} / {r['smem_limit']:,} "
                 f"| {r['tensor_core_ops']} ")
    return (f"| {r['arch']} | {r['kernel']} | {r['head_dim']} | {r['group']} | {r['dtype']} | "
            f"{'yes' if r['seg'] else 'no'} | {r['block_q']} x {r['block_kv']} | "
            f"{r['num_warps']} / {r['num_stages']} {stats}| {r['status']} |")


def tpu_rows(args, log):
    from planning import tpu_kernels as tk
    rows = []
    for d in args.head_dims:
        for g in args.groups:
            for dtype in args.dtypes:
                for has_seg in _segs(args):
                    case = _case(args, "pallas_tpu", "sm_90", d, g, dtype, has_seg)
                    try:
                        tk.lower(case, args.chunk)
                        error, sizes = "", tk.vmem(case, args.chunk)
                    except tk.CompileError as e:
                        error, sizes = str(e), {}
                    for name in args.kernels:
                        tile = case.tiles[KERNELS.index(name)]
                        row = {"head_dim": d, "group": g, "dtype": dtype, "seg": has_seg,
                               "kernel": name, "block_q": tile.block_q, "block_kv": tile.block_kv,
                               "error": error, **sizes.get(name, {})}
                        fits = [c for c, limit in tk.SCOPED_VMEM.items()
                                if not error and row["vmem"] <= limit]
                        row["fits"] = fits
                        log(_tpu_md_row(row))
                        rows.append(row)
    return rows


TPU_HEADER = ("| kernel | head dim | group | dtype | seg | tile q x kv (rows) | blocks x2 + scratch "
              "MiB | score tile MiB | fits scoped VMEM of |\n|---|---|---|---|---|---|---|---|---|")


def _tpu_md_row(r):
    mib = lambda b: f"{b / (1 << 20):.2f}"
    sizes = (f"| {mib(r['vmem'])} | {mib(r['score_tile'])} | {', '.join(r['fits']) or 'none'} |"
             if not r["error"] else f"| - | - | {r['error']} |")
    return (f"| {r['kernel']} | {r['head_dim']} | {r['group']} | {r['dtype']} | "
            f"{'yes' if r['seg'] else 'no'} | {r['block_q']} x {r['block_kv']} "
            f"({r['block_q'] * r['group']}) {sizes}")


def sweep_rows(args, log):
    from planning import tile_sweep
    rows, table = [], {}
    for arch in args.arch:
        for d in args.head_dims:
            for dtype in args.dtypes:
                chosen = []
                for name in KERNELS:
                    tile, tried = tile_sweep.sweep(arch, d, dtype, name, args.chunk, log)
                    rows.append({"arch": arch, "head_dim": d, "dtype": dtype, "kernel": name,
                                 "tile": tile._asdict() if tile else None, "tried": tried})
                    chosen.append(tile)
                table[(arch, d, dtype)] = chosen
    print("GPU_TILES = {")
    for (arch, d, dtype), tiles in table.items():
        print(f"    ({arch!r}, {d}, {dtype!r}): ({', '.join(map(repr, tiles))}),")
    print("}")
    return rows


def main(argv=None):
    args = parse_args(argv)
    log = lambda line: print(line, file=sys.stderr, flush=True)
    from planning import gpu_kernels as gk
    try:
        version = None if args.tpu else gk.triton_version()
    except gk.CompileError as e:
        print(f"gpu_compile: {e}")
        return 2
    try:
        if args.sweep:
            rows = sweep_rows(args, log)
            bad = [r for r in rows if r["tile"] is None]
        elif args.tpu:
            rows = tpu_rows(args, log)
            print(TPU_HEADER, *map(_tpu_md_row, rows), sep="\n")
            bad = [r for r in rows if r["error"] or not r["fits"]]
        else:
            log(f"triton {version}; chunk {args.chunk}")
            rows = gpu_rows(args, log)
            print(GPU_HEADER, *map(_md_row, rows), sep="\n")
            bad = [r for r in rows if r["status"] != "ok"]
    except ValueError as e:  # a tile the kernel cannot run (KernelError is one)
        print(f"gpu_compile: {e}")
        return 2
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"triton": version, "args": vars(args), "rows": rows}, f, indent=1)
    for r in bad:
        what = " ".join(f"{k}={r[k]}" for k in ("arch", "kernel", "head_dim", "group", "dtype", "seg")
                        if k in r)
        print(f"gpu_compile: not ok: {what}: {r.get('status') or r.get('error') or 'no tile'}",
              file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
