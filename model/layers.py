"""Decoder building blocks: RMSNorm, RoPE from explicit position ids, GQA attention, the gated
MLP (SwiGLU or GeGLU).

Parameters are fp32 ``nnx.Param``s carrying logical ``axes`` (see parallel/mesh.py RULES);
compute runs in ``dtype``. Activations are [B, L, ...] in whatever token layout the batch uses.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from model import lora as lora_lib
from model.moe import MoE, experts_of
from model.pattern import LayerKind
from model.rope import Rope
from model.weights import _bias, _param  # noqa: F401 (decoder.py's _param)
from model.weights import gate as _gate




def matmul_rows(x, w, k: int = 1, preferred_element_type=None, w_transposed: bool = False,
                merge: bool = True):
    """``x``'s last ``k`` axes contracted with ``w``'s first ``k`` (an einsum such as
    ``bld,dhk->blhk``), as one 2-D matmul over x's other axes merged into rows (the reshapes are
    bitcasts). The weight's gradient then contracts one axis of tokens. Contracting batch and
    length as two axes, XLA's CPU dot first copies the output's gradient transposed: SmolLM2's
    MLP gradients ``[1,536, 2,048]`` and its head's ``[49,152, 2,048]`` logits' gradient, about
    a sixth of its 2,048-token step (scripts/bench_step.py).

    Only where ``x`` is whole on each device: inside a shard_map, or on one device. Over a
    mesh, merging the batch axis (split over data/fsdp) with the length (split over sequence)
    makes the partitioner gather the sequence first (the temporaries of tests/test_plan.py's
    test_doubling_sequence_axis_halves_activation_memory doubled).

    ``w_transposed``: ``w`` holds its contracted axes last (``[out..., in...]``, as a tied
    embedding table ``[V, D]`` is the head's), read as it is: its gradient comes out in its own
    layout, no transposed copy of the table each way. ``merge`` False (x split over a mesh,
    ``one_device``): the same contraction with x's axes kept (``jnp.tensordot``)."""
    if not merge:
        return jnp.tensordot(x, w, axes=(tuple(range(x.ndim - k, x.ndim)),
                                         tuple(range(w.ndim - k, w.ndim)) if w_transposed
                                         else tuple(range(k))),
                             preferred_element_type=preferred_element_type)
    lead, inner = x.shape[:x.ndim - k], x.shape[x.ndim - k:]
    out = w.shape[:w.ndim - k] if w_transposed else w.shape[k:]
    # The weight is contracted as it is, never reshaped: inside the scan over layers its slice
    # of the stack is then what the backward keeps, and JAX reads it from the stack again rather
    # than saving a reshaped copy of every layer's weight (XLA makes the dot 2-D by bitcasts).
    w_axes = tuple(range(w.ndim - k, w.ndim)) if w_transposed else tuple(range(k))
    y = jax.lax.dot_general(x.reshape(math.prod(lead), *inner), w,
                            ((tuple(range(1, k + 1)), w_axes), ((), ())),
                            preferred_element_type=preferred_element_type)
    return y.reshape(lead + out)


def one_device(mesh) -> bool:
    """Nothing is split: no mesh, or a mesh of one device (where ``matmul_rows`` may merge
    the batch and length axes of a whole array)."""
    return mesh is None or mesh.size == 1


class RMSNorm(nnx.Module):
    """``unit_offset`` (Gemma): the scale is 1 + w, w stored and initialised at 0."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False):
        init = jnp.zeros if unit_offset else jnp.ones
        self.scale = nnx.Param(init((dim,), jnp.float32), axes=("norm",))
        self.eps, self.unit_offset = eps, unit_offset

    def __call__(self, x):
        return rms_norm(x, self.weight(), self.eps)

    def weight(self):
        """The fp32 scale the normalised input is multiplied by."""
        return 1.0 + self.scale[...] if self.unit_offset else self.scale[...]


def norm_from_config(m, dim: int | None = None) -> RMSNorm:
    """An RMSNorm of model config ``m`` over ``dim`` (default d_model)."""
    return RMSNorm(dim or m.d_model, m.norm_eps, bool(m.get("norm_unit_offset", False)))


def rms_norm(x, scale, eps: float):
    with jax.named_scope("rms_norm"):  # training/profile.py's row
        x32 = x.astype(jnp.promote_types(x.dtype, jnp.float32))
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
        return (y * scale).astype(x.dtype)


def rope(x_BLHD, positions_BL, theta):
    """Rotary embedding of the given true positions (never the array index: layouts permute).
    ``theta``: the base, or a model.rope.Rope with its context-extension scaling."""
    spec = theta if isinstance(theta, Rope) else Rope(theta=float(theta))
    return spec(x_BLHD, positions_BL)


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    """Which attention kernel runs and over which mesh; static (hashable) model metadata."""
    impl: str = "dense"  # dense | ring | allgather | ulysses | usp
    layout: str = "contiguous"
    kernel: str = "xla"  # resolved per-round kernel: xla | pallas_gpu | pallas_tpu | cudnn
    stripe: int = 1
    block_q: int | None = None  # tiles in positions; None: the kernel's default
    block_kv: int | None = None
    mesh: Mesh | None = None
    document_mask: bool = True  # False: segment ids are ignored (causal over the whole row)
    ulysses: int = 1  # usp: devices per all-to-all group (the ring spans sequence / ulysses)

    def natural_index(self, seq_len: int):
        """True token index of each slot in layout order: the attention mask's positions."""
        from parallel.layouts import permutation
        shards = self.mesh.shape["sequence"] if self.mesh is not None else 1
        return jnp.asarray(permutation(self.layout, seq_len, shards, self.stripe))

    def __call__(self, q_BLHD, k_BLKD, v_BLKD, segment_ids_BL, window=0, sinks_H=None):
        """``window``: the model's sliding window W (0: full causal attention); ``sinks_H``:
        attention sinks, a logit per query head (None: none)."""
        if not self.document_mask:
            segment_ids_BL = None
        if self.impl != "dense" or self._fused_dense():
            from parallel.attention import context_parallel_attention
            return context_parallel_attention(
                q_BLHD, k_BLKD, v_BLKD, mesh=self.mesh or _single_device_mesh(),
                layout=self.layout, positions=None, segment_ids=segment_ids_BL,
                stripe=self.stripe, block_q=self.block_q, block_kv=self.block_kv,
                kernel=self.kernel, impl="ring" if self.impl == "dense" else self.impl,
                ulysses=self.ulysses, window=window, sinks=sinks_H)
        from parallel.kernels.xla import dense_attention
        B, L = q_BLHD.shape[:2]
        index_BL = jnp.broadcast_to(self.natural_index(L), (B, L))
        return dense_attention(q_BLHD, k_BLKD, v_BLKD, positions=index_BL,
                               segment_ids=segment_ids_BL, window=window, sinks=sinks_H)


    def _fused_dense(self) -> bool:
        """Dense attention through the fused kernel (a ring of one) where one is chosen, so
        that dense and ring compare fairly on a GPU; XLA's dense attention otherwise."""
        return (self.impl == "dense" and self.kernel != "xla"
                and (self.mesh is None or self.mesh.shape.get("sequence", 1) == 1))


@functools.cache
def _single_device_mesh():
    return jax.make_mesh((1,), ("sequence",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:1])


class Attention(nnx.Module):
    def __init__(self, m, backend: AttentionBackend, dtype, rngs: nnx.Rngs,
                 lora: lora_lib.Spec | None = None, lora_rngs: nnx.Rngs | None = None):
        """``lora``: the adapters of ``train.lora`` (model/lora.py) on the projections it
        targets, drawn from ``lora_rngs``."""
        d, hd = m.d_model, m.head_dim or m.d_model // m.num_heads
        std, out_std = m.init_std, m.init_std / math.sqrt(2 * m.num_layers)
        self.wq = _param(rngs, (d, m.num_heads, hd), ("embed", "heads", "head_dim"), std)
        self.wk = _param(rngs, (d, m.num_kv_heads, hd), ("embed", "kv_heads", "head_dim"), std)
        self.wv = _param(rngs, (d, m.num_kv_heads, hd), ("embed", "kv_heads", "head_dim"), std)
        self.wo = _param(rngs, (m.num_heads, hd, d), ("heads", "head_dim", "embed"), out_std)
        # Qwen2's biases on q, k and v (none on o), split over heads as their projections are.
        if m.get("qkv_bias", False):
            self.bq = _bias((m.num_heads, hd), ("heads", "head_dim"))
            self.bk = _bias((m.num_kv_heads, hd), ("kv_heads", "head_dim"))
            self.bv = _bias((m.num_kv_heads, hd), ("kv_heads", "head_dim"))
        else:
            self.bq = self.bk = self.bv = None
        # gpt-oss's bias on the output projection (its attention_bias: q, k, v and o)
        self.bo = _bias((d,), ("embed",)) if m.get("o_bias", False) else None
        # Qwen3 / Gemma 3: an RMSNorm over each head's dims, one weight for all heads, before
        # RoPE; OLMoE's (model.qk_norm_scope=projection): one over the whole q (and k)
        # projection, all heads' dims together, a weight each
        self.qk_whole = str(m.get("qk_norm_scope", "head")) == "projection"
        if m.get("qk_norm", False):
            q_dim, k_dim = (m.num_heads * hd, m.num_kv_heads * hd) if self.qk_whole else (hd, hd)
            self.q_norm, self.k_norm = norm_from_config(m, q_dim), norm_from_config(m, k_dim)
        else:
            self.q_norm = self.k_norm = None
        # gpt-oss: a logit per query head in every row's softmax (parallel/attention.py sinks)
        self.sinks = (_param(rngs, (m.num_heads,), ("heads",), std)
                      if m.get("attention_sinks", False) else None)
        # Gemma's softmax scale is query_pre_attn_scalar ** -0.5, not head_dim ** -0.5: the
        # kernels keep theirs and the queries carry the ratio.
        scalar = float(m.get("query_pre_attn_scalar", 0.0) or 0.0)
        self.q_scale = math.sqrt(hd / scalar) if scalar and scalar != hd else None
        # No window or RoPE here: each call names its layer's kind (model/pattern.py), so a
        # caller cannot run a Gemma layer under the model's one window and global RoPE.
        self.backend, self.dtype = backend, dtype
        # each adapter's (input shape, its axes, output shape, its axes): its projection's
        embed, q = ((d,), ("embed",)), ((m.num_heads, hd), ("heads", "head_dim"))
        kv = ((m.num_kv_heads, hd), ("kv_heads", "head_dim"))
        shapes = {"wq": (*embed, *q), "wk": (*embed, *kv), "wv": (*embed, *kv), "wo": (*q, *embed)}
        for weight, name in (("wq", "lora_q"), ("wk", "lora_k"), ("wv", "lora_v"),
                             ("wo", "lora_o")):
            if lora is not None and lora.adapts(weight):
                setattr(self, name, lora_lib.Adapter(lora_rngs, *shapes[weight], lora,
                                                     lora_lib.salt(name)))

    def _project(self, x_BLD, w_DHK, b_HK, adapter=None, x_ND=None):
        """``x_ND``: ``x_BLD``'s tokens as rows (one device), made once for q, k and v: the
        backward then keeps one copy of the input for the three weight gradients, not three."""
        w = w_DHK[...].astype(self.dtype)
        y_BLHK = matmul_rows(x_BLD if x_ND is None else x_ND, w,
                             merge=one_device(self.backend.mesh)
                             ).reshape(*x_BLD.shape[:-1], *w.shape[1:])
        if adapter is not None:
            y_BLHK = y_BLHK + adapter(x_BLD, self.dtype)
        return y_BLHK if b_HK is None else y_BLHK + b_HK[...].astype(self.dtype)

    def __call__(self, x_BLD, positions_BL, segment_ids_BL, *, kind: LayerKind):
        return self.attend(x_BLD, positions_BL, segment_ids_BL, kind=kind)[0]

    def attend(self, x_BLD, positions_BL, segment_ids_BL, attention=None, *, kind: LayerKind):
        """(output [B, L, D], (k_BLKD, v_BLKD)): the keys and values a KV cache keeps.
        ``attention(q, k, v, sinks)``, when given, replaces the backend (a decode step's cache;
        ``sinks``: the layer's attention sinks ``[Hq]`` or None).
        ``kind``: this layer's window and RoPE (``model.pattern.kinds``)."""
        q_BLHD, k_BLKD, v_BLKD = self.qkv(x_BLD, positions_BL, kind.rope)
        sinks_H = None if self.sinks is None else self.sinks[...]
        if attention is None:
            o_BLHD = self.backend(q_BLHD, k_BLKD, v_BLKD, segment_ids_BL, kind.window, sinks_H)
        else:
            o_BLHD = attention(q_BLHD, k_BLKD, v_BLKD, sinks_H)
        out_BLD = matmul_rows(o_BLHD.astype(self.dtype), self.wo[...].astype(self.dtype), 2,
                              merge=one_device(self.backend.mesh))
        if (adapter := lora_lib.adapter(self, "lora_o")) is not None:
            out_BLD = out_BLD + adapter(o_BLHD.astype(self.dtype), self.dtype)
        if self.bo is not None:
            out_BLD = out_BLD + self.bo[...].astype(self.dtype)
        return out_BLD, (k_BLKD, v_BLKD)

    def qkv(self, x_BLD, positions_BL, rope: Rope | None):
        """Queries, keys (both rotated to their positions by ``rope``; None: a NoPE layer)
        and values."""
        ad = functools.partial(lora_lib.adapter, self)
        x_ND = x_BLD.reshape(-1, x_BLD.shape[-1]) if one_device(self.backend.mesh) else None
        project = functools.partial(self._project, x_ND=x_ND)
        q_BLHD = project(x_BLD, self.wq, self.bq, ad("lora_q"))  # bias before norm, RoPE
        k_BLKD = project(x_BLD, self.wk, self.bk, ad("lora_k"))
        if self.q_norm is not None and self.qk_whole:
            q_BLHD = self.q_norm(q_BLHD.reshape(*q_BLHD.shape[:2], -1)).reshape(q_BLHD.shape)
            k_BLKD = self.k_norm(k_BLKD.reshape(*k_BLKD.shape[:2], -1)).reshape(k_BLKD.shape)
        elif self.q_norm is not None:
            q_BLHD, k_BLKD = self.q_norm(q_BLHD), self.k_norm(k_BLKD)
        if rope is not None:
            q_BLHD, k_BLKD = rope(q_BLHD, positions_BL), rope(k_BLKD, positions_BL)
        if self.q_scale is not None:
            q_BLHD = q_BLHD * jnp.asarray(self.q_scale, q_BLHD.dtype)
        return q_BLHD, k_BLKD, project(x_BLD, self.wv, self.bv, ad("lora_v"))


class GatedMLP(nnx.Module):
    """The gated MLP: down(act(gate(x)) * up(x)); ``model.mlp_activation`` picks act (silu:
    SwiGLU; gelu_tanh: Gemma's GeGLU). A block holds it as ``mlp``: its weights' paths
    (blocks/mlp/w_gate, w_up, w_down) are what checkpoints keep."""

    def __init__(self, m, dtype, rngs: nnx.Rngs, lora: lora_lib.Spec | None = None,
                 lora_rngs: nnx.Rngs | None = None):
        std, out_std = m.init_std, m.init_std / math.sqrt(2 * m.num_layers)
        self.w_gate = _param(rngs, (m.d_model, m.ffn_dim), ("embed", "mlp"), std)
        self.w_up = _param(rngs, (m.d_model, m.ffn_dim), ("embed", "mlp"), std)
        self.w_down = _param(rngs, (m.ffn_dim, m.d_model), ("mlp", "embed"), out_std)
        self.dtype, self.activation = dtype, str(m.get("mlp_activation", "silu"))
        into, out_of = ((m.d_model,), ("embed",)), ((m.ffn_dim,), ("mlp",))
        for weight, name, shapes in (("w_gate", "lora_gate", (*into, *out_of)),
                                     ("w_up", "lora_up", (*into, *out_of)),
                                     ("w_down", "lora_down", (*out_of, *into))):
            if lora is not None and lora.adapts(weight):
                setattr(self, name, lora_lib.Adapter(lora_rngs, *shapes, lora,
                                                     lora_lib.salt(name)))

    def __call__(self, x_BLD, rows: bool = False):
        """``rows``: x is whole on this device (``matmul_rows``)."""
        c = lambda p: p[...].astype(self.dtype)
        return gated_mlp(x_BLD, c(self.w_gate), c(self.w_up), c(self.w_down), self.activation,
                         self.adapters(c), rows=rows)

    def adapters(self, cast) -> tuple | None:
        """((a, b) of the gate's, the up's and the down's adapter, each None where it has
        none; the scale; the dropout rate), ``cast`` applied to each weight; None without
        adapters."""
        pairs = [lora_lib.adapter(self, n) for n in MLP_ADAPTERS]
        if not any(p is not None for p in pairs):
            return None
        first = next(p for p in pairs if p is not None)
        return (tuple(None if p is None else (cast(p.a), cast(p.b)) for p in pairs),
                first.scale, first.rate)


MLP_ADAPTERS = ("lora_gate", "lora_up", "lora_down")


def gated_mlp(x_BLD, w_gate_DF, w_up_DF, w_down_FD, activation: str = "silu", adapters=None,
              ids=None, offset=None, rows: bool = False):
    """``adapters``: ``GatedMLP.adapters``' (pairs, scale, dropout rate), or None. ``ids``,
    ``offset``: a chunk's tokens and its first hidden feature (the tensor shard's), for the
    adapters' dropout (model/lora.py ``dropout``). ``rows``: x is whole on this device (a
    shard_map's block, or one device), so the matmuls run on its tokens as rows
    (``matmul_rows``)."""
    mm = functools.partial(matmul_rows, merge=rows)
    if adapters is None:
        # With rows, the tokens as rows once for both projections: the backward then keeps one
        # copy of the input, and the gate, up and product as [tokens, ffn] (not also as
        # [B, L, ffn]).
        x = x_BLD.reshape(-1, x_BLD.shape[-1]) if rows else x_BLD
        h = _gate(activation, mm(x, w_gate_DF), mm(x, w_up_DF))
        return mm(h, w_down_FD).reshape(*x_BLD.shape[:-1], w_down_FD.shape[-1])
    (gate, up, down), scale, rate = adapters

    def project(x, w, pair, name, offset=None):
        y = mm(x, w)
        if pair is None:
            return y
        x = lora_lib.dropout(x, rate, lora_lib.salt(name), 1, ids, offset)
        return y + lora_lib.delta(x, *pair, scale)

    h = _gate(activation, project(x_BLD, w_gate_DF, gate, "lora_gate"),
              project(x_BLD, w_up_DF, up, "lora_up"))
    return project(h, w_down_FD, down, "lora_down", offset)


class Block(nnx.Module):
    """Pre-norm decoder block: x + attn(norm(x)), then x + mlp(norm(x)). With
    ``model.sandwich_norms`` (Gemma) each branch's output is normed too before it is added:
    x + norm(attn(norm(x))), then x + norm(mlp(norm(x)))."""

    def __init__(self, m, backend: AttentionBackend, dtype, rngs: nnx.Rngs, mlp: bool = True,
                 lora: lora_lib.Spec | None = None, lora_rngs: nnx.Rngs | None = None):
        """``mlp`` False: the MLP slot is left empty, its weights held apart (a model whose
        layers' MLPs differ: model/decoder.py) and given to the layer's block by ``holding``.
        ``lora``: adapters on the projections it targets (model/lora.py), from ``lora_rngs``."""
        self.attn_norm = norm_from_config(m)
        self.attn = Attention(m, backend, dtype, rngs, lora, lora_rngs)
        self.mlp_norm = norm_from_config(m)
        # the MLP slot holds a mixture of experts (model/moe.py)
        self.moe = mlp and experts_of(m) > 0
        self.mlp = (None if not mlp else MoE(m, dtype, rngs, backend.mesh) if self.moe
                    else GatedMLP(m, dtype, rngs, lora, lora_rngs))
        if m.get("sandwich_norms", False):
            self.attn_post_norm, self.mlp_post_norm = norm_from_config(m), norm_from_config(m)
        else:
            self.attn_post_norm = self.mlp_post_norm = None
        self.mlp_chunk, self.mesh = m.mlp_chunk, backend.mesh

    def holding(self, mlp: MoE | GatedMLP) -> "Block":
        """This block with ``mlp`` (a layer's own, of the decoder's stacks) in its MLP slot."""
        self.mlp, self.moe = nnx.data(mlp), isinstance(mlp, MoE)
        return self

    def __call__(self, x_BLD, positions_BL, segment_ids_BL, *, kind: LayerKind):
        return self.attend(x_BLD, positions_BL, segment_ids_BL, kind=kind)[0]

    def attend(self, x_BLD, positions_BL, segment_ids_BL, attention=None, *, kind: LayerKind):
        """(output, (k, v)): the block, and the keys and values its attention saw
        (``Attention.attend``; ``kind``: the layer's window and RoPE)."""
        out_BLD, kv, _ = self.attend_routed(x_BLD, positions_BL, segment_ids_BL, attention,
                                            kind=kind)
        return out_BLD, kv

    def attend_routed(self, x_BLD, positions_BL, segment_ids_BL, attention=None, *,
                      kind: LayerKind):
        """(output, (k, v), router statistics): ``attend``, and a mixture of experts' router
        statistics over the real tokens (those in a document: segment id > 0; model/moe.py
        ``router_stats``), None for a dense MLP."""
        y_BLD, kv = self.attn.attend(self.attn_norm(x_BLD), positions_BL, segment_ids_BL,
                                     attention, kind=kind)
        if self.attn_post_norm is not None:
            y_BLD = self.attn_post_norm(y_BLD)
        x_BLD = x_BLD + y_BLD
        if self.moe:
            post = self.mlp_post_norm if self.mlp_post_norm is not None else (lambda y: y)
            real_BL = (segment_ids_BL > 0 if segment_ids_BL is not None else  # a decode step
                       jnp.ones(x_BLD.shape[:2], bool))
            z_BLD, stats = self.mlp(self.mlp_norm(x_BLD), real_BL)
            return x_BLD + post(z_BLD), kv, stats
        # a decode step's one token is not split over the sequence axis: the MLP runs whole
        return self.feed_forward(x_BLD, chunked=attention is None), kv, None

    def feed_forward(self, x_BLD, chunked: bool = True):
        post = self.mlp_post_norm if self.mlp_post_norm is not None else (lambda y: y)
        if not (self.mlp_chunk and chunked):
            rows = {"rows": one_device(self.mesh)} if isinstance(self.mlp, GatedMLP) else {}
            return x_BLD + post(self.mlp(self.mlp_norm(x_BLD), **rows))
        # At long context the MLP's [tokens, ffn_dim] activations are the layer's largest:
        # run it over chunks of each device's tokens under remat (it is per token).
        from model.chunks import cast_before_gather, map_chunks
        P = jax.sharding.PartitionSpec
        eps, dtype, act = self.mlp_norm.eps, self.mlp.dtype, self.mlp.activation
        c = lambda p: cast_before_gather(p[...], dtype)
        weights = (self.mlp_norm.weight(), c(self.mlp.w_gate), c(self.mlp.w_up), c(self.mlp.w_down))
        specs = (P(), P(None, "tensor"), P(None, "tensor"), P("tensor", None))
        adapters = self.mlp.adapters(c)
        if adapters is not None:  # A along its input's split, B along its output's
            pairs, lora_scale, rate = adapters
            weights += (pairs,)
            specs += (tuple(None if p is None else s for p, s in zip(pairs, (
                (P(), P(None, "tensor")), (P(), P(None, "tensor")), (P("tensor", None), P())))),)
        # the adapters' dropout, in a train step: each chunk's tokens' ids go with it
        ids_BL = lora_lib.dropping_ids() if adapters is not None and rate else None
        arrays = (x_BLD,) if ids_BL is None else (x_BLD, ids_BL)

        def mlp(w, x_BcD, *ids, axis):
            scale, w_gate, w_up, w_down = w[:4]
            ad = None if adapters is None else (w[4], lora_scale, rate)
            # this shard's first hidden feature: the down adapter's input is split over tensor
            offset = (jax.lax.axis_index(axis) * w_down.shape[0]) if axis and ids else None
            y_BcD = gated_mlp(rms_norm(x_BcD, scale, eps), w_gate, w_up, w_down, act, ad,
                              ids[0] if ids else None, offset, rows=True)
            return jax.lax.psum(y_BcD, axis) if axis else y_BcD  # partial over ffn_dim / tensor

        # the post-norm needs the whole of D after the psum: it runs outside the chunks
        return x_BLD + post(map_chunks(mlp, weights, specs, arrays, self.mlp_chunk, self.mesh,
                                       out_rank=3))
