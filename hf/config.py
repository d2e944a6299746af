"""A Hugging Face ``config.json`` (LLaMA, Mistral, Qwen2) to and from this project's model config.

RoPE arrives in either of two spellings: ``rope_theta`` + ``rope_scaling`` (released
checkpoints, transformers 4) or ``rope_parameters`` (what transformers 5 writes); both become
``model.rope_theta`` + ``model.rope_scaling.*``. Export writes the first spelling, which every
transformers version reads. Qwen2 is LLaMA with biases on q, k and v (``model.qkv_bias``);
Mistral is LLaMA with a sliding window (``model.sliding_window``, the same convention: a query at
p sees keys p - W < k <= p) on every layer. Export: q/k/v biases -> Qwen2 (every layer sliding
when the model has a window), else a window -> Mistral, else LLaMA. Anything the model does not
have (another architecture, biases elsewhere, another activation, windows that differ between
layers, another RoPE type) stops the conversion with one line naming it; ``REFUSED`` names what
the known architectures that do not convert have that this model lacks.
"""
from __future__ import annotations

import math

from errors import ConversionError

# model_type -> the architecture of it that converts.
CONVERTS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM"}
ARCHITECTURES = tuple(CONVERTS.values())
MODEL_TYPES = tuple(CONVERTS)
QKV_BIAS = ("qwen2",)  # model types with biases on q, k and v (and none on o)

# Known decoders that do not convert, model_type -> (name, what it has that this model has not).
REFUSED = {
    "gemma": ("Gemma", "GeGLU MLP (gelu_pytorch_tanh), embeddings scaled by sqrt(hidden_size), "
                       "RMSNorm scaling by 1 + weight"),
    "gemma2": ("Gemma 2", "attention logit soft-capping (attn_logit_softcapping), final logit "
                          "soft-capping, alternating local sliding-window / global layers, "
                          "post-attention and post-MLP norms, GeGLU MLP"),
    "gemma3_text": ("Gemma 3", "alternating local sliding-window / global layers with two RoPE "
                               "bases, q/k RMSNorm, post-attention and post-MLP norms, GeGLU MLP"),
    "gemma3": ("Gemma 3", "a vision tower, alternating local sliding-window / global layers with "
                          "two RoPE bases, q/k RMSNorm, GeGLU MLP"),
    "mixtral": ("Mixtral", "a mixture-of-experts MLP (num_local_experts)"),
    "qwen2_moe": ("Qwen2-MoE", "a mixture-of-experts MLP (num_experts) with a gated shared expert"),
    "qwen3": ("Qwen3", "RMSNorm on q and k per head (q_norm, k_norm)"),
    "qwen3_moe": ("Qwen3-MoE", "a mixture-of-experts MLP (num_experts), RMSNorm on q and k"),
    "deepseek_v2": ("DeepSeek-V2", "multi-head latent attention (low-rank q/kv), a "
                                   "mixture-of-experts MLP"),
    "deepseek_v3": ("DeepSeek-V3", "multi-head latent attention (low-rank q/kv), a "
                                   "mixture-of-experts MLP"),
    "phi3": ("Phi-3", "fused qkv_proj and gate_up_proj weights"),
    "phi": ("Phi", "LayerNorm, parallel attention and MLP, partial rotary embedding, GELU MLP, "
                   "biases"),
    "falcon": ("Falcon", "fused query_key_value weights, parallel attention and MLP, LayerNorm, "
                         "GELU MLP"),
    "gpt_neox": ("GPT-NeoX", "fused query_key_value weights, parallel attention and MLP, "
                             "LayerNorm with biases, partial rotary embedding, GELU MLP"),
    "gpt2": ("GPT-2", "learned absolute position embeddings, LayerNorm, fused c_attn weights, "
                      "GELU MLP, biases"),
    "olmo2": ("OLMo 2", "RMSNorm on q and k, norms after attention and MLP instead of before"),
    "cohere": ("Command R", "LayerNorm, parallel attention and MLP, logit scale"),
    "starcoder2": ("StarCoder2", "LayerNorm, GELU MLP, biases"),
}
# Keys that mean a mixture-of-experts MLP, whatever the model_type.
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
SOFTCAP_KEYS = ("attn_logit_softcapping", "final_logit_softcapping")


def _refuse(cfg: dict):
    kind = cfg.get("model_type")
    arch = (cfg.get("architectures") or ["?"])[0]
    supported = f"what converts: {', '.join(ARCHITECTURES)}"
    if kind in REFUSED:
        name, features = REFUSED[kind]
        raise ConversionError(f"config.json: {name} (model_type={kind!r}) does not convert: "
                              f"{features}; {supported}")
    for key in MOE_KEYS:
        if cfg.get(key):
            raise ConversionError(f"config.json: {key}={cfg[key]}: a mixture-of-experts MLP "
                                  f"does not convert ({arch}); {supported}")
    for key in SOFTCAP_KEYS:
        if cfg.get(key):
            raise ConversionError(f"config.json: {key}={cfg[key]}: logit soft-capping does not "
                                  f"convert ({arch}); {supported}")
    if kind not in MODEL_TYPES or arch not in ARCHITECTURES:
        raise ConversionError(
            f"config.json: model_type={kind!r}, architecture {arch!r}; only "
            f"LLaMA-architecture decoders convert ({', '.join(ARCHITECTURES)})")
    if cfg.get("attention_bias"):
        raise ConversionError("config.json: attention_bias=true (biases on q, k, v and o); only "
                              "Qwen2's q/k/v biases convert (model_type 'qwen2')")
    if cfg.get("mlp_bias"):
        raise ConversionError("config.json: mlp_bias=true; this model's MLP has no biases")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ConversionError(f"config.json: hidden_act={act!r}; this model's MLP is SwiGLU (silu)")


# The layer kinds transformers names in layer_types; only these two have a meaning here.
FULL, SLIDING = "full_attention", "sliding_attention"


def _layer_types(cfg: dict, window) -> list[str]:
    """Each layer's kind as transformers builds the model from this config.json."""
    kind, n = cfg.get("model_type"), int(cfg.get("num_hidden_layers") or 0)
    given = cfg.get("layer_types")
    if kind == "mistral":
        # MistralForCausalLM ignores layer_types (every layer reads config.sliding_window);
        # a list of mixed kinds means another model (Ministral's alternating layers): refused.
        return list(given) if given and len(set(given)) > 1 else [SLIDING if window else FULL] * n
    if given:
        return list(given)
    if kind == "qwen2":  # Qwen2Config: layers from max_window_layers (default 28) on slide
        first = int(cfg.get("max_window_layers", 28))
        return [SLIDING if window and i >= first else FULL for i in range(n)]
    return [FULL] * n


def sliding_window(cfg: dict) -> int:
    """``model.sliding_window`` for an HF config (0: full attention), read as transformers
    reads it: Mistral slides every layer by ``sliding_window`` (null: none, as in v0.2+);
    Qwen2 only with ``use_sliding_window`` true, from layer ``max_window_layers`` on (or per
    ``layer_types``); LLaMA never. This model has one window for every layer: a config in
    which some layers slide and others do not stops in one line."""
    kind = cfg.get("model_type")
    window = cfg.get("sliding_window")
    if kind == "llama" or (kind == "qwen2" and not cfg.get("use_sliding_window")):
        window = None  # LlamaForCausalLM never reads it; Qwen2Config drops it when false
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):
        raise ConversionError(f"config.json: sliding_window={window!r}; it must be a whole "
                              f"number of tokens >= 1, or null for full attention")
    types = _layer_types(cfg, window)
    other = sorted({t for t in types if t not in (FULL, SLIDING)})
    if other:
        raise ConversionError(f"config.json: layer_types has {', '.join(map(repr, other))} "
                              f"layers; only {FULL!r} and {SLIDING!r} layers convert")
    sliding = [i for i, t in enumerate(types) if t == SLIDING]
    if sliding and not window:
        raise ConversionError(
            f"config.json: layer_types has {SLIDING!r} layers but no sliding_window applies "
            f"(use_sliding_window={cfg.get('use_sliding_window')}, "
            f"sliding_window={cfg.get('sliding_window')!r})")
    if sliding and len(sliding) < len(types):
        full = [i for i, t in enumerate(types) if t == FULL]
        hint = ""
        if kind == "qwen2" and not cfg.get("layer_types"):
            hint = (" (Qwen2 converts with max_window_layers 0, every layer sliding, or >= "
                    "num_hidden_layers, none)")
        raise ConversionError(
            f"config.json: sliding_window={window} on {_spans(sliding)}, full attention on "
            f"{_spans(full)}; this model has one window for every layer{hint}")
    return int(window) if sliding else 0


def _spans(layers: list[int]) -> str:
    """[0, 1, 2, 5] -> 'layers 0..2, 5'; [3] -> 'layer 3'."""
    out, start = [], layers[0]
    for a, b in zip(layers, layers[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}..{a}" if a > start else f"{a}")
            start = b
    return ("layer " if len(layers) == 1 else "layers ") + ", ".join(out)


def _rope_parameters(cfg: dict) -> dict:
    """One flat dict with rope_type and rope_theta, from either spelling."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if any(isinstance(v, dict) for v in params.values()):
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
    """The ``config.model`` fields an HF LLaMA / Mistral / Qwen2 config sets."""
    _refuse(cfg)
    try:
        d, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        fields = {"vocab_size": int(cfg["vocab_size"]), "d_model": d,
                  "num_layers": int(cfg["num_hidden_layers"]), "num_heads": heads,
                  "num_kv_heads": int(cfg.get("num_key_value_heads") or heads),
                  "ffn_dim": int(cfg["intermediate_size"]),
                  "norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
                  "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
                  "qkv_bias": cfg["model_type"] in QKV_BIAS,
                  "sliding_window": sliding_window(cfg)}
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
    window = int(m.get("sliding_window", 0))
    kind = "qwen2" if m.get("qkv_bias", False) else "mistral" if window else "llama"
    out.update({
        "architectures": [CONVERTS[kind]], "model_type": kind,
        "vocab_size": int(m.vocab_size), "hidden_size": int(m.d_model),
        "intermediate_size": int(m.ffn_dim), "num_hidden_layers": int(m.num_layers),
        "num_attention_heads": int(m.num_heads), "num_key_value_heads": int(m.num_kv_heads),
        "head_dim": int(hd), "hidden_act": "silu", "rms_norm_eps": float(m.norm_eps),
        "attention_dropout": 0.0, "tie_word_embeddings": bool(m.get("tie_embeddings", False)),
        "max_position_embeddings": max_pos, "rope_theta": float(m.rope_theta),
        "rope_scaling": scaling, "torch_dtype": dtype, "use_cache": True})
    out.pop("layer_types", None)  # one kind for every layer: transformers derives them
    if kind == "qwen2":
        # Qwen2's own switch; without a window, sliding_window and max_window_layers stay as
        # imported (unused). With one, every layer slides: from layer 0 on.
        out["use_sliding_window"] = bool(window)
        if window:
            out.update(sliding_window=window, max_window_layers=0)
    else:
        out.pop("use_sliding_window", None)
        out.pop("max_window_layers", None)
        if kind == "mistral":
            out["sliding_window"] = window
        else:
            out.pop("sliding_window", None)
    for key in ("attention_bias", "mlp_bias"):  # LlamaConfig's own fields
        if kind == "llama":
            out[key] = False
        else:
            out.pop(key, None)
    if bos is not None:
        out["bos_token_id"] = bos
    imported_eos = out.get("eos_token_id")
    # Instruct models list every token that ends a reply (Llama 3: end of text, of message and
    # of turn); an imported list that holds the tokenizer's end-of-text token stays as it was.
    if eos is not None and not (isinstance(imported_eos, list) and eos in imported_eos):
        out["eos_token_id"] = eos
    return out
