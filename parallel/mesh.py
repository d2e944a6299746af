"""The device mesh and the one table that maps logical parameter/activation axes to it."""
from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from errors import MeshError  # also importable as parallel.mesh.MeshError

AXES = ("data", "fsdp", "sequence", "tensor")
BATCH_AXES = ("data", "fsdp")  # the axes a batch's rows split over (RULES["batch"])

# Logical axis name -> mesh axis (or axes). Parameters name their axes with the keys; nothing
# else in the code base decides how a parameter is sharded.
RULES = {
    "batch": BATCH_AXES,
    "length": "sequence",
    "vocab": "tensor",
    # Parameters and optimizer state are split over every axis that splits the batch or the
    # sequence (ZeRO-3 over data-parallel and context-parallel devices alike): a ring of 64
    # devices would otherwise hold a full copy of the 7B state on each of them.
    "embed": ("fsdp", "sequence"),
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    # A mixture of experts' stacked weights [experts, D, F]: split by expert over the devices
    # that split the batch and the sequence, the experts folded onto them (model/moe.py); D
    # whole within an expert, so that the one mesh axis is not named twice.
    "experts": ("fsdp", "sequence"),
    "expert_embed": None,
    "norm": None,
    "layers": None,
    # a LoRA adapter's rank (model/lora.py): small, whole on every device
    "lora": None,
}


def mesh_shape(mesh_cfg, num_devices: int) -> dict[str, int]:
    """Axis sizes with the single -1 filled so that the product equals ``num_devices``."""
    sizes = {a: int(mesh_cfg[a]) for a in AXES}
    fill = [a for a, s in sizes.items() if s == -1]
    bad = [a for a, s in sizes.items() if s == 0 or s < -1]
    if bad:
        raise MeshError(f"mesh.{bad[0]}={sizes[bad[0]]} is invalid; use a positive size or -1 (fill)")
    if len(fill) > 1:
        raise MeshError(f"only one mesh axis may be -1 (fill), got {', '.join('mesh.' + a for a in fill)}")
    known = math.prod(s for s in sizes.values() if s != -1)
    if fill:
        if num_devices % known:
            raise MeshError(
                f"mesh.{fill[0]}=-1 cannot fill {num_devices} devices: the other axes multiply to "
                f"{known}, which does not divide {num_devices}")
        sizes[fill[0]] = num_devices // known
    elif known != num_devices:
        raise MeshError(
            f"mesh {'x'.join(str(sizes[a]) for a in AXES)} (data x fsdp x sequence x tensor) has "
            f"{known} devices but {num_devices} are available; make the product {num_devices} or set "
            f"one axis to -1 (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count={known} "
            f"simulates {known} devices)")
    return sizes


def batch_shards(mesh) -> int:
    """How many ways a batch's rows split: the data x fsdp axes (a batch is a multiple)."""
    return math.prod(int(mesh.shape[a]) for a in BATCH_AXES)


def make_mesh(mesh_cfg, devices=None) -> Mesh:
    """Auto (GSPMD-propagated) axes: shardings are declared on params, batch and activations."""
    devices = jax.devices() if devices is None else devices
    sizes = mesh_shape(mesh_cfg, len(devices))
    shape = tuple(sizes[a] for a in AXES)
    try:
        # Lays the axes out over the physical topology (ICI/NVLink first for inner axes).
        return jax.make_mesh(shape, AXES, devices=devices, axis_types=(AxisType.Auto,) * len(AXES))
    except Exception:  # topology-unaware backends (CPU, odd device counts)
        return Mesh(np.asarray(devices).reshape(shape), AXES, axis_types=(AxisType.Auto,) * len(AXES))


def logical_to_spec(axes, ndim: int | None = None) -> P:
    """PartitionSpec for a tensor whose dims carry ``axes`` logical names.

    A tensor with one more dim than names is a stack over layers (scan), leading dim unsharded."""
    axes = tuple(axes or ())
    if ndim is not None and ndim == len(axes) + 1:
        axes = ("layers",) + axes
    return P(*(RULES[a] if a is not None else None for a in axes))


def fit_spec(spec: P, shape, mesh: Mesh) -> P:
    """Keeps, per dim, the leading mesh axes whose product divides it (a 4-row table cannot
    split 8 ways, but it can still split over the first 2-way axis)."""
    out = []
    for dim, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        names = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
        kept, size = [], 1
        for n in names:
            if mesh.shape[n] > 1 and dim % (size * mesh.shape[n]) == 0:
                kept.append(n)
                size *= mesh.shape[n]
        out.append(None if not kept else (tuple(kept) if len(kept) > 1 else kept[0]))
    return P(*out)


def param_shardings(abstract_state, mesh: Mesh):
    """NamedShardings for an nnx.State of Params that carry an ``axes`` metadata entry."""
    from flax import nnx

    def one(var):
        spec = logical_to_spec(var.get_metadata().get("axes"), var.ndim)
        return NamedSharding(mesh, fit_spec(spec, var.shape, mesh))

    return jax.tree.map(one, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Rows over (data, fsdp), tokens over sequence: the layout of every [B, L] batch array."""
    return NamedSharding(mesh, P(RULES["batch"], RULES["length"]))


def activation_sharding(mesh: Mesh) -> NamedSharding:
    """The residual stream [B, L, D] between layers."""
    return NamedSharding(mesh, P(RULES["batch"], RULES["length"], None))
