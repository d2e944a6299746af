"""Which row lengths a run's mesh, layout and attention accept, and the lengths evaluation
pads rows to: the trainer's own checks (training/validate.py) decide, so a length that
evaluates here would also train."""
from __future__ import annotations

import functools


def length_problem(config, mesh, length: int) -> str | None:
    """Why ``length`` cannot run on this mesh and layout (the trainer's own checks), or None."""
    from errors import ConfigError
    from training.validate import validate
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


class Buckets:
    """The length a row of ``n`` tokens is padded to: the smallest valid length at or above
    the next power of two (at least 64), so that rows of many lengths share a few compiled
    programs; ``None`` past ``cap``."""

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
