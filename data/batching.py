"""From natural-order host rows to a sharded global batch in layout order.

The layout permutation is applied on the host to every array at once, after labels are
shifted, so the model never sees natural order; the result is placed on the mesh already
sharded ``P(("data", "fsdp"), "sequence")``, each process supplying only its own block.
"""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from parallel import layouts
from parallel.mesh import BATCH_AXES

BATCH_SPEC = P(BATCH_AXES, "sequence")


def to_layout(batch: dict, layout: str, num_shards: int, stripe: int = 1) -> dict:
    """Every array of a natural-order batch ``[..., L]`` permuted into ``layout`` order."""
    seq_len = next(iter(batch.values())).shape[-1]
    perm = layouts.permutation(layout, seq_len, num_shards, stripe)
    return {k: np.ascontiguousarray(v[..., perm]) for k, v in batch.items()}


def from_layout(batch: dict, layout: str, num_shards: int, stripe: int = 1) -> dict:
    """The inverse of ``to_layout``: a layout-order batch back in natural order."""
    seq_len = next(iter(batch.values())).shape[-1]
    inv = layouts.inverse(layouts.permutation(layout, seq_len, num_shards, stripe))
    return {k: np.ascontiguousarray(v[..., inv]) for k, v in batch.items()}


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, BATCH_SPEC)


def contiguous_block(index_slices, global_shape) -> tuple[slice, slice]:
    """The (rows, columns) block covered by a process's device slices; it must be one block.

    ``make_array_from_process_local_data`` takes one contiguous block per process, which is what
    a mesh built with the process index outermost on the batch axes gives."""
    bounds = []
    for dim, size in enumerate(global_shape):
        spans = sorted({s[dim].indices(size)[:2] for s in index_slices})
        lo, hi = spans[0][0], spans[0][1]
        for a, b in spans[1:]:
            if a > hi:
                raise ValueError(f"this process's devices hold a non-contiguous part of batch "
                                 f"dimension {dim} ({spans}); build the mesh with processes "
                                 f"outermost on the data/fsdp axes")
            hi = max(hi, b)
        bounds.append(slice(lo, hi))
    return bounds[0], bounds[1]


def process_block(sharding: NamedSharding, global_shape) -> tuple[slice, slice]:
    """The rows and (layout-order) columns of the global batch this process must supply."""
    index_map = sharding.addressable_devices_indices_map(tuple(global_shape))
    return contiguous_block(list(index_map.values()), global_shape)


def to_global(local: dict, sharding: NamedSharding, global_shape) -> dict:
    """This process's block of every array -> global ``jax.Array``s sharded by ``sharding``."""
    return {k: jax.make_array_from_process_local_data(sharding, v, tuple(global_shape))
            for k, v in local.items()}
