"""The search that chose ``parallel/kernels/pallas_gpu.py``'s default tiles (``GPU_TILES``).

Per arch, head dim, dtype and kernel (forward, dQ, dK/dV): candidates from the largest tile
down (its own rows first: the q tile of the forward and dQ kernels, the kv tile of dK/dV; then
the tile it loops over), and for each tile warps 8 then 4 (4 then 8 below 64 rows) and
stages 3, 2, 1. The first that compiles in every one of ``CHECKS`` (with segment ids, the bigger
kernel, and without; uneven and power-of-two groups) with no spill, within the arch's shared
memory less ``SMEM_MARGIN`` and with tensor-core instructions, is the default.
"""
from __future__ import annotations

import itertools

from planning import gpu_kernels as gk
from planning import kernel_export as kx
from parallel.kernels.spec import Tile

ROWS = (128, 64, 32, 16)
WARPS = (8, 4)
STAGES = (3, 2, 1)
MARGINAL_SPILL = 256  # bytes: a spill this small may go with one stage fewer
# (segment ids, query heads per kv head) a default must compile clean in. The group changes
# only index arithmetic, yet that can tip a kernel at 255 registers into a spill.
CHECKS = ((True, 1), (True, 4), (True, 7), (False, 4))
# Shared memory a default leaves free: on a GPU the Triton inside jaxlib compiles the kernels,
# and one allocation a little larger than triton 3.9.0's must not stop a launch.
SMEM_MARGIN = 8 * 1024


def candidates(kernel: str):
    """(tile, [(warps, stages), ...]) from the largest tile down (ties: more of the kernel's own
    rows first), warps 8 then 4 from 64 own rows up, 4 then 8 below, stages 3, 2, 1."""
    pairs = sorted(itertools.product(ROWS, ROWS), key=lambda p: (-p[0] * p[1], -p[0]))
    for own, inner in pairs:
        bq, bk = (inner, own) if kernel == "dkv" else (own, inner)
        yield (bq, bk), [(w, s) for w in (WARPS if own >= 64 else WARPS[::-1]) for s in STAGES]


def try_tile(arch, head_dim, dtype, kernel, tile, chunk, log) -> dict:
    """Compiles one kernel with ``tile`` in each of ``CHECKS``; the first bad row, else the last."""
    rows = []
    for has_seg, group in CHECKS:
        case = kx.Case("pallas_gpu", head_dim, group, dtype, has_seg, (tile,) * 3)
        try:
            compiled = gk.compile_kernel(gk.triton_kernels(case, chunk, arch)[kernel], arch)
            row = {**compiled, "error": ""}
        except gk.CompileError as e:
            row = {"error": str(e)}
        row["problems"] = gk.problems(row)
        if not row["error"] and row["smem_limit"] - SMEM_MARGIN < row["smem"] <= row["smem_limit"]:
            row["problems"].append(f"shared memory {row['smem']} within {SMEM_MARGIN} B of the limit")
        rows.append(row)
        if row["problems"]:
            break
    worst = rows[-1]
    log(f"  {arch} d={head_dim} {dtype} {kernel} {tile.block_q}x{tile.block_kv} "
        f"w{tile.num_warps} s{tile.num_stages}: {'; '.join(worst['problems']) or 'ok'} "
        f"(regs {worst.get('registers', '-')}, smem {worst.get('smem', '-')})")
    return worst


def sweep(arch, head_dim, dtype, kernel, chunk=4096, log=print) -> tuple[Tile | None, int]:
    """The default tile of one kernel, and how many candidates were compiled. A spill (beyond
    ``MARGINAL_SPILL``) ends a (tile, warps): fewer stages save shared memory, hardly registers.
    Such a spill with 8 warps ends the tile: fewer warps hold more per thread."""
    tried = 0
    for (bq, bk), launches in candidates(kernel):
        spilled = set()
        for warps, stages in launches:
            if warps in spilled or (spilled and max(spilled) == max(WARPS)):
                continue
            tried += 1
            tile = Tile(bq, bk, warps, stages)
            row = try_tile(arch, head_dim, dtype, kernel, tile, chunk, log)
            if not row["problems"]:
                return tile, tried
            if row.get("spill_bytes", 0) > MARGINAL_SPILL or row.get("error"):
                spilled.add(warps)
    return None, tried
