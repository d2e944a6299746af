"""Closed-form parameter and FLOP counts from the config (no arrays built).

Attention is counted layer by layer (``model.layer_types``, model/pattern.py): a model whose
sliding layers (Gemma 3's 5 of every 6) see W keys costs less than one whose layers all see
the whole row."""
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


def param_count(m) -> int:
    """Exact parameter count of model.Decoder for model config ``m``."""
    hd = head_dim(m)
    attn = m.d_model * hd * (2 * m.num_heads + 2 * m.num_kv_heads)  # wq, wo, wk, wv
    attn += _qkv_biases(m)
    mlp = 3 * m.d_model * m.ffn_dim  # w_gate, w_up, w_down
    embed_and_head = (1 if _tied(m) else 2) * m.vocab_size * m.d_model
    return m.num_layers * (attn + mlp + _layer_norms(m)) + embed_and_head + m.d_model  # + final norm


def _layer_norms(m) -> int:
    """Norm weights per layer: the two pre-norms (d_model each), Gemma's two sandwich post-norms
    (``model.sandwich_norms``) and the q and k norms over a head's dims (``model.qk_norm``)."""
    norms = 2 * m.d_model
    if m.get("sandwich_norms", False):
        norms += 2 * m.d_model
    if m.get("qk_norm", False):
        norms += 2 * head_dim(m)
    return norms


def _qkv_biases(m) -> int:
    """Bias entries per layer (bq, bk, bv) when model.qkv_bias is on."""
    return head_dim(m) * (m.num_heads + 2 * m.num_kv_heads) if m.get("qkv_bias", False) else 0


def _tied(m) -> bool:
    return bool(m.get("tie_embeddings", False))


def matmul_params(m) -> int:
    """Parameters that take part in a matmul per token (everything but norms, biases and the
    embedding lookup; a tied table counts once, as the head)."""
    lookup = 0 if _tied(m) else m.vocab_size * m.d_model
    return (param_count(m) - lookup - m.num_layers * (_layer_norms(m) + _qkv_biases(m))
            - m.d_model)


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
    """Model FLOPs per trained token: 6 N (matmul params) plus attention, with the causal half
    (and each layer's sliding window)."""
    return 6 * matmul_params(m) + attention_flops_per_token(m, seq_len, causal, window)
