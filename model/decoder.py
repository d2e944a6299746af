"""The LLaMA-style decoder: embedding, a scanned stack of blocks, final norm, untied head."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from model.layers import AttentionBackend, Block, RMSNorm, _param

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
REMAT = ("none", "attention", "full", "offload")


def compute_dtype(name: str):
    """``auto`` is bf16 on accelerators and fp32 on CPU (XLA CPU bf16 matmuls are slow)."""
    if name == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    return DTYPES[name]


def remat_policy(name: str):
    """What each layer keeps for the backward pass; everything else is recomputed.

    none: keep all activations. full: keep only the layer input. attention: keep the
    projection matmuls, recompute attention and elementwise work. offload: like attention,
    but the kept matmul outputs live in host memory (GPU/TPU only)."""
    cp = jax.checkpoint_policies
    if name == "full":
        return cp.nothing_saveable
    if name == "attention":
        return cp.dots_with_no_batch_dims_saveable
    if name == "offload":
        if jax.default_backend() == "cpu":
            return cp.dots_with_no_batch_dims_saveable  # no separate host memory to offload to
        return cp.offload_dot_with_no_batch_dims("device", "pinned_host")
    return None


class Decoder(nnx.Module):
    def __init__(self, m, backend: AttentionBackend, rngs: nnx.Rngs):
        dtype = compute_dtype(m.dtype)
        self.embed = _param(rngs, (m.vocab_size, m.d_model), ("vocab", "embed"), 1.0)
        keys = jax.random.split(rngs.params(), m.num_layers)
        # One Block's structure, parameters stacked over layers so that lax.scan can run them:
        # compile time stays flat in depth.
        self.blocks = nnx.vmap(lambda k: Block(m, backend, dtype, nnx.Rngs(k)))(keys)
        self.final_norm = RMSNorm(m.d_model, m.norm_eps)
        self.head = _param(rngs, (m.d_model, m.vocab_size), ("embed", "vocab"), m.init_std)
        self.dtype, self.remat, self.scan_layers = dtype, m.remat, m.scan_layers
        self.num_layers = m.num_layers
        self.act_sharding = (jax.sharding.NamedSharding(backend.mesh, jax.sharding.PartitionSpec(
            ("data", "fsdp"), "sequence", None)) if backend.mesh is not None else None)

    def __call__(self, tokens_BL, positions_BL, segment_ids_BL):
        """Logits [B, L, V] in fp32, in the batch's token layout."""
        embed_VD = self.embed[...]
        if self.act_sharding is not None:
            # Gather the (fsdp x sequence)-sharded table whole first, as FSDP does for every
            # weight: a lookup straight from a table split along D has no efficient
            # partitioning into the batch x length layout and XLA would replicate it anyway.
            embed_VD = jax.lax.with_sharding_constraint(
                embed_VD, jax.sharding.NamedSharding(self.act_sharding.mesh, jax.sharding.PartitionSpec()))
        x_BLD = jnp.take(embed_VD, tokens_BL, axis=0).astype(self.dtype)
        graphdef, stacked = nnx.split(self.blocks)

        def layer(x_BLD, layer_state):
            if self.act_sharding is not None:
                x_BLD = jax.lax.with_sharding_constraint(x_BLD, self.act_sharding)
            block = nnx.merge(graphdef, layer_state)
            return block(x_BLD, positions_BL, segment_ids_BL), None

        if self.remat != "none":
            layer = jax.checkpoint(layer, policy=remat_policy(self.remat), prevent_cse=False)
        if self.scan_layers:
            x_BLD, _ = jax.lax.scan(layer, x_BLD, stacked)
        else:
            for i in range(self.num_layers):
                x_BLD, _ = layer(x_BLD, jax.tree.map(lambda a, i=i: a[i], stacked))
        x_BLD = self.final_norm(x_BLD)
        return jnp.einsum("bld,dv->blv", x_BLD, self.head[...].astype(self.dtype),
                          preferred_element_type=jnp.float32)


def backend_from_config(config, mesh=None) -> AttentionBackend:
    from parallel import kernels
    a = config.attention
    kernel = kernels.resolve(a.get("kernel", "auto"), kernels.platform_of(mesh))
    block_q, block_kv = kernels.tiles(kernel, a, config.model.num_heads // config.model.num_kv_heads)
    return AttentionBackend(impl=a.impl, layout=a.layout, kernel=kernel, stripe=a.stripe,
                            block_q=block_q, block_kv=block_kv, mesh=mesh,
                            document_mask=bool(a.document_mask), ulysses=int(a.get("ulysses", 1)))
