"""Closed-form parameter and FLOP counts from the config (no arrays built)."""
from __future__ import annotations


def head_dim(m) -> int:
    return m.head_dim or m.d_model // m.num_heads


def param_count(m) -> int:
    """Exact parameter count of model.Decoder for model config ``m``."""
    hd = head_dim(m)
    attn = m.d_model * hd * (2 * m.num_heads + 2 * m.num_kv_heads)  # wq, wo, wk, wv
    attn += _qkv_biases(m)
    mlp = 3 * m.d_model * m.ffn_dim  # w_gate, w_up, w_down
    norms = 2 * m.d_model
    embed_and_head = (1 if _tied(m) else 2) * m.vocab_size * m.d_model
    return m.num_layers * (attn + mlp + norms) + embed_and_head + m.d_model  # + final norm


def _qkv_biases(m) -> int:
    """Bias entries per layer (bq, bk, bv) when model.qkv_bias is on."""
    return head_dim(m) * (m.num_heads + 2 * m.num_kv_heads) if m.get("qkv_bias", False) else 0


def _tied(m) -> bool:
    return bool(m.get("tie_embeddings", False))


def matmul_params(m) -> int:
    """Parameters that take part in a matmul per token (everything but norms, biases and the
    embedding lookup; a tied table counts once, as the head)."""
    lookup = 0 if _tied(m) else m.vocab_size * m.d_model
    return (param_count(m) - lookup - (2 * m.num_layers + 1) * m.d_model
            - m.num_layers * _qkv_biases(m))


def attention_flops_per_token(m, seq_len: int, causal: bool = True, window=None) -> float:
    """Training FLOPs per token of QK^T and PV: fwd 4*L*Hq*hd per layer, x3 for fwd+bwd.

    The causal mask halves the useful work (counted as L/2 keys per query on average). A
    sliding window W < L (``window``; None: the model's ``sliding_window``) leaves each query
    min(p + 1, W) keys: W - W^2 / 2L on average in the same count (L/2 again at W = L)."""
    window = int(m.get("sliding_window", 0)) if window is None else window
    keys = seq_len / 2 if causal else seq_len
    if causal and 0 < window < seq_len:
        keys = window - window * window / (2 * seq_len)
    return 3 * 4 * m.num_layers * keys * m.num_heads * head_dim(m)


def flops_per_token(m, seq_len: int, causal: bool = True, window=None) -> float:
    """Model FLOPs per trained token: 6 N (matmul params) plus attention, with the causal half
    (and the model's sliding window)."""
    return 6 * matmul_params(m) + attention_flops_per_token(m, seq_len, causal, window)
