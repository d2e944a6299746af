"""Which row lengths a run's mesh, layout and attention accept, the lengths evaluation pads
rows to, and the padded rows: the trainer's own checks (configs/validate.py) decide, so a
length that evaluates here would also train."""
from __future__ import annotations

import functools

import numpy as np


def length_problem(config, mesh, length: int) -> str | None:
    """Why ``length`` cannot run on this mesh and layout (the trainer's own checks), or None."""
    from errors import ConfigError
    from configs.validate import validate
    c = config.copy_and_resolve_references()
    c.data.seq_len = length
    try:
        validate(c, int(mesh.devices.size))
    except ConfigError as e:
        return str(e)
    return None


def unit(config, mesh) -> int:
    """The step between lengths the layout can split: the sequence axis, times the stripe
    width (striped) or 2 (zigzag)."""
    a, shards = config.attention, int(mesh.shape["sequence"])
    return {"contiguous": shards, "striped": shards * int(a.stripe),
            "zigzag": 2 * shards}.get(a.layout, shards)


def nearby_valid(config, mesh, length: int, shortest: int, step: int, want: int = 2,
                 tries: int = 4096) -> list[int]:
    """Up to ``want`` valid lengths nearest to ``length`` on one side (``step`` < 0: below),
    walking multiples of the layout's unit ``|step|`` (tile sizes may skip some of them)."""
    u = abs(step)
    n = (length - 1) // u * u if step < 0 else (length // u + 1) * u
    found = []
    for _ in range(tries):
        if len(found) == want or n < max(shortest, 1):
            break
        if length_problem(config, mesh, n) is None:
            found.append(n)
        n += step
    return sorted(found)


def next_valid(config, mesh, n: int, tries: int = 4096) -> int | None:
    """The smallest length of at least ``n`` that the layout and mesh accept (None if none
    within ``tries`` layout units)."""
    if length_problem(config, mesh, n) is None:
        return n
    found = nearby_valid(config, mesh, n, n, unit(config, mesh), want=1, tries=tries)
    return found[0] if found else None


class Buckets:
    """The length a row of ``n`` tokens is padded to: the smallest valid length at or above
    the next power of two (at least 64), so that rows of many lengths share a few compiled
    programs; where that passes ``cap``, the smallest valid length from ``n`` up to ``cap``
    (or up to one layout unit, for a cap below it); ``None`` when there is none."""

    def __init__(self, config, mesh, cap: int):
        self.config, self.mesh, self.cap = config, mesh, int(cap)
        self.unit = unit(config, mesh)

    @functools.lru_cache(maxsize=None)
    def __call__(self, n: int) -> int | None:
        target = max(64, 1 << max(int(n) - 1, 0).bit_length())
        for start in (target, n):  # the power of two, else the tightest fit under the cap
            length = -(-start // self.unit) * self.unit
            while length <= max(self.cap, self.unit):
                if length_problem(self.config, self.mesh, length) is None:
                    return length
                length += self.unit
        return None


def pad_rows(token_lists, length: int) -> tuple[dict, np.ndarray]:
    """(natural-order batch of tokens, positions and segment ids [B, length], real [B, length]):
    each row's tokens, then padding after them, where the causal mask hides it. Padding gets
    position 0 for RoPE, so the largest position in a row is its own last token's (a dynamic
    RoPE scaling reads the batch's largest)."""
    B = len(token_lists)
    tokens_BL = np.zeros((B, length), np.int32)
    for i, row in enumerate(token_lists):
        tokens_BL[i, :len(row)] = row
    natural_L = np.arange(length, dtype=np.int32)
    real_BL = natural_L[None] < np.array([len(r) for r in token_lists])[:, None]
    return {"tokens": tokens_BL, "positions": np.where(real_BL, natural_L, 0).astype(np.int32),
            "segment_ids": np.ones((B, length), np.int32)}, real_BL
