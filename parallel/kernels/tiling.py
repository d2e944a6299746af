"""Tile sizes of every per-round kernel: fitting its tiles to a chunk, the divisibility rule
every tile meets, and the dispatch to the kernel's own rules (one line naming the field and what
would be valid, before compiling).

Each kernel module (``parallel/kernels/<kernel>.py``, found through the registry) holds its own
rules, so a new kernel needs no edit here:

- ``default_tiles(group, head_dim, dtype, arch)``: its (forward, dQ, dK/dV) ``Tile``s before
  fitting to a chunk (``arch``: :func:`device_arch`'s name, or None);
- ``check_tile(names, tile, group, head_dim, chunk)`` (optional): a one-line ``KernelError``
  unless the real (not interpreted) kernel can run a fitted ``tile``;
- ``device_arch(device)`` (optional): the architecture its defaults depend on;
- ``FIT_DEFAULTS`` (optional, True): a default longer than the chunk shrinks to a power of two
  dividing it; False: it must divide the chunk like a user's tile (``xla``: its default is the
  config's).
- ``backward_tile(block)`` (optional): the backward's (dQ, dK/dV) tile for a fitted forward
  tile of ``block`` (``xla``: at most 256 where that divides it).

In Pallas interpret mode (a CPU: the tests) only the divisibility rule applies.
"""
from __future__ import annotations

import math

from parallel import kernels
from parallel.kernels.spec import Tile


def device_arch(kernel: str, device=None) -> str | None:
    """The architecture a resolved kernel's default tiles depend on, for ``device`` (None: the
    kernel's defaults are the same everywhere)."""
    arch = getattr(kernels.module(kernel), "device_arch", None)
    return arch(device) if arch else None


def _divisors(n: int) -> str:
    ds = [x for x in range(1, n + 1) if n % x == 0]
    return ", ".join(map(str, ds if len(ds) <= 12 else ds[:6] + ["..."] + ds[-3:]))


def tile_size(name, block, chunk, seq_len, shards):
    """Tile size actually used: clamped to the chunk when larger, else it must divide it.

    Clamping lets the model's default (512) run on short sequences and makes the smallest valid
    length per device work; a smaller tile that does not divide the chunk is a user error
    (ValueError; ``configs/validate.py`` reports it before anything compiles).
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


def plan(kernel, block_q, block_kv, *, group, head_dim, dtype, chunk, seq_len, shards,
         interpret, arch=None, names=("block_q", "block_kv")) -> tuple[Tile, Tile, Tile]:
    """(forward, dQ, dK/dV) tiles a resolved kernel runs for one chunk: the user's
    ``block_q``/``block_kv`` (0 or None: the kernel's defaults) for all three, fitted to the
    chunk (:func:`tile_size`) and checked by the kernel's rules unless interpreted (KernelError /
    ValueError naming ``names``)."""
    rules = kernels.module(kernel)
    fit_defaults = getattr(rules, "FIT_DEFAULTS", True)
    check = getattr(rules, "check_tile", None)
    backward = getattr(rules, "backward_tile", None)
    tiles = []
    for i, tile in enumerate(rules.default_tiles(group, head_dim, str(dtype), arch)):
        fitted = [tile_size(n, b or d, chunk, seq_len, shards) if b or not fit_defaults
                  else _fit_default(d, chunk)
                  for n, b, d in zip(names, (block_q, block_kv), tile[:2])]
        if i and backward:  # the dQ and dK/dV tiles
            fitted = [backward(f) for f in fitted]
        tiles.append(tile._replace(block_q=fitted[0], block_kv=fitted[1]))
        if check and not interpret:
            check(names, tiles[-1], group, head_dim, chunk)
    return tuple(tiles)
