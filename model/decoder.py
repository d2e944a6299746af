"""The LLaMA-style decoder: embedding, a scanned stack of blocks, final norm, head (own or tied)."""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from model import lora as lora_lib
from model import pattern
from model.flops import moe_layers, num_experts
from model.layers import AttentionBackend, Block, GatedMLP, _param, norm_from_config
from model.loss import chunked_token_losses
from model.moe import MoE
from parallel.mesh import BATCH_AXES

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
REMAT = ("none", "attention", "full", "offload", "offload_input")
LORA_KEY = 0x10A  # folded into a layer's key for its adapters' own random stream


def compute_dtype(name: str):
    """``auto`` is bf16 on accelerators and fp32 on CPU (XLA CPU bf16 matmuls are slow)."""
    if name == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    return DTYPES[name]


def remat_policy(name: str, platform: str | None = None):
    """What each layer keeps for the backward pass; everything else is recomputed.

    none: keep all activations. full: keep only the layer input. attention: keep the
    projection matmuls, recompute attention and elementwise work. offload: like attention,
    but the kept matmul outputs live in host memory (GPU/TPU only). offload_input: like full,
    but the layer inputs live in host memory (GPU/TPU only): the device holds one layer's
    input at a time, the stack of all of them (layers x tokens x d_model) stays on the host.
    On a CPU (no separate host memory) offload is attention and offload_input is full."""
    cp = jax.checkpoint_policies
    platform = platform or jax.default_backend()
    if name == "full":
        return cp.nothing_saveable
    if name == "offload_input":
        if platform == "cpu":
            return cp.nothing_saveable
        return cp.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=["layer_input"],
            offload_src="device", offload_dst="pinned_host")
    if name == "attention":
        return cp.dots_with_no_batch_dims_saveable
    if name == "offload":
        if platform == "cpu":
            return cp.dots_with_no_batch_dims_saveable  # no separate host memory to offload to
        return cp.offload_dot_with_no_batch_dims("device", "pinned_host")
    return None


class Decoder(nnx.Module):
    def __init__(self, m, backend: AttentionBackend, rngs: nnx.Rngs,
                 lora: lora_lib.Spec | None = None):
        """``lora``: LoRA adapters on the projections it targets (model/lora.py ``spec_of``
        the run's config; None: none). Each layer's adapters draw from a key folded from the
        layer's own, so the base weights are the same with or without them."""
        dtype = compute_dtype(m.dtype)
        adapters = lambda k: (dict(lora=lora, lora_rngs=nnx.Rngs(jax.random.fold_in(k, LORA_KEY)))
                              if lora is not None else {})
        tied = bool(m.get("tie_embeddings", False))
        # A tied table is also the output head, so it starts at the head's scale.
        self.embed = _param(rngs, (m.vocab_size, m.d_model), ("vocab", "embed"),
                            m.init_std if tied else 1.0)
        keys = jax.random.split(rngs.params(), m.num_layers)
        # Where only some layers' MLP slot is a mixture of experts (model/flops.py moe_layers),
        # the MLPs are held apart, one stack per kind: ``moe_mlp`` [MoE layers, ...] and
        # ``dense_mlp`` [dense layers, ...]; ``blocks`` holds the rest of every layer. A model
        # whose layers are all alike keeps its MLP in ``blocks/mlp``, as before.
        moe_at = moe_layers(m)
        if num_experts(m) and not moe_at:
            raise ValueError("model.moe: no layer is a mixture of experts (configs/validate.py)")
        mixed = 0 < len(moe_at) < m.num_layers
        # One Block's structure, parameters stacked over layers so that lax.scan can run them:
        # compile time stays flat in depth.
        self.blocks = nnx.vmap(lambda k: Block(m, backend, dtype, nnx.Rngs(k), mlp=not mixed,
                                               **adapters(k)))(keys)
        # each layer's index in the moe and dense stacks (the other kind's: any in range)
        self.mlp_index: tuple[tuple[int, int], ...] = ()
        if not mixed:
            self.moe_mlp = self.dense_mlp = None
        else:
            dense_at = [i for i in range(m.num_layers) if i not in moe_at]
            self.moe_mlp = nnx.vmap(lambda k: MoE(m, dtype, nnx.Rngs(k), backend.mesh))(
                jax.random.split(rngs.params(), len(moe_at)))
            self.dense_mlp = nnx.vmap(lambda k: GatedMLP(m, dtype, nnx.Rngs(k), **adapters(k)))(
                jax.random.split(rngs.params(), len(dense_at)))
            self.mlp_index = tuple(
                (min(sum(j < i for j in moe_at), len(moe_at) - 1),
                 min(sum(j < i for j in dense_at), len(dense_at) - 1))
                for i in range(m.num_layers))
        self.final_norm = norm_from_config(m)
        self.head = None if tied else _param(rngs, (m.d_model, m.vocab_size), ("embed", "vocab"),
                                             m.init_std)
        self.dtype, self.remat, self.scan_layers = dtype, m.remat, m.scan_layers
        self.num_layers = m.num_layers
        # Each layer's window and RoPE (model/pattern.py), static: the scan over the layers
        # switches to each layer's own (over_layers).
        self.kinds = pattern.kinds(m)
        if mixed:  # and its MLP's (LayerKind.mlp): one branch per attention x MLP kind
            self.kinds = tuple(dataclasses.replace(k, mlp="moe" if i in moe_at else "dense")
                               for i, k in enumerate(self.kinds))
        # Gemma: embeddings times sqrt(d_model), the factor cast to the compute dtype first
        self.embed_scale = math.sqrt(m.d_model) if m.get("scale_embeddings", False) else None
        self.softcap = float(m.get("final_logit_softcap", 0.0) or 0.0)  # Gemma: cap * tanh(z / cap)
        self.act_sharding = (jax.sharding.NamedSharding(backend.mesh, jax.sharding.PartitionSpec(
            BATCH_AXES, "sequence", None)) if backend.mesh is not None else None)

    def __call__(self, tokens_BL, positions_BL, segment_ids_BL):
        """Logits [B, L, V] in fp32, in the batch's token layout (generation; training never
        makes them whole: see token_losses)."""
        x_BLD = self.final_norm(self.hidden(tokens_BL, positions_BL, segment_ids_BL))
        return self.cap(jnp.einsum("bld,dv->blv", x_BLD, self.head_DV().astype(self.dtype),
                                   preferred_element_type=jnp.float32))

    def cap(self, logits):
        """Final logit soft-capping (``model.final_logit_softcap``; 0: none)."""
        if not self.softcap:
            return logits
        return jnp.tanh(logits / self.softcap) * self.softcap

    def head_args(self) -> dict:
        """The final norm and head as model/loss.py's chunked_token_losses takes them: a tied
        head as the embedding table [V, D] itself (no transposed copy of it, nor of its
        gradient)."""
        head = {"head_VD": self.embed[...]} if self.head is None else {"head_DV": self.head[...]}
        return dict(norm_scale_D=self.final_norm.weight(), **head, eps=self.final_norm.eps,
                    softcap=self.softcap)

    def token_losses(self, tokens_BL, positions_BL, segment_ids_BL, labels_BL, mask_BL,
                     chunk: int):
        """Masked next-token cross-entropy [B, L] in fp32; the final norm, head and softmax
        run over chunks of ``chunk`` tokens of each device's slice (model/loss.py)."""
        return self.token_losses_routed(tokens_BL, positions_BL, segment_ids_BL, labels_BL,
                                        mask_BL, chunk)[0]

    def token_losses_routed(self, tokens_BL, positions_BL, segment_ids_BL, labels_BL, mask_BL,
                            chunk: int):
        """(``token_losses``, the mixture of experts' router statistics summed over the layers:
        model/moe.py ``router_stats``; None for a dense model)."""
        x_BLD, stats = self.hidden(tokens_BL, positions_BL, segment_ids_BL, routed=True)
        mesh = self.act_sharding.mesh if self.act_sharding is not None else None
        return chunked_token_losses(x_BLD, labels_BL, mask_BL, **self.head_args(), chunk=chunk,
                                    mesh=mesh, compute_dtype=self.dtype), stats

    def head_DV(self):
        """The output projection [D, V]: the embedding table itself when tied."""
        return self.embed[...].T if self.head is None else self.head[...]

    def hidden(self, tokens_BL, positions_BL, segment_ids_BL, keep_kv: bool = False,
               routed: bool = False):
        """The last block's output [B, L, D] (before the final norm), in the batch's layout.
        ``keep_kv``: (output, (k, v)) with every layer's keys and values stacked
        ``[layers, B, L, Hkv, D]`` (a KV cache's prefill, evaluation/kv_cache.py).
        ``routed``: (output, router statistics summed over the layers, or None; the dense layers
        of a model whose layers differ add none)."""
        x_BLD = self.embed_tokens(tokens_BL)

        def enter(x_BLD):
            if self.act_sharding is not None:
                x_BLD = jax.lax.with_sharding_constraint(x_BLD, self.act_sharding)
            # Under remat the layer inputs are what the scan keeps for the backward
            # ([layers, B, L, D]); offload_input moves exactly these to host memory.
            return checkpoint_name(x_BLD, "layer_input")

        def layer(x_BLD, block, index, kind):
            with lora_lib.in_layer(index):  # LoRA's dropout masks differ by layer
                x_BLD, kv, stats = block.attend_routed(x_BLD, positions_BL, segment_ids_BL,
                                                       kind=kind)
            if routed and stats is None and self.moe_mlp is not None:  # a dense layer
                stats = self.no_router_stats(x_BLD, segment_ids_BL)
            return x_BLD, (kv if keep_kv else None, stats if routed else None)

        index = (jnp.arange(self.num_layers, dtype=jnp.int32)
                 if lora_lib.dropping_ids() is not None else None)
        x_BLD, (kv, stats) = self.over_layers(layer, x_BLD, index, enter=enter, remat=self.remat)
        if routed:
            stats = None if stats is None else jax.tree.map(lambda s: s.sum(axis=0), stats)
            return x_BLD, stats
        return (x_BLD, kv) if keep_kv else x_BLD

    def no_router_stats(self, x_BLD, segment_ids_BL):
        """Zeros shaped as a mixture-of-experts layer's router statistics of ``x_BLD``: a dense
        layer's, in a model whose layers differ (the scan's branches give alike outputs)."""
        graphdef, state = nnx.split(self.moe_mlp)
        one = jax.tree.map(lambda t: jax.ShapeDtypeStruct(t.shape[1:], t.dtype), state)
        shapes = jax.eval_shape(lambda s, x, r: nnx.merge(graphdef, s)(x, r)[1], one, x_BLD,
                                segment_ids_BL > 0)
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

    def over_layers(self, layer, x, xs=None, enter=None, remat: str | None = None):
        """``layer(enter(x), block_i, xs_i, kind_i) -> (x, y_i)`` over the layers, in order:
        ``block_i`` is layer i's Block, ``xs`` (or None) an input with a leading layer axis;
        returns (x, the y_i stacked over layers). One scan over every layer with the whole
        stack as its input, read in place a layer at a time: layers all alike run one layer a
        step; a pattern (Gemma 3's 5 sliding : 1 full, or MLPs that differ: some layers a
        mixture of experts) switches each step to its layer's kind (``lax.switch``, one branch
        compiled per kind). A scan over the pattern's periods would take its input as slices
        of the stack and give the gradients back concatenated, copying the whole stack (and
        its gradient) every step wherever the depth is not a whole number of periods
        (Gemma-3-1B: 26 = 4 x 6 + 2). Where the MLPs differ, each step reads its layer's MLP
        from its kind's stack (``moe_mlp``, ``dense_mlp``) at the layer's index, outside the
        switch (in a branch, the read's gradient would leave the switch as a whole stack of
        zeros but one layer, every step); both stacks are read, one used.

        ``remat``: the checkpoint policy's name (``remat_policy``), applied to each layer;
        None: nothing is differentiated (a decode step), no checkpoint."""
        kinds = self.kinds
        enter = enter or (lambda x: x)
        distinct = list(dict.fromkeys(kinds))
        graphdef, stacked = nnx.split(self.blocks)
        groups = (nnx.split(self.moe_mlp), nnx.split(self.dense_mlp)) if self.mlp_index else ()

        def block_of(state_i, mlps_i, kind):
            block = nnx.merge(graphdef, state_i)
            if not groups:
                return block
            g = 0 if kind.mlp == "moe" else 1
            return block.holding(nnx.merge(groups[g][0], mlps_i[g]))

        if len(distinct) == 1 or not self.scan_layers:
            def step(x, a, kind):
                return layer(enter(x), block_of(a[0], a[1], kind), a[2], kind)

            if remat not in (None, "none"):
                step = jax.checkpoint(step, policy=remat_policy(remat), prevent_cse=False,
                                      static_argnums=(2,))
            if self.scan_layers and len(kinds) > 1:
                return jax.lax.scan(lambda x, a: step(x, a, kinds[0]), x, (stacked, None, xs))
            out = []  # unrolled, layer by layer (debugging), or the one layer
            for i in range(len(kinds)):
                mlps = (tuple(jax.tree.map(lambda t, j=j: t[j], state)
                              for (_, state), j in zip(groups, self.mlp_index[i]))
                        if groups else None)
                a = jax.tree.map(lambda t, i=i: t[i], (stacked, xs))
                x, y = step(x, (a[0], mlps, a[1]), kinds[i])
                out.append(jax.tree.map(lambda t: t[None], y))
            return x, jax.tree.map(lambda *t: jnp.concatenate(t), *out)

        branches = [lambda x, a, kind=kind: layer(x, block_of(a[0], a[1], kind), a[2], kind)
                    for kind in distinct]

        def switch(x, a, index):
            state_i, index_i, xs_i = a
            mlps = tuple(
                jax.tree.map(lambda t: checkpoint_name(
                    jax.lax.dynamic_index_in_dim(t, index_i[g], keepdims=False), "layer_mlp"),
                    state)
                for g, (_, state) in enumerate(groups))
            return jax.lax.switch(index, branches, enter(x), (state_i, mlps, xs_i))

        if remat is not None:
            # The checkpoint holds the switch, not each branch: differentiated, a switch keeps
            # what its branches' backward needs as outputs of its own, the layer's weights
            # among them, which the scan would stack into a copy of the whole weight stack; a
            # checkpoint's backward reads its inputs (the scan's slice of the stack) in place.
            # Without remat every intermediate is kept, as with no checkpoint at all, but for
            # the layer's MLP read from its stack (read again).
            policy = (remat_policy(remat) if remat != "none" else
                      jax.checkpoint_policies.save_anything_except_these_names("layer_mlp")
                      if groups else jax.checkpoint_policies.everything_saveable)
            switch = jax.checkpoint(switch, policy=policy, prevent_cse=False)
        ids = jnp.asarray([distinct.index(k) for k in kinds], jnp.int32)
        index = jnp.asarray(self.mlp_index or [()] * len(kinds), jnp.int32)
        return jax.lax.scan(lambda x, a: switch(x, a[1], a[0]), x,
                            (ids, (stacked, index, xs)))

    def next_logits(self, x_BD):
        """fp32 next-token logits [B, V] of last-block outputs [B, D] (generation)."""
        x_BD = self.final_norm(x_BD)
        if self.head is None:  # tied: contract D of the [V, D] table in place (its transpose
            # is a copy of the whole table, as large as the rest of a small model's decode step)
            return self.cap(jnp.einsum("bd,vd->bv", x_BD, self.embed[...].astype(self.dtype),
                                       preferred_element_type=jnp.float32))
        return self.cap(jnp.einsum("bd,dv->bv", x_BD, self.head[...].astype(self.dtype),
                                   preferred_element_type=jnp.float32))

    def embed_tokens(self, tokens_BL):
        """The embedding rows of ``tokens_BL`` [B, L, D] in the compute dtype."""
        embed_VD = self.embed[...]
        if self.act_sharding is not None:
            # Gather the (fsdp x sequence)-sharded table whole first, as FSDP does for every
            # weight: a lookup straight from a table split along D has no efficient
            # partitioning into the batch x length layout and XLA would replicate it anyway.
            embed_VD = jax.lax.with_sharding_constraint(
                embed_VD, jax.sharding.NamedSharding(self.act_sharding.mesh, jax.sharding.PartitionSpec()))
        x_BLD = jnp.take(embed_VD, tokens_BL, axis=0).astype(self.dtype)
        if self.embed_scale is None:
            return x_BLD
        return x_BLD * jnp.asarray(self.embed_scale, jnp.float32).astype(self.dtype)


def backend_from_config(config, mesh=None) -> AttentionBackend:
    from parallel import kernels
    a = config.attention
    from model.flops import head_dim
    kernel = kernels.resolve(a.kernel, kernels.platform_of(mesh),
                             compute_dtype(config.model.dtype), head_dim(config.model))
    block_q, block_kv = kernels.tiles(kernel, a)
    return AttentionBackend(impl=a.impl, layout=a.layout, kernel=kernel, stripe=a.stripe,
                            block_q=block_q, block_kv=block_kv, mesh=mesh,
                            document_mask=bool(a.document_mask), ulysses=int(a.get("ulysses", 1)))


def single_device_model(config):
    """(graphdef, abstract params on device 0) of ``config``'s model, dense and contiguous:
    parameters depend on neither the mesh nor the layout, so a run's checkpoint restores into
    them on one device (scripts/generate.py, the Hugging Face export)."""
    from jax.sharding import SingleDeviceSharding
    abstract = nnx.eval_shape(lambda: Decoder(config.model, AttentionBackend(), nnx.Rngs(0),
                                              lora_lib.spec_of(config)))
    graphdef, params = nnx.split(abstract, nnx.Param)
    on_device = SingleDeviceSharding(jax.devices()[0])
    return graphdef, jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on_device),
        nnx.to_pure_dict(params))


def single_device_params(config):
    """Abstract parameters of ``config``'s model on device 0, to restore a checkpoint into."""
    return single_device_model(config)[1]
