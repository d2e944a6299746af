"""Tile sizes of every per-round kernel: the defaults, fitting them to a chunk, and the rules a
user's tile must meet (one line naming the field and what would be valid, before compiling).

- ``xla``: any tile dividing the chunk (a larger one is clamped to the chunk).
- ``pallas_gpu`` (Triton): Triton sizes every in-kernel array to a power of two and its dots
  want 16 or more per side, so tiles and the head dim are powers of two >= 16. The kernel runs
  one query head per program (``pallas_gpu.py``), so the tile does not depend on the group. The
  defaults (``GPU_TILES``) are per architecture, head dim and dtype, and may differ between the
  forward, dQ and dK/dV kernels: each is the largest tile, then warps and stages, that compiles
  with no register spill and within the arch's shared memory.
- ``pallas_tpu`` (Mosaic): a tile holds ``block_q * G`` rows of the folded queries (sublanes:
  a multiple of 8) and ``block_kv`` keys on lanes (a multiple of 128), unless it is the whole
  chunk. The default keeps about 512 rows whatever the group, in power-of-two positions.

In Pallas interpret mode (a CPU: the tests) only the divisibility rule applies.
"""
from __future__ import annotations

import math

from errors import KernelError
from parallel.kernels.spec import Tile

XLA_TILE = 512  # positions, both sides (attention.block_q / block_kv's default)
TPU_ROWS, TPU_KV = 512, 512  # q rows (positions x group) and keys per Mosaic tile
TRITON_MIN = 16  # the smallest side of a Triton dot

# Shared memory a block may use (the opt-in maximum), bytes: A100 (sm_80); the other Amperes
# and Ada, e.g. A10, L4, RTX 4090 (sm_86 / sm_89: the sm_86 row); H100 / H200 (sm_90).
SMEM_LIMIT = {"sm_80": 166_912, "sm_86": 101_376, "sm_90": 232_448}

# (arch, head_dim) -> (forward, dQ, dK/dV) tiles: Tile(block_q, block_kv, num_warps, num_stages).
# Chosen by
#     python scripts/gpu_compile.py --sweep --arch sm_80,sm_86,sm_90 --dtypes bfloat16
# (planning/tile_sweep.py: every candidate compiled for the arch by the triton package; the
# largest tile, then warps, then stages, with and without segment ids, for groups 1, 4 and 7,
# with no spill, 8 KiB under SMEM_LIMIT and with tensor-core instructions). fp16 compiles the
# same (python scripts/gpu_compile.py reports every default clean). fp32 inputs halve the tiles,
# unswept: full-precision fp32 dots have no tensor cores and still spill at these tiles
# (--dtypes float32 shows it); fp32 is no GPU training dtype here (model.dtype=auto is bf16).
GPU_TILES = {
    ("sm_90", 64): (Tile(128, 128, 8, 3), Tile(128, 128, 8, 3), Tile(128, 64, 8, 3)),
    ("sm_90", 128): (Tile(128, 128, 8, 2), Tile(128, 64, 8, 3), Tile(128, 64, 8, 1)),
    ("sm_90", 256): (Tile(64, 32, 8, 3), Tile(64, 32, 8, 3), Tile(128, 16, 8, 2)),
    ("sm_80", 64): (Tile(128, 128, 8, 3), Tile(128, 64, 8, 3), Tile(128, 32, 4, 2)),
    ("sm_80", 128): (Tile(64, 128, 8, 2), Tile(64, 128, 8, 2), Tile(128, 64, 8, 2)),
    ("sm_80", 256): (Tile(32, 128, 8, 2), Tile(64, 64, 8, 2), Tile(64, 32, 8, 2)),
    ("sm_86", 64): (Tile(128, 128, 8, 3), Tile(128, 64, 8, 3), Tile(128, 32, 4, 3)),
    ("sm_86", 128): (Tile(64, 128, 8, 1), Tile(64, 128, 8, 1), Tile(64, 64, 8, 2)),
    ("sm_86", 256): (Tile(64, 64, 8, 1), Tile(64, 16, 8, 2), Tile(16, 64, 8, 2)),
}


def gpu_arch(device=None) -> str:
    """The ``GPU_TILES`` architecture of a device, from its compute capability: sm_80 for 8.0,
    sm_86 for the other 8.x, sm_90 for 9.0 and above and when there is none (a CPU: interpret
    mode, or an export)."""
    cc = getattr(device, "compute_capability", None)
    if not cc or float(cc) >= 9:
        return "sm_90"
    return "sm_80" if float(cc) == 8.0 else "sm_86"


def _gpu_entry(arch, head_dim, dtype):
    """The table row of the nearest head dim at or above ``head_dim`` (else the largest); fp32
    inputs hold twice the bytes per operand: half the tiles (a guess the sweep has not made)."""
    dims = sorted({d for (_, d) in GPU_TILES})
    row = GPU_TILES[(arch, next((x for x in dims if x >= head_dim), dims[-1]))]
    if dtype in ("bfloat16", "float16"):
        return row
    return tuple(t._replace(block_q=max(TRITON_MIN, t.block_q // 2),
                            block_kv=max(TRITON_MIN, t.block_kv // 2)) for t in row)


def defaults(kernel: str, group: int, head_dim: int, dtype: str, arch: str = "sm_90"):
    """(forward, dQ, dK/dV) tiles of a resolved Pallas kernel before fitting to a chunk."""
    if kernel == "pallas_gpu":
        return _gpu_entry(arch, head_dim, str(dtype))
    block_q = 1 << max(3, (TPU_ROWS // group).bit_length() - 1)  # a power of two, >= 8
    return (Tile(block_q, TPU_KV),) * 3


def _divisors(n: int) -> str:
    ds = [x for x in range(1, n + 1) if n % x == 0]
    return ", ".join(map(str, ds if len(ds) <= 12 else ds[:6] + ["..."] + ds[-3:]))


def tile_size(name, block, chunk, seq_len, shards):
    """Tile size actually used: clamped to the chunk when larger, else it must divide it.

    Clamping lets the model's default (512) run on short sequences and makes the smallest valid
    length per device work; a smaller tile that does not divide the chunk is a user error
    (ValueError; ``training/validate.py`` reports it before anything compiles).
    """
    if block < 1:
        raise ValueError(f"{name} must be >= 1, got {block}")
    if block >= chunk:
        return chunk
    if chunk % block:
        raise ValueError(
            f"{name}={block} does not divide the per-device chunk of {chunk} tokens "
            f"(seq_len {seq_len} / {shards} sequence shards); valid {name}: "
            f"{_divisors(chunk)} (or anything larger, clamped to {chunk})")
    return block


def _fit_default(block, chunk):
    """A default tile for a chunk: the chunk when not longer, else the largest power of two up
    to ``block`` that divides it."""
    if chunk <= block:
        return chunk
    return math.gcd(chunk, 1 << (block.bit_length() - 1))


def _pow2(n):
    return n >= 1 and n & (n - 1) == 0


def _check(kernel, names, tile: Tile, group, head_dim, chunk):
    """One-line KernelError unless the real (not interpreted) kernel can run ``tile``."""
    (nq, nk), (bq, bk) = names, tile[:2]
    if kernel == "pallas_gpu":
        valid = f"powers of two >= {TRITON_MIN} dividing the chunk of {chunk} tokens"
        for name, b in ((nq, bq), (nk, bk)):
            if not (_pow2(b) and b >= TRITON_MIN):
                raise KernelError(f"{name}={b}: the Triton kernel (pallas_gpu) needs {valid}")
        if not (_pow2(head_dim) and head_dim >= TRITON_MIN):
            raise KernelError(f"head dim {head_dim} (model.head_dim, or d_model / num_heads): the "
                              f"Triton kernel (pallas_gpu) needs a power of two >= {TRITON_MIN}; "
                              f"use attention.kernel=xla")
    elif kernel == "pallas_tpu":
        if bk != chunk and bk % 128:
            raise KernelError(f"{nk}={bk}: the Mosaic kernel (pallas_tpu) needs a multiple of 128 "
                              f"dividing the chunk of {chunk} tokens, or the chunk itself")
        if bq != chunk and bq * group % 8:
            raise KernelError(f"{nq}={bq}: the Mosaic kernel (pallas_tpu) needs {nq} x "
                              f"{group} query heads per kv head to be a multiple of 8, or the chunk")


def plan(kernel, block_q, block_kv, *, group, head_dim, dtype, chunk, seq_len, shards,
         interpret, arch="sm_90", names=("block_q", "block_kv")) -> tuple[Tile, Tile, Tile]:
    """(forward, dQ, dK/dV) tiles a resolved kernel runs for one chunk: the user's
    ``block_q``/``block_kv`` (0 or None: the defaults) for all three, fitted to the chunk and
    checked (KernelError / ValueError naming ``names``). ``xla``: one tile for all three, the
    user's or ``XLA_TILE``, clamped to the chunk or dividing it (:func:`tile_size`)."""
    if kernel == "xla":
        sizes = (tile_size(n, b or XLA_TILE, chunk, seq_len, shards)
                 for n, b in zip(names, (block_q, block_kv)))
        return (Tile(*sizes),) * 3
    tiles = []
    for tile in defaults(kernel, group, head_dim, dtype, arch):
        fitted = [tile_size(n, b, chunk, seq_len, shards) if b else _fit_default(d, chunk)
                  for n, b, d in zip(names, (block_q, block_kv), tile[:2])]
        tiles.append(tile._replace(block_q=fitted[0], block_kv=fitted[1]))
        if not interpret:
            _check(kernel, names, tiles[-1], group, head_dim, chunk)
    return tuple(tiles)
