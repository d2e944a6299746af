"""Closed-form parameter and FLOP counts from the config (no arrays built).

Attention is counted layer by layer (``model.layer_types``, model/pattern.py): a model whose
sliding layers (Gemma 3's 5 of every 6) see W keys costs less than one whose layers all see
the whole row.

A mixture of experts (``model.moe``, model/moe.py) counts every expert in the parameters
(``param_count``: what the state holds, what the log and the planner print) and only the
token's ``top_k`` experts and the router in the FLOPs (``matmul_params``, ``flops_per_token``:
what MFU divides by); ``active_param_count`` is the parameters a token meets (the "A3B" of
Qwen3-30B-A3B) and ``total_matmul_params`` every matmul weight (what FSDP gathers). Where only
some layers are a mixture of experts (``moe_layers``: ``model.moe.every``, ``dense_layers``,
``first_dense``), the others count the dense MLP of ``model.ffn_dim``."""
from __future__ import annotations

import collections

from model import pattern  # imports no jax


def head_dim(m) -> int:
    return m.head_dim or m.d_model // m.num_heads


def layer_windows(m) -> tuple[int, ...]:
    """Each layer's sliding window (0: full causal attention), as the decoder runs it
    (``model.pattern.kinds``: ``sliding`` layers take ``model.sliding_window``, ``full`` none)."""
    return tuple(k.window for k in pattern.kinds(m))


def window_counts(m) -> dict[int, int]:
    """Layers per window, the full layers (0) first if any: {window: layers}. Every layer that
    shares a window has the same attention cost, so a planner times each window once."""
    counts = collections.Counter(layer_windows(m))
    return dict(sorted(counts.items(), key=lambda kv: (kv[0] != 0, kv[0])))


def _moe(m):
    """``model.moe`` when the MLP slot holds a mixture of experts (num_experts > 0), else None
    (a config from before the field is dense). Read here, not from model/moe.py: no jax."""
    e = m.get("moe", None)
    return e if e is not None and int(e.get("num_experts", 0) or 0) > 0 else None


def num_experts(m) -> int:
    """``model.moe.num_experts`` of model config ``m``: 0 for a dense MLP, or a config from
    before the field (model/moe.py and configs/validate.py read it here)."""
    e = _moe(m)
    return int(e.num_experts) if e is not None else 0


def expert_dim(m) -> int:
    """Each expert's hidden width (``model.moe.expert_dim``; 0: ``model.ffn_dim``)."""
    e = _moe(m)
    return int(e.get("expert_dim", 0) or m.ffn_dim) if e is not None else m.ffn_dim


def dense_layer_list(m) -> tuple[int, ...]:
    """``model.moe.dense_layers`` as layer indices: a comma list ("0,3") or a list of ints
    (configs/validate.py says what is wrong with one that is neither)."""
    e = m.get("moe", None)
    given = e.get("dense_layers", "") if e is not None else ""
    parts = given.split(",") if isinstance(given, str) else list(given or ())
    return tuple(int(p) for p in parts if str(p).strip())


def moe_layers(m) -> tuple[int, ...]:
    """The layers whose MLP slot is a mixture of experts, in order: layer i unless it is one
    of the first ``model.moe.first_dense``, or (i + 1) is not a multiple of ``model.moe.every``
    (Qwen2/3-MoE's ``decoder_sparse_step``), or it is listed in ``model.moe.dense_layers``
    (Qwen3-MoE's ``mlp_only_layers``); the others hold the dense MLP (``model.ffn_dim``). ()
    for a dense model (num_experts 0)."""
    e = _moe(m)
    if e is None:
        return ()
    every, first = int(e.get("every", 1) or 1), int(e.get("first_dense", 0) or 0)
    dense = set(dense_layer_list(m))
    return tuple(i for i in range(int(m.num_layers))
                 if i >= first and (i + 1) % every == 0 and i not in dense)


def experts(m) -> tuple[int, int]:
    """(experts a token uses, experts a layer holds): (1, 1) for a dense MLP."""
    e = _moe(m)
    return (int(e.top_k), int(e.num_experts)) if e is not None else (1, 1)


def _attention_matmul(m) -> int:
    return m.d_model * head_dim(m) * (2 * m.num_heads + 2 * m.num_kv_heads)  # wq, wo, wk, wv


def _mlp_matmul(m, active: bool) -> int:
    """A mixture-of-experts layer's MLP matmul weights (``moe_layers``), a dense model's
    layer's: a dense SwiGLU's 3 D F; a mixture of experts' router D E and its experts' 3 D F
    each, every expert (``active=False``) or a token's top k."""
    if _moe(m) is None:
        return _dense_mlp(m)
    k, n = experts(m)
    return m.d_model * n + (k if active else n) * 3 * m.d_model * expert_dim(m)


def _dense_mlp(m) -> int:
    return 3 * m.d_model * m.ffn_dim  # w_gate, w_up, w_down


def _mlps_matmul(m, active: bool) -> int:
    """Every layer's MLP matmul weights: ``_mlp_matmul`` on the mixture-of-experts layers, the
    dense MLP's on the others."""
    if _moe(m) is None:
        return m.num_layers * _dense_mlp(m)
    n = len(moe_layers(m))
    return n * _mlp_matmul(m, active) + (m.num_layers - n) * _dense_mlp(m)


def _moe_biases(m) -> int:
    """Bias entries per mixture-of-experts layer: the router's [E] and gpt-oss's experts'
    (gate and up [E, F], down [E, D])."""
    e = _moe(m)
    if e is None:
        return 0
    n = int(e.num_experts)
    return (n if e.get("router_bias", False) else 0) + (
        n * (2 * expert_dim(m) + m.d_model) if e.get("expert_bias", False) else 0)


def param_count(m) -> int:
    """Exact parameter count of model.Decoder for model config ``m`` (every expert counted)."""
    attn = _attention_matmul(m) + _qkv_biases(m)
    mlp = _mlps_matmul(m, active=False) + len(moe_layers(m)) * _moe_biases(m)
    embed_and_head = (1 if _tied(m) else 2) * m.vocab_size * m.d_model
    return (m.num_layers * (attn + _layer_norms(m)) + mlp + embed_and_head
            + m.d_model)  # + final norm


def active_param_count(m) -> int:
    """Parameters one token's forward reads: ``param_count`` less the experts the router did
    not pick (each mixture-of-experts layer's ``num_experts - top_k``); a dense model's whole
    count."""
    k, n = experts(m)
    e = _moe(m)
    per_expert = 3 * m.d_model * expert_dim(m) + (
        2 * expert_dim(m) + m.d_model if e is not None and e.get("expert_bias", False) else 0)
    return param_count(m) - len(moe_layers(m)) * (n - k) * per_expert


def _layer_norms(m) -> int:
    """Norm weights per layer: the two pre-norms (d_model each), Gemma's two sandwich post-norms
    (``model.sandwich_norms``) and the q and k norms (``model.qk_norm``): over a head's dims,
    or over the whole q and k projections (``model.qk_norm_scope=projection``, OLMoE)."""
    norms = 2 * m.d_model
    if m.get("sandwich_norms", False):
        norms += 2 * m.d_model
    if m.get("qk_norm", False):
        whole = str(m.get("qk_norm_scope", "head")) == "projection"
        norms += head_dim(m) * ((m.num_heads + m.num_kv_heads) if whole else 2)
    return norms


def _qkv_biases(m) -> int:
    """Bias-like entries per attention layer: bq, bk, bv (model.qkv_bias), bo
    (model.o_bias) and the sinks' logit per query head (model.attention_sinks)."""
    return ((head_dim(m) * (m.num_heads + 2 * m.num_kv_heads) if m.get("qkv_bias", False) else 0)
            + (m.d_model if m.get("o_bias", False) else 0)
            + (m.num_heads if m.get("attention_sinks", False) else 0))


def _tied(m) -> bool:
    return bool(m.get("tie_embeddings", False))


def matmul_params(m) -> int:
    """Parameters that take part in a matmul per token (everything but norms, biases and the
    embedding lookup; a tied table counts once, as the head): with a mixture of experts the
    router and the token's ``top_k`` experts, not the others. 6x this is the matmuls' FLOPs."""
    return (m.num_layers * _attention_matmul(m) + _mlps_matmul(m, active=True)
            + m.vocab_size * m.d_model)


def total_matmul_params(m) -> int:
    """Every matmul weight, each expert's included (what FSDP gathers); ``matmul_params`` for a
    dense model."""
    return (m.num_layers * _attention_matmul(m) + _mlps_matmul(m, active=False)
            + m.vocab_size * m.d_model)


def mlp_matmul_params(m) -> int:
    """A layer's MLP matmul parameters per token (a mixture of experts: router and top k; where
    only some layers are, a mixture-of-experts layer's)."""
    return _mlp_matmul(m, active=True)


def attention_keys(seq_len: int, window: int = 0, causal: bool = True) -> float:
    """Keys a query sees on average: L/2 causal (L without the mask); a sliding window W < L
    leaves each query min(p + 1, W) keys, W - W^2 / 2L on average (L/2 again at W = L)."""
    if not causal:
        return float(seq_len)
    if 0 < window < seq_len:
        return window - window * window / (2 * seq_len)
    return seq_len / 2


def attention_flops_per_token(m, seq_len: int, causal: bool = True, window=None) -> float:
    """Training FLOPs per token of QK^T and PV: fwd 4*L*Hq*hd per layer, x3 for fwd+bwd.

    The causal mask halves the useful work (counted as L/2 keys per query on average). Each
    layer counts its own window (``window=None``: ``model.layer_types`` / ``sliding_window``,
    so a 5:1 sliding:full model sums 5 banded layers and one whole triangle); ``window=W``
    gives every layer the window W (0: every layer full)."""
    windows = layer_windows(m) if window is None else (int(window),) * m.num_layers
    keys = sum(attention_keys(seq_len, w, causal) for w in windows)
    return 3 * 4 * keys * m.num_heads * head_dim(m)


def flops_per_token(m, seq_len: int, causal: bool = True, window=None) -> float:
    """Model FLOPs per trained token: 6 N (matmul params: a mixture of experts' router and
    top k experts only) plus attention, with the causal half (and each layer's sliding window)."""
    return 6 * matmul_params(m) + attention_flops_per_token(m, seq_len, causal, window)
