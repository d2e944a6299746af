"""A Hugging Face ``config.json`` (LlamaForCausalLM) to and from this project's model config.

RoPE arrives in either of two spellings: ``rope_theta`` + ``rope_scaling`` (released
checkpoints, transformers 4) or ``rope_parameters`` (what transformers 5 writes); both become
``model.rope_theta`` + ``model.rope_scaling.*``. Export writes the first spelling, which every
transformers version reads. Anything the model does not have (biases, another activation,
sliding windows, another RoPE type) stops the conversion with one line.
"""
from __future__ import annotations

import math

from errors import ConversionError

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
MODEL_TYPES = ("llama", "mistral")


def _refuse(cfg: dict):
    arch = (cfg.get("architectures") or ["?"])[0]
    if cfg.get("model_type") not in MODEL_TYPES or arch not in ARCHITECTURES:
        raise ConversionError(
            f"config.json: model_type={cfg.get('model_type')!r}, architecture {arch!r}; only "
            f"LLaMA-architecture decoders convert ({', '.join(ARCHITECTURES)})")
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.get(flag):
            raise ConversionError(f"config.json: {flag}=true; this model has no biases")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ConversionError(f"config.json: hidden_act={act!r}; this model's MLP is SwiGLU (silu)")
    window = cfg.get("sliding_window")
    if window and window < cfg.get("max_position_embeddings", 0):
        raise ConversionError(f"config.json: sliding_window={window}; this model attends to the "
                              f"whole causal context (no sliding window)")


def _rope_parameters(cfg: dict) -> dict:
    """One flat dict with rope_type and rope_theta, from either spelling."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if "layer_types" in cfg or any(isinstance(v, dict) for v in params.values()):
        raise ConversionError("config.json: per-layer RoPE parameters are not supported")
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if factor not in (None, 1, 1.0):
        raise ConversionError(f"config.json: partial_rotary_factor={factor}; RoPE here rotates "
                              f"the whole head")
    return params


def rope_from_hf(cfg: dict) -> dict:
    """``model.rope_theta`` and ``model.rope_scaling`` fields for an HF config."""
    p = _rope_parameters(cfg)
    kind = p["rope_type"]
    kinds = {"default": "none", "linear": "linear", "dynamic": "dynamic", "yarn": "yarn",
             "llama3": "llama3"}
    if kind not in kinds:
        raise ConversionError(f"config.json: rope_type={kind!r} is not supported; supported: "
                              f"{', '.join(kinds)}")
    max_pos = int(cfg.get("max_position_embeddings") or 0)
    original = int(p.get("original_max_position_embeddings")
                   or cfg.get("original_max_position_embeddings") or max_pos)
    scaling = {"type": kinds[kind]}
    if kind == "linear":
        scaling.update(factor=float(p["factor"]))
    elif kind == "dynamic":  # transformers grows past max_position_embeddings for this type
        scaling.update(factor=float(p["factor"]), original_max_len=max_pos)
    elif kind == "llama3":
        scaling.update(factor=float(p["factor"]), original_max_len=original,
                       low_freq_factor=float(p["low_freq_factor"]),
                       high_freq_factor=float(p["high_freq_factor"]))
    elif kind == "yarn":
        factor = float(p.get("factor") or max_pos / original)
        scaling.update(factor=factor, original_max_len=original,
                       beta_fast=float(p.get("beta_fast") or 32), beta_slow=float(p.get("beta_slow") or 1),
                       truncate=bool(p.get("truncate", True)),
                       attention_factor=float(_yarn_attention_factor(p, factor) or 0.0))
    return {"rope_theta": float(p["rope_theta"]), "rope_scaling": scaling}


def _yarn_attention_factor(p: dict, factor: float) -> float | None:
    """The attention factor transformers derives when mscale and mscale_all_dim are given
    (DeepSeek's spelling); None keeps the plain 0.1 ln(factor) + 1."""
    if p.get("attention_factor") is not None:
        return float(p["attention_factor"])
    mscale, all_dim = p.get("mscale"), p.get("mscale_all_dim")
    if not (mscale and all_dim):
        return None

    def get(scale, m):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    return get(factor, mscale) / get(factor, all_dim)


def model_fields(cfg: dict) -> dict:
    """The ``config.model`` fields an HF LLaMA config sets."""
    _refuse(cfg)
    try:
        d, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        fields = {"vocab_size": int(cfg["vocab_size"]), "d_model": d,
                  "num_layers": int(cfg["num_hidden_layers"]), "num_heads": heads,
                  "num_kv_heads": int(cfg.get("num_key_value_heads") or heads),
                  "ffn_dim": int(cfg["intermediate_size"]),
                  "norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
                  "tie_embeddings": bool(cfg.get("tie_word_embeddings", False))}
    except KeyError as e:
        raise ConversionError(f"config.json lacks {e.args[0]!r}, which a LLaMA config has") from None
    head_dim = int(cfg.get("head_dim") or d // heads)
    fields["head_dim"] = 0 if head_dim * heads == d else head_dim
    fields.update(rope_from_hf(cfg))
    return fields


def hf_config(m, *, seq_len: int, dtype: str, base: dict | None, bos: int | None,
              eos: int | None) -> dict:
    """An HF ``config.json`` for model config ``m`` (over ``base``, the imported one, if any)."""
    out = dict(base or {})
    for stale in ("rope_parameters", "rope_scaling", "rope_theta", "torch_dtype", "dtype",
                  "original_max_position_embeddings", "transformers_version"):
        out.pop(stale, None)
    hd = m.head_dim or m.d_model // m.num_heads
    s = m.rope_scaling
    max_pos = max(int(seq_len), int(out.get("max_position_embeddings") or 0))
    scaling = None
    if s.type == "linear":
        scaling = {"rope_type": "linear", "factor": float(s.factor)}
    elif s.type == "dynamic":
        scaling = {"rope_type": "dynamic", "factor": float(s.factor)}
        max_pos = int(s.original_max_len)  # where transformers starts to grow the base
    elif s.type == "llama3":
        scaling = {"rope_type": "llama3", "factor": float(s.factor),
                   "original_max_position_embeddings": int(s.original_max_len),
                   "low_freq_factor": float(s.low_freq_factor),
                   "high_freq_factor": float(s.high_freq_factor)}
    elif s.type == "yarn":
        scaling = {"rope_type": "yarn", "factor": float(s.factor),
                   "original_max_position_embeddings": int(s.original_max_len)}
        # Only what differs from transformers' defaults, so that the config reads as imported.
        for key, value, default in (("beta_fast", float(s.beta_fast), 32.0),
                                    ("beta_slow", float(s.beta_slow), 1.0),
                                    ("truncate", bool(s.truncate), True),
                                    ("attention_factor", float(s.attention_factor), 0.0)):
            if value != default:
                scaling[key] = value
    out.update({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": int(m.vocab_size), "hidden_size": int(m.d_model),
        "intermediate_size": int(m.ffn_dim), "num_hidden_layers": int(m.num_layers),
        "num_attention_heads": int(m.num_heads), "num_key_value_heads": int(m.num_kv_heads),
        "head_dim": int(hd), "hidden_act": "silu", "rms_norm_eps": float(m.norm_eps),
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        "tie_word_embeddings": bool(m.get("tie_embeddings", False)),
        "max_position_embeddings": max_pos, "rope_theta": float(m.rope_theta),
        "rope_scaling": scaling, "torch_dtype": dtype, "use_cache": True})
    out.pop("sliding_window", None)
    if bos is not None:
        out["bos_token_id"] = bos
    imported_eos = out.get("eos_token_id")
    # Instruct models list every token that ends a reply (Llama 3: end of text, of message and
    # of turn); an imported list that holds the tokenizer's end-of-text token stays as it was.
    if eos is not None and not (isinstance(imported_eos, list) and eos in imported_eos):
        out["eos_token_id"] = eos
    return out
