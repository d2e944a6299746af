"""The real train step, compiled for a mesh of simulated CPU devices without allocating it.

``Trainer`` builds the parameters' structure with ``nnx.eval_shape`` and the state as
ShapeDtypeStructs carrying their shardings, so ``train_step.lower(abstract_state, batch)``
compiles exactly the program a run would execute, and ``memory_analysis()`` gives its
per-device buffers (one SPMD program per device).
"""
from __future__ import annotations

import copy
import dataclasses
import math
import time

import jax
import jax.numpy as jnp

from planning.collectives import program_text
from training.state import FAST_COMPILE

# The planner never runs what it compiles: training/state.py's FAST_COMPILE says why its options.
PLAN_COMPILER_OPTIONS = FAST_COMPILE


@dataclasses.dataclass
class Memory:
    """Per-device bytes of one compiled step."""
    arguments: int  # train state + batch, as passed in
    outputs: int  # new state + metrics
    aliased: int  # outputs written into donated arguments (counted once)
    temporaries: int  # activations, gradients, optimizer scratch, collective buffers
    host_temporaries: int = 0
    params: int = 0  # parts of the arguments
    optimizer: int = 0
    batch: int = 0

    @property
    def total(self) -> int:
        return self.arguments + self.outputs - self.aliased + self.temporaries

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "total": self.total}


@dataclasses.dataclass
class Compiled:
    config: object  # the planned config (dtype and remat resolved)
    memory: Memory
    hlo_text: str
    lower_s: float
    compile_s: float
    executable: object  # jax.stages.Compiled: runnable on the same devices
    trainer: object
    abstract_batch: dict


def planned_config(config, seq_len: int, global_rows: int, mesh_sizes: dict, remat: str | None):
    """The config a run would use: accelerator dtype, the planned shape, mesh and remat.

    ``auto`` resolves to bf16 (what a GPU/TPU run computes in) rather than to the CPU's fp32,
    so that activations are planned at the accelerator's size; parameters stay fp32. A mixture
    of experts' ``grouped=auto`` resolves to ragged (jax.lax.ragged_dot), as on a GPU/TPU."""
    c = copy.deepcopy(config)
    with c.unlocked():
        if c.model.dtype == "auto":
            c.model.dtype = "bfloat16"
        if remat:
            c.model.remat = remat
        moe = c.model.get("moe", None)
        if moe is not None and moe.get("num_experts", 0) and moe.get("grouped", "auto") == "auto":
            moe.grouped = "ragged"  # what auto is on a GPU/TPU (compiled here as ragged_shape)
        c.data.seq_len = seq_len
        c.data.batch_size = global_rows
        for axis, size in mesh_sizes.items():
            c.mesh[axis] = size
    return c


def abstract_batch(trainer, rows: int, seq_len: int) -> dict:
    """ShapeDtypeStructs of one [B, L] batch, sharded like the real ones."""
    return trainer.abstract_batch(rows, seq_len)


def shard_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (the largest shard)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) else x.shape
        total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
    return total


def compile_step(config, devices, compiler_options=None) -> Compiled:
    """Lowers and compiles the train step of ``config`` over ``devices`` (no weights made); a
    mixture of experts' ragged_dot as its stand-in on CPU devices (``model.moe.grouped=
    ragged_shape``: model/moe.py grouped_matmul)."""
    from parallel.mesh import make_mesh
    from training.state import Trainer

    t0 = time.perf_counter()
    moe = config.model.get("moe", None)
    if devices[0].platform == "cpu" and moe is not None and moe.get("grouped", "") == "ragged":
        config = copy.deepcopy(config)
        with config.unlocked():
            config.model.moe.grouped = "ragged_shape"
    mesh = make_mesh(config.mesh, devices)
    trainer = Trainer(config, mesh)
    batch = abstract_batch(trainer, config.data.batch_size, config.data.seq_len)
    lowered = trainer.train_step.lower(trainer.abstract_state, batch)
    t1 = time.perf_counter()
    opts = PLAN_COMPILER_OPTIONS if compiler_options is None else compiler_options
    compiled = lowered.compile(compiler_options=opts)
    t2 = time.perf_counter()
    ma = compiled.memory_analysis()
    state = trainer.abstract_state
    memory = Memory(
        arguments=int(ma.argument_size_in_bytes), outputs=int(ma.output_size_in_bytes),
        aliased=int(ma.alias_size_in_bytes), temporaries=int(ma.temp_size_in_bytes),
        host_temporaries=int(getattr(ma, "host_temp_size_in_bytes", 0) or 0),
        params=shard_bytes(state.params), optimizer=shard_bytes(state.opt_state),
        batch=shard_bytes(batch))
    return Compiled(config, memory, program_text(compiled), t1 - t0, t2 - t1, compiled, trainer,
                    batch)
