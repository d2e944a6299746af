"""A mixture of experts in the decoder's MLP slot: a router picks ``top_k`` of ``num_experts``
gated MLPs (SwiGLU) for each token, and the token's output is their outputs weighted by the
router (``model.moe``; configs/base.py).

Router scoring, in fp32, as each family scores it (``model.moe.router``):
- ``softmax_topk``: softmax over every expert, then the top k, renormalised to sum 1 or not
  (``model.moe.renormalize``: Mixtral and Qwen3-MoE's ``norm_topk_prob`` yes, OLMoE no);
- ``topk_softmax``: the top k logits, then a softmax over those k (gpt-oss).

Dropless: every token reaches its k experts and the work grows with k, not with the number of
experts. The token-expert pairs are sorted by expert and each expert's group multiplied by its
weights (``grouped_matmul``): ``jax.lax.ragged_dot`` where XLA has a grouped GEMM (GPU, TPU),
and on a CPU a scan over blocks of ``GROUP_BLOCK`` rows, each group padded to whole blocks,
which XLA runs at the matmuls' rate (ragged_dot runs 14x slower there: scripts/bench_moe.py).
A capacity factor (``model.moe.capacity``, 0: none) drops the pairs past an expert's capacity
in the row's order (later pairs first); the drops are counted.

Each layer also returns its router statistics over the step's real tokens (``real_BL``: the
tokens of a document, never padding): per expert, how many of its picks it got and the sum of
its softmax probability; the sum of each token's squared log-sum-exp of the logits (the
router z-loss's); the count of real tokens and of dropped picks; and the picks, probabilities
and real tokens of each row of the batch. The load-balancing loss is a function of these sums
pooled over layers and over the whole batch (model/moe.py ``aux_losses``), or, per sequence
(``model.moe.balance=sequence``), of each layer's rows' totals (``sequence_balance``, each row
summed whole over the devices by ``pool_stats``), so every mesh gives the same number.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from model.flops import expert_dim, moe_layers, num_experts as experts_of  # noqa: F401 (layers, state)
from model.weights import _bias, _param
from model.weights import gate as gate_of

ROUTERS = ("softmax_topk", "topk_softmax")
# dense: every expert on every token (a yardstick). grouped_matmul also takes ragged_shape, the
# planner's stand-in for ragged_dot on CPU devices (its shapes and costs, not its values), which
# planning/program.py sets after validation: never a run's value.
GROUPED = ("auto", "ragged", "blocks", "dense")
DISPATCHES = ("gather", "all_to_all")  # model.moe.dispatch: where the work meets the experts
GROUP_BLOCK = 128  # rows per block of the CPU's grouped matmul


def route(logits_TE, top_k: int, router: str = "softmax_topk", renormalize: bool = True):
    """(weights [T, k], experts [T, k] int32, probabilities [T, E]) of fp32 router logits; the
    probabilities are the softmax over every expert (the load-balancing loss's), whatever the
    scoring."""
    probs_TE = jax.nn.softmax(logits_TE, axis=-1)
    if router == "softmax_topk":
        weights_TK, experts_TK = jax.lax.top_k(probs_TE, top_k)
        if renormalize:
            weights_TK = weights_TK / jnp.sum(weights_TK, axis=-1, keepdims=True)
    elif router == "topk_softmax":
        top_TK, experts_TK = jax.lax.top_k(logits_TE, top_k)
        weights_TK = jax.nn.softmax(top_TK, axis=-1)
    else:
        raise ValueError(f"model.moe.router={router!r} is not one of {', '.join(ROUTERS)}")
    return weights_TK, experts_TK.astype(jnp.int32), probs_TE


def grouped_impl(name: str, platform: str | None = None) -> str:
    """``auto``: ragged_dot on GPU and TPU, blocks on a CPU."""
    if name != "auto":
        return name
    return "blocks" if (platform or jax.default_backend()) == "cpu" else "ragged"


def grouped_matmul(x_ND, w_EDF, sizes_E, impl: str, sparse: bool = False):
    """Row group g of ``x_ND`` (rows sorted by group, ``sizes_E`` rows each) times ``w_EDF[g]``:
    [N, F]; rows past the groups give 0. ``sparse``: most rows may be past the groups (an
    expert-parallel receive buffer, parallel/experts.py), so the blocks scan skips the blocks
    that hold none by a ``lax.cond`` (on a CPU a cond per block more than doubles the scan's
    time when every block is used: scripts/bench_moe.py)."""
    if impl == "ragged":
        return jax.lax.ragged_dot(x_ND, w_EDF, sizes_E.astype(jnp.int32))
    if impl == "ragged_shape":
        # What scripts/plan.py compiles for ragged_dot on CPU devices: XLA:CPU has no ragged
        # dot, and JAX's CPU lowering multiplies every row by every expert (E times a GPU's
        # FLOPs and memory). Each row times one D x F expert, read from the whole stack by an
        # index the compiler cannot know: ragged_dot's shapes, FLOPs and buffers, not its values.
        g = jnp.argmax(sizes_E)
        return x_ND @ jax.lax.dynamic_index_in_dim(w_EDF, g, keepdims=False)
    N, D = x_ND.shape
    E, _, F = w_EDF.shape
    b = GROUP_BLOCK
    blocks = -(-N // b) + E  # each group padded to whole blocks: at most one more block each
    padded_E = (sizes_E + b - 1) // b * b
    # rows past the groups (an expert-parallel receive buffer's rest: parallel/experts.py) go
    # to no block and come out zero
    real_N = jnp.arange(N) < jnp.sum(sizes_E)
    group_N = jnp.repeat(jnp.arange(E, dtype=jnp.int32), sizes_E, total_repeat_length=N)
    first_E = jnp.cumsum(sizes_E) - sizes_E
    slot_N = jnp.where(real_N, (jnp.cumsum(padded_E) - padded_E)[group_N] + jnp.arange(N)
                       - first_E[group_N], blocks * b)
    x_PD = jnp.zeros((blocks * b, D), x_ND.dtype).at[slot_N].set(x_ND, mode="drop")
    block_group = jnp.searchsorted(jnp.cumsum(padded_E), jnp.arange(blocks) * b, side="right")
    block_group = jnp.minimum(block_group, E - 1).astype(jnp.int32)
    used = jnp.sum(padded_E) // b  # the blocks that hold rows; the rest are skipped

    # under remat: the backward would otherwise keep each block's expert weights ([blocks, D,
    # F]: a copy of the stack per block), where it needs only the block's rows and its index
    @jax.checkpoint
    def step(_, a):
        x_bD, g, i = a
        w_DF = lambda: jax.lax.dynamic_index_in_dim(w_EDF, g, keepdims=False)  # noqa: E731
        if not sparse:
            return None, x_bD @ w_DF()
        # zeros typed as the product (varying where the rows or the weights are): a product
        # over nothing
        skip = lambda: x_bD[:, :0] @ w_EDF[0, :0, :]  # noqa: E731
        return None, jax.lax.cond(i < used, lambda: x_bD @ w_DF(), skip)

    _, y = jax.lax.scan(step, None, (x_PD.reshape(blocks, b, D), block_group,
                                     jnp.arange(blocks)))
    return jnp.take(y.reshape(blocks * b, F), slot_N, axis=0, mode="fill", fill_value=0)


GLUS = ("gated", "clamped")  # model.moe.glu


silu_unit = functools.partial(gate_of, "silu")  # unit(gate, up): SwiGLU's


def gated_unit(e, activation: str = "silu"):
    """``unit(gate, up)``: the experts' hidden activations from their gate and up projections
    (``model.moe.glu``). gated: ``activation(gate) * up``. clamped (gpt-oss's): the gate
    clamped above at ``glu_limit`` and up to ``[-glu_limit, glu_limit]``, then ``(up + 1) *
    gate * sigmoid(glu_alpha * gate)``."""
    if e.get("glu", "gated") != "clamped":
        return functools.partial(gate_of, activation)  # act(gate) recomputed backward
    limit, alpha = float(e.glu_limit), float(e.glu_alpha)

    def clamped(gate, up):
        gate = jnp.minimum(gate, limit)
        return (jnp.clip(up, -limit, limit) + 1) * (gate * jax.nn.sigmoid(alpha * gate))
    return clamped


def expert_rows(xs_ND, sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD, biases, grouped,
                unit=silu_unit):
    """The experts' gated MLPs on rows sorted by expert (``sizes_E`` rows each; rows past the
    groups give 0): [N, D]. ``grouped(x, w, sizes)`` is the grouped matmul; ``biases``
    (``b_gate_EF``, ``b_up_EF``, ``b_down_ED``: gpt-oss's) or None, each row taking its
    expert's."""
    gate_NF = grouped(xs_ND, w_gate_EDF, sizes_E)
    up_NF = grouped(xs_ND, w_up_EDF, sizes_E)
    if biases is None:
        return grouped(unit(gate_NF, up_NF), w_down_EFD, sizes_E)
    b_gate_EF, b_up_EF, b_down_ED = biases
    # each row's expert; E (no bias) for the rows past the groups, so they stay 0
    group_N = jnp.searchsorted(jnp.cumsum(sizes_E), jnp.arange(xs_ND.shape[0]), side="right")

    def bias(b_EX, like):
        return jnp.take(b_EX, group_N, axis=0, mode="fill", fill_value=0).astype(like.dtype)

    h_NF = unit(gate_NF + bias(b_gate_EF, gate_NF), up_NF + bias(b_up_EF, up_NF))
    y_ND = grouped(h_NF, w_down_EFD, sizes_E)
    return y_ND + bias(b_down_ED, y_ND)


def experts_forward(x_TD, weights_TK, experts_TK, w_gate_EDF, w_up_EDF, w_down_EFD, *,
                    impl: str = "blocks", capacity: int = 0, biases=None, unit=silu_unit):
    """(output [T, D], dropped picks): each token's k experts' gated MLPs, weighted. The pairs
    run sorted by expert; ``capacity`` > 0 keeps each expert's first ``capacity`` pairs.
    ``unit(gate, up)`` (``gated_unit``) and ``biases`` as ``expert_rows`` takes them."""
    T, K = experts_TK.shape
    E = w_gate_EDF.shape[0]
    if impl == "dense":  # every expert on every token, the unpicked ones weighted 0
        if capacity:
            raise ValueError("model.moe.grouped=dense computes every expert: no capacity")
        gate_TEF = jnp.einsum("td,edf->tef", x_TD, w_gate_EDF)
        up_TEF = jnp.einsum("td,edf->tef", x_TD, w_up_EDF)
        if biases is not None:
            gate_TEF = gate_TEF + biases[0].astype(gate_TEF.dtype)
            up_TEF = up_TEF + biases[1].astype(up_TEF.dtype)
        h_TEF = unit(gate_TEF, up_TEF)
        mix_TE = jnp.einsum("tk,tke->te", weights_TK,
                            jax.nn.one_hot(experts_TK, E, dtype=weights_TK.dtype))
        y_TD = jnp.einsum("tef,efd->td", h_TEF * mix_TE[:, :, None].astype(h_TEF.dtype),
                          w_down_EFD)
        if biases is not None:
            y_TD = y_TD + (mix_TE @ biases[2].astype(mix_TE.dtype)).astype(y_TD.dtype)
        return y_TD, jnp.zeros((), jnp.int32)
    expert_N = experts_TK.reshape(-1)
    order_N = jnp.argsort(expert_N, stable=True)  # by expert, then by token
    sorted_e = expert_N[order_N]
    sizes_E = jnp.bincount(expert_N, length=E).astype(jnp.int32)
    ys_ND = expert_rows(x_TD[order_N // K], sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD, biases,
                        lambda x, w, sizes: grouped_matmul(x, w, sizes, impl), unit)
    weights_N = weights_TK.reshape(-1)[order_N]
    dropped = jnp.zeros((), jnp.int32)
    if capacity:
        rank_N = jnp.arange(T * K) - (jnp.cumsum(sizes_E) - sizes_E)[sorted_e]
        kept_N = rank_N < capacity
        dropped = jnp.sum(~kept_N).astype(jnp.int32)
        weights_N = jnp.where(kept_N, weights_N, 0.0)
    y_ND = jnp.zeros_like(ys_ND).at[order_N].set(ys_ND * weights_N[:, None].astype(ys_ND.dtype))
    return y_ND.reshape(T, K, -1).sum(axis=1), dropped


def router_stats(logits_TE, probs_TE, experts_TK, real, dropped) -> dict:
    """One layer's sums over its real tokens (``real`` 0/1: ``[B, L]``, the batch's rows, or
    ``[T]``, one row): what ``aux_losses`` pools; and per row (``row_picks``, ``row_probs``
    ``[B, E]``, ``row_tokens`` ``[B]``) with the per-sequence balance loss they give
    (``sequence_balance``), exact where the rows are whole (off a mesh; on one, ``pool_stats``
    forms it again from each row's totals over the devices)."""
    E = probs_TE.shape[-1]
    real_BL = real.reshape(-1, real.shape[-1]).astype(jnp.float32)
    B, L = real_BL.shape
    picks_BLE = jax.nn.one_hot(experts_TK, E, dtype=jnp.float32).sum(axis=1).reshape(B, L, E)
    lse_T = jax.nn.logsumexp(logits_TE, axis=-1)
    rows = {"row_picks": jnp.einsum("ble,bl->be", picks_BLE, real_BL),
            "row_probs": jnp.einsum("ble,bl->be", probs_TE.reshape(B, L, E), real_BL),
            "row_tokens": jnp.sum(real_BL, axis=1)}
    return {"picks": rows["row_picks"].sum(axis=0), "probs": rows["row_probs"].sum(axis=0),
            "z": jnp.sum(lse_T * lse_T * real_BL.reshape(-1)), "tokens": jnp.sum(real_BL),
            "dropped": dropped.astype(jnp.float32), **rows, **sequence_balance(rows)}


def sequence_balance(rows: dict) -> dict:
    """The per-sequence balance loss of one layer from its rows' totals (DeepSeek-V3's
    sequence-wise loss at the default's scale): each row with real tokens gives ``E * sum_e f_e
    P_e``, ``f_e`` expert e's picks per real token of the row (summing to k) and ``P_e`` its
    mean probability there; ``seq_loss`` their sum over the rows, ``seq_rows`` those rows."""
    E = rows["row_picks"].shape[-1]
    n_B = jnp.maximum(rows["row_tokens"], 1.0)[:, None]
    per_row = E * jnp.sum((rows["row_picks"] / n_B) * (rows["row_probs"] / n_B), axis=-1)
    return {"seq_loss": jnp.sum(per_row),
            "seq_rows": jnp.sum((rows["row_tokens"] > 0).astype(jnp.float32))}


def pool_stats(stats: dict, token_axes, row_axes) -> dict:
    """Inside a shard_map: one layer's statistics summed over the devices that split its tokens
    (``token_axes``), the per-row ones first placed at this device's rows of the whole batch
    (its index over ``row_axes``, which split the rows; zeros elsewhere), so each row's totals
    come out whole (a row's tokens split over the sequence axis), and the per-sequence loss
    formed from those totals."""
    shards = jax.lax.axis_size(row_axes)
    start = jax.lax.axis_index(row_axes) * stats["row_tokens"].shape[0]

    def place(s):
        whole = jnp.zeros((s.shape[0] * shards, *s.shape[1:]), s.dtype)
        return jax.lax.dynamic_update_slice_in_dim(whole, s, start, axis=0)

    stats = {k: place(v) if k.startswith("row_") else v for k, v in stats.items()
             if not k.startswith("seq_")}
    stats = jax.tree.map(lambda s: jax.lax.psum(s, token_axes), stats)
    return stats | sequence_balance(stats)


def aux_losses(stats: dict, num_experts: int, top_k: int) -> dict:
    """The load-balancing loss (transformers' ``load_balancing_loss_func``: the Switch
    Transformer's loss pooled over layers, padding excluded) and the router z-loss, from router
    statistics summed over layers (and tokens): ``E * sum_e f_e P_e``, ``f_e`` each expert's
    share of the real tokens' picks per token (summing to k), ``P_e`` its mean probability; the
    z-loss the mean squared log-sum-exp. Also the load (the busiest expert's picks over the
    mean), the fraction of picks dropped, and the per-sequence balance loss
    (``seq_aux_loss``: ``sequence_balance``'s mean over the layers and the rows)."""
    n = jnp.maximum(stats["tokens"], 1.0)
    balance = num_experts * jnp.sum((stats["picks"] / n) * (stats["probs"] / n))
    picks = jnp.maximum(jnp.sum(stats["picks"]), 1.0)
    return {"aux_loss": balance, "z_loss": stats["z"] / n,
            "expert_load": jnp.max(stats["picks"]) * num_experts / picks,
            "dropped_fraction": stats["dropped"] / (n * top_k),
            "seq_aux_loss": stats["seq_loss"] / jnp.maximum(stats["seq_rows"], 1.0)}


class MoE(nnx.Module):
    """The MLP slot of a block as a mixture of experts (``model.moe``): ``router`` [D, E]
    (``router_bias`` [E] where the family has one) and the experts' stacked SwiGLU weights
    ``w_gate``, ``w_up`` [E, D, F] and ``w_down`` [E, F, D] (with ``model.moe.expert_bias``,
    gpt-oss's, their biases ``b_gate``, ``b_up`` [E, F] and ``b_down`` [E, D])."""

    def __init__(self, m, dtype, rngs: nnx.Rngs, mesh=None):
        e = m.moe
        E, F, D = experts_of(m), expert_dim(m), m.d_model
        std, out_std = m.init_std, m.init_std / math.sqrt(2 * m.num_layers)
        self.router = _param(rngs, (D, E), ("embed", None), std)
        self.router_bias = _bias((E,), (None,)) if e.get("router_bias", False) else None
        self.w_gate = _param(rngs, (E, D, F), ("experts", "expert_embed", "mlp"), std)
        self.w_up = _param(rngs, (E, D, F), ("experts", "expert_embed", "mlp"), std)
        self.w_down = _param(rngs, (E, F, D), ("experts", "mlp", "expert_embed"), out_std)
        if e.get("expert_bias", False):
            self.b_gate = _bias((E, F), ("experts", "mlp"))
            self.b_up = _bias((E, F), ("experts", "mlp"))
            self.b_down = _bias((E, D), ("experts", "expert_embed"))
        else:
            self.b_gate = self.b_up = self.b_down = None
        self.dtype, self.num_experts, self.top_k = dtype, E, int(e.top_k)
        self.router_kind, self.renormalize = str(e.router), bool(e.renormalize)
        self.unit = gated_unit(e, str(m.get("mlp_activation", "silu")))
        self.impl = grouped_impl(str(e.get("grouped", "auto")))
        self.capacity_factor = float(e.get("capacity", 0.0) or 0.0)
        # gather: the experts come to every device's tokens; all_to_all: the tokens go to
        # their experts' devices (parallel/experts.py)
        self.dispatch = str(e.get("dispatch", "gather"))
        self.receive_buffer = float(e.get("receive_buffer", 0.0) or 0.0)
        self.mesh = mesh

    def __call__(self, x_BLD, real_BL):
        """(output [B, L, D], this layer's router statistics over ``real_BL``'s tokens).

        On a mesh each device routes and runs its own tokens (a ``shard_map`` over the axes
        that split them): its token-expert pairs never leave it, and the experts' weights come
        to it, gathered as FSDP gathers every weight (a sort over the whole batch instead,
        left to the compiler, all-reduces every device's pairs: docs/moe.md). The statistics
        are summed over the devices, so they are the whole batch's."""
        from jax.sharding import PartitionSpec as P
        from model.chunks import TOKEN_AXES, cast_before_gather
        from parallel.mesh import BATCH_AXES, batch_shards, fit_spec, logical_to_spec
        params = [w for w in (self.w_gate, self.w_up, self.w_down, self.b_gate, self.b_up,
                              self.b_down) if w is not None]
        experts = tuple(cast_before_gather(w[...], self.dtype) for w in params)
        router = (self.router[...], None if self.router_bias is None else self.router_bias[...])
        B, L, _ = x_BLD.shape
        mesh = self.mesh
        if mesh is None or B % batch_shards(mesh) or L % mesh.shape["sequence"]:
            return self.local((*router, *experts), x_BLD, real_BL, None)
        # the experts come in as they are stored (split by expert over fsdp x sequence, by
        # width over tensor) and are gathered inside: the gather's backward reduce-scatters
        # their gradients, where a gather before the shard_map would all-reduce them whole.
        # With model.moe.dispatch=all_to_all they stay where they are and the tokens travel.
        stored = [fit_spec(logical_to_spec(w.get_metadata()["axes"]), a.shape, mesh)
                  for w, a in zip(params, experts)]

        def shards(spec):
            return spec[0] if isinstance(spec[0], tuple) else (spec[0],) if spec[0] else ()

        over = shards(stored[0])  # the expert-parallel group: the axes the experts split over
        ep = over if self.dispatch == "all_to_all" and over else None

        def local(router, experts, x_BLD, real_BL):
            router = jax.tree.map(lambda w: jax.lax.pcast(w, TOKEN_AXES, to="varying"), router)
            whole = []
            for w, spec in zip(experts, stored):
                split = shards(spec)
                if split and ep is None:
                    w = jax.lax.all_gather(w, split, axis=0, tiled=True)
                rest = tuple(a for a in TOKEN_AXES if a not in split)
                whole.append(jax.lax.pcast(w, rest, to="varying") if rest else w)
            y_BLD, stats = self.local((*router, *whole), x_BLD, real_BL, "tensor", ep)
            return y_BLD, pool_stats(stats, TOKEN_AXES, BATCH_AXES)

        tokens = P(BATCH_AXES, "sequence")
        router_specs = (P(), None if self.router_bias is None else P())
        return jax.shard_map(local, mesh=mesh,
                             in_specs=(router_specs, tuple(stored), P(*tokens, None), tokens),
                             out_specs=(P(*tokens, None), P()))(router, experts, x_BLD, real_BL)

    def local(self, weights, x_BLD, real_BL, tensor_axis, ep_axes=None):
        """``__call__`` on one device's tokens (or the whole batch's, off a mesh), with
        ``weights`` (router, router bias, w_gate, w_up, w_down and, with expert biases, b_gate,
        b_up, b_down) whole but for the experts' width split over ``tensor_axis`` (its partial
        sums added there) and, with ``ep_axes``, the experts split over those axes, this
        device's share of them (the pairs sent to them by all-to-all: parallel/experts.py). A
        capacity counts this device's pairs."""
        router, bias, w_gate, w_up, w_down, *biases = weights
        biases = tuple(biases) or None
        if biases is not None and tensor_axis is not None:
            # the down bias is added once to the partial sums the tensor devices add up
            first = (jax.lax.axis_index(tensor_axis) == 0).astype(biases[2].dtype)
            biases = (*biases[:2], biases[2] * first)
        B, L, D = x_BLD.shape
        x_TD = x_BLD.reshape(B * L, D)
        logits_TE = jnp.einsum("td,de->te", x_TD.astype(jnp.float32), router)
        if bias is not None:
            logits_TE = logits_TE + bias
        weights_TK, experts_TK, probs_TE = route(logits_TE, self.top_k, self.router_kind,
                                                 self.renormalize)
        capacity = (math.ceil(self.capacity_factor * B * L * self.top_k / self.num_experts)
                    if self.capacity_factor else 0)
        if ep_axes:
            from parallel.experts import exchange_impl, experts_all_to_all
            grouped = lambda x, w, sizes: grouped_matmul(x, w, sizes, self.impl, sparse=True)  # noqa: E731
            y_TD, dropped = experts_all_to_all(
                x_TD, weights_TK, experts_TK, w_gate, w_up, w_down, axis_name=ep_axes,
                num_experts=self.num_experts, grouped=grouped,
                exchange=exchange_impl(self.impl), receive_buffer=self.receive_buffer,
                capacity=capacity,
                rows=lambda xs, sizes: expert_rows(xs, sizes, w_gate, w_up, w_down, biases,
                                                   grouped, self.unit))
        else:
            y_TD, dropped = experts_forward(x_TD, weights_TK, experts_TK, w_gate, w_up, w_down,
                                            impl=self.impl, capacity=capacity, biases=biases,
                                            unit=self.unit)
        if tensor_axis is not None:
            y_TD = jax.lax.psum(y_TD, tensor_axis)  # each tensor device held part of F
        stats = router_stats(logits_TE, probs_TE, experts_TK, real_BL, dropped)
        return y_TD.reshape(B, L, D).astype(x_BLD.dtype), stats


MOE_METRICS = ("aux_loss", "z_loss", "expert_load", "dropped_fraction")
# the load-balancing loss: pooled over the whole batch's tokens (transformers') | per row of
# the batch (DeepSeek-V3's sequence-wise loss): docs/moe.md
BALANCES = ("batch", "sequence")


def real_tokens(segment_ids_BL):
    """The batch's real tokens (in a document: segment id > 0), at least 1: what the router
    statistics of a whole step are over."""
    return jnp.maximum(jnp.sum(segment_ids_BL > 0).astype(jnp.float32), 1.0)


def real_rows(segment_ids_BL):
    """The batch's rows with a real token, at least 1: what the per-sequence balance loss of a
    whole step is a mean over."""
    return jnp.maximum(jnp.sum(jnp.any(segment_ids_BL > 0, axis=1)).astype(jnp.float32), 1.0)


def step_aux(stats: dict, counts: dict, m) -> tuple:
    """(what a (micro)batch adds to the loss, its metrics' shares) from its router statistics
    summed over layers: ``aux_losses`` of the (micro)batch's own statistics, weighted by its
    share of the whole batch's real tokens (``counts["router_tokens"]``). One batch: exactly
    transformers' loss on it. With microbatches: the token-weighted mean of each microbatch's
    loss (the Switch loss is a product of two means, so the whole batch's is not a sum of the
    microbatches'; docs/moe.md); the metrics are the same weighted means.

    ``model.moe.balance=sequence``: the load-balancing loss is the per-sequence one, the sum of
    the (micro)batch's rows' losses over the whole batch's rows with real tokens
    (``counts["router_rows"]``) and the layers: rows are whole within a microbatch, so the
    microbatches' contributions add up to exactly the whole batch's loss."""
    e = m.moe
    layers = len(moe_layers(m))  # the statistics are summed over the MoE layers only
    losses = aux_losses(stats, int(e.num_experts), int(e.top_k))
    share = stats["tokens"] / layers / counts["router_tokens"]
    metrics = {k: share * losses[k] for k in MOE_METRICS}
    if e.get("balance", "batch") == "sequence":
        metrics["aux_loss"] = stats["seq_loss"] / layers / counts["router_rows"]
    extra = float(e.aux_loss) * metrics["aux_loss"] + float(e.z_loss) * metrics["z_loss"]
    return extra, metrics
