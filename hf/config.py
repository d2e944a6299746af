"""A Hugging Face ``config.json`` to and from this project's model config: LLaMA, Mistral, Qwen2,
Qwen3, Gemma 3 (``Gemma3ForCausalLM``, and the language model of
``Gemma3ForConditionalGeneration``), SmolLM3, and the mixtures of experts Mixtral, Qwen3-MoE,
OLMoE and gpt-oss.

Every family is the LLaMA block with some of the model's switches on:
- Qwen2: biases on q, k and v (``model.qkv_bias``).
- Qwen3: an RMSNorm over each head of q and of k before RoPE (``model.qk_norm``); ``head_dim``
  is its own field (default 128).
- Gemma 3 (model_type ``gemma3_text``): q/k norms, RMSNorms scaling by 1 + w
  (``model.norm_unit_offset``), norms on the attention and MLP outputs too
  (``model.sandwich_norms``), embeddings times sqrt(hidden_size), GeGLU (``hidden_activation``
  ``gelu_pytorch_tanh``), softmax scale ``query_pre_attn_scalar ** -0.5``, final logit
  soft-capping, and local sliding-window / global layers (``layer_types``, by default 5 sliding :
  1 full) with a RoPE each: ``rope_parameters`` keyed by layer type, or the older ``rope_theta``
  + ``rope_scaling`` (the full layers') + ``rope_local_base_freq`` (the sliding layers').
  ``Gemma3ForConditionalGeneration`` (model_type ``gemma3``) imports its ``text_config`` and
  language-model tensors; the vision tower and projector are left out (hf/weights.py).
- SmolLM3: NoPE layers (``no_rope_layers``, by default every 4th), and with
  ``use_sliding_window`` a window on the layers transformers' ``layer_types`` rule gives.
- Mistral: one sliding window on every layer.
- Mixtral (Mistral's attention) and Qwen3-MoE (Qwen3's, its window on every layer with
  ``use_sliding_window``): a mixture of experts in every layer's MLP slot (``model.moe``):
  ``num_local_experts`` (Qwen3-MoE's released files: ``num_experts``) -> ``num_experts``,
  ``num_experts_per_tok`` -> ``top_k``, Mixtral's ``intermediate_size`` / Qwen3-MoE's
  ``moe_intermediate_size`` -> ``expert_dim``, softmax then top k renormalised (Mixtral always,
  Qwen3-MoE by ``norm_topk_prob``), ``router_aux_loss_coef`` -> ``aux_loss`` (no z-loss, no
  capacity: transformers' is dropless). Qwen3-MoE's dense layers (the layers i with (i + 1) not a
  multiple of ``decoder_sparse_step``, and ``mlp_only_layers``: a gated MLP of
  ``intermediate_size``) are ``model.moe.every`` and ``model.moe.dense_layers`` with the dense MLP
  of ``model.ffn_dim``.
- OLMoE (``OlmoeForCausalLM``): Mixtral's names for the shapes (``intermediate_size`` is each
  expert's width, ``num_experts``), Qwen3-MoE's for the tensors, the top k renormalised by
  ``norm_topk_prob`` (default false), and q/k norms over the whole projection
  (``model.qk_norm_scope=projection``: q_norm weighs num_heads x head_dim = hidden_size values,
  k_norm num_kv_heads x head_dim, each one RMS over all its heads, after the projection and
  before the split into heads and RoPE). Its head_dim is hidden_size / num_attention_heads (the
  norms' widths assume it); no window. ``clip_qkv`` (q, k and v clamped) does not convert;
  ``router_z_loss_coef``, which transformers never adds to the loss, is left out in one line
  (``left_out``: ``model.moe.z_loss`` stays 0, the loss transformers computes).
- gpt-oss (``GptOssForCausalLM``): attention sinks (``model.attention_sinks``), and with
  ``attention_bias`` biases on q, k, v and o (``model.qkv_bias`` and ``model.o_bias``); its
  ``layer_types`` (by default the even layers sliding by ``sliding_window``, the odd full);
  every MLP a mixture of ``num_local_experts``, ``num_experts_per_tok`` a token, scored top k
  then a softmax over the k (``model.moe.router=topk_softmax``) with a router bias, each
  expert of width ``intermediate_size`` with biases (``expert_bias``) and the clamped unit
  (``glu=clamped``: ``swiglu_limit``, ``swiglu_alpha``). Its released weights' MXFP4 experts
  (``quantization_config``) are dequantized at import (hf/mxfp4.py); export writes bf16 or
  fp32.
Each layer's kind becomes ``model.layer_types`` (full | sliding | full_nope | sliding_nope; empty
when every layer is alike) and ``model.sliding_window`` (a query at p sees keys p - W < k <= p,
transformers' convention); the window and the kinds are read as transformers builds the model
(Qwen2/Qwen3: from ``max_window_layers`` on, only with ``use_sliding_window``; LLaMA never).

RoPE arrives as ``rope_theta`` + ``rope_scaling`` (released checkpoints, transformers 4) or
``rope_parameters`` (what transformers 5 writes: flat, or keyed by layer type); either becomes
``model.rope_theta`` + ``model.rope_scaling.*`` (the full layers') and ``model.local_rope_theta``
(the sliding layers', unscaled, when it differs). Defaults a config leaves out are transformers'
(``DEFAULTS``: released Gemma 3 text configs list only what differs).

Export writes the architecture the model's fields need (``architecture``): attention sinks ->
GptOssForCausalLM (with the rest of gpt-oss's block); a mixture of experts -> OlmoeForCausalLM with q/k norms over the whole projection (``model.qk_norm_scope``), with
per-head ones Qwen3MoeForCausalLM, else MixtralForCausalLM; Gemma's fields ->
Gemma3ForCausalLM, NoPE layers (or windows on some layers only, without biases or q/k norms) ->
SmolLM3ForCausalLM, q/k norms -> Qwen3ForCausalLM, q/k/v biases -> Qwen2ForCausalLM, a window on
every layer -> MistralForCausalLM, else LlamaForCausalLM; a combination none of them has stops in
one line. RoPE goes out in the spelling every transformers version reads (``rope_theta`` +
``rope_scaling``, and for Gemma 3 ``rope_local_base_freq``), keyed ``rope_parameters`` only
where that cannot say it. Anything the model does not have (another architecture, biases
elsewhere, another activation, attention soft-capping, a scaled RoPE on the sliding layers
alone, another RoPE type) stops the conversion with one line naming it; ``REFUSED`` names what
the known architectures that do not convert have that this model lacks.
"""
from __future__ import annotations

import math

from errors import ConversionError

# model_type -> the architecture of it that converts.
CONVERTS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "gemma3_text": "Gemma3ForCausalLM", "smollm3": "SmolLM3ForCausalLM",
            "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
            "olmoe": "OlmoeForCausalLM", "gpt_oss": "GptOssForCausalLM"}
# Multimodal model_type -> (its architecture, the model_type of its language model): the
# language model (config.json's text_config) converts, the rest is left out.
MULTIMODAL = {"gemma3": ("Gemma3ForConditionalGeneration", "gemma3_text")}
ARCHITECTURES = tuple(CONVERTS.values()) + tuple(a for a, _ in MULTIMODAL.values())
MODEL_TYPES = tuple(CONVERTS)
QKV_BIAS = ("qwen2",)  # model types with biases on q, k and v (and none on o)
QK_NORM = ("qwen3", "gemma3_text", "qwen3_moe", "olmoe")  # RMSNorms on q and on k before RoPE
# ... over the whole q and k projections (model.qk_norm_scope=projection), not each head's dims
QK_NORM_PROJECTION = ("olmoe",)
GEMMA = ("gemma3_text",)  # 1 + w norms, sandwich norms, scaled embeddings, its own softmax scale
# Mixtures of experts in every layer's MLP slot (model.moe) -> (the key of each expert's hidden
# width, whether the top k weights are renormalised: a bool, or the key saying so)
MOE = {"mixtral": ("intermediate_size", True), "qwen3_moe": ("moe_intermediate_size",
                                                             "norm_topk_prob"),
       "olmoe": ("intermediate_size", "norm_topk_prob"),
       "gpt_oss": ("intermediate_size", False)}  # its top k: a softmax over the k logits
GPT_OSS = ("gpt_oss",)  # sinks, biases on q, k, v and o, gpt-oss's router and experts
# Model types whose one sliding_window (if any) applies to every layer
EVERY_LAYER_SLIDES = ("mistral", "mixtral", "qwen3_moe")

# transformers 5.23's defaults (its config classes') for the keys read here, where released
# config.json files leave them out. LLaMA, Mistral and Qwen2 files list what is needed.
DEFAULTS = {
    "qwen3": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
              "num_hidden_layers": 32, "num_attention_heads": 32, "head_dim": 128,
              "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": 4096,
              "max_window_layers": 28, "rope_theta": 10000.0},
    "smollm3": {"vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 11008,
                "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 4,
                "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
                "tie_word_embeddings": True, "use_sliding_window": False,
                "sliding_window": None, "no_rope_layer_interval": 4, "rope_theta": 2000000.0},
    "gemma3_text": {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
                    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
                    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
                    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
                    "tie_word_embeddings": True, "sliding_window": 4096,
                    "query_pre_attn_scalar": 256, "rope_theta": 1000000.0,
                    "rope_local_base_freq": 10000.0},
    "mixtral": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                "tie_word_embeddings": False, "sliding_window": None, "num_experts_per_tok": 2,
                "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0,
                "rope_theta": 1000000.0},
    "qwen3_moe": {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
                  "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 4,
                  "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
                  "tie_word_embeddings": False, "use_sliding_window": False,
                  "sliding_window": 4096, "decoder_sparse_step": 1, "moe_intermediate_size": 768,
                  "num_experts_per_tok": 8, "norm_topk_prob": False,
                  "router_aux_loss_coef": 0.001, "mlp_only_layers": [], "rope_theta": 10000.0},
    "olmoe": {"vocab_size": 50304, "hidden_size": 2048, "intermediate_size": 2048,
              "num_hidden_layers": 16, "num_attention_heads": 16, "hidden_act": "silu",
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
              "attention_bias": False, "clip_qkv": None, "num_experts_per_tok": 8,
              "norm_topk_prob": False, "router_aux_loss_coef": 0.01, "rope_theta": 10000.0},
    "gpt_oss": {"vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
                "num_hidden_layers": 36, "num_attention_heads": 64, "num_key_value_heads": 8,
                "head_dim": 64, "sliding_window": 128, "tie_word_embeddings": False,
                "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                "num_experts_per_tok": 4, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
                "router_aux_loss_coef": 0.001, "attention_bias": True, "rope_theta": 150000.0,
                "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                    "beta_slow": 1.0, "truncate": False,
                                    "original_max_position_embeddings": 4096,
                                    "rope_theta": 150000.0}},
}
# The expert count's default where a config names none (its key is read in either spelling:
# num_local_experts, as transformers 5.23 writes it, or num_experts: ``_num_experts``)
DEFAULT_EXPERTS = {"mixtral": 8, "qwen3_moe": 128, "olmoe": 64, "gpt_oss": 128}

# Known decoders that do not convert, model_type -> (name, what it has that this model has not).
REFUSED = {
    "gemma": ("Gemma", "not mapped here (GeGLU, embeddings scaled by sqrt(hidden_size) and "
                       "1 + weight RMSNorm without Gemma 3's q/k and sandwich norms; Gemma 3 "
                       "converts)"),
    "gemma2": ("Gemma 2", "attention logit soft-capping (attn_logit_softcapping)"),
    "gemma4": ("Gemma 4", "per-layer input embeddings, a wider head and partial (proportional) "
                          "RoPE on the global layers, keys and values shared across layers, "
                          "a vision and audio tower"),
    "gemma4_text": ("Gemma 4", "per-layer input embeddings, a wider head and partial "
                               "(proportional) RoPE on the global layers, keys and values "
                               "shared across layers"),
    "qwen2_moe": ("Qwen2-MoE", "a mixture-of-experts MLP (num_experts) with a gated shared expert"),
    "qwen3_next": ("Qwen3-Next", "linear attention (Gated DeltaNet) layers, gated attention, "
                                 "a mixture-of-experts MLP"),
    "qwen3_5": ("Qwen3.5", "linear attention (Gated DeltaNet) layers, gated attention, partial "
                           "RoPE, a vision tower"),
    "qwen3_5_text": ("Qwen3.5", "linear attention (Gated DeltaNet) layers, gated attention, "
                                "partial RoPE"),
    "qwen3_5_moe": ("Qwen3.5-MoE", "linear attention (Gated DeltaNet) layers, gated attention, "
                                   "a mixture-of-experts MLP, a vision tower"),
    "qwen3_5_moe_text": ("Qwen3.5-MoE", "linear attention (Gated DeltaNet) layers, gated "
                                        "attention, a mixture-of-experts MLP"),
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
    "olmo2": ("OLMo 2", "norms after attention and MLP instead of before (its RMSNorms over "
                        "the whole of q and of k alone would convert: model.qk_norm_scope="
                        "projection)"),
    "cohere": ("Command R", "LayerNorm, parallel attention and MLP, logit scale"),
    "starcoder2": ("StarCoder2", "LayerNorm, GELU MLP, biases"),
}
# Keys that mean a mixture-of-experts MLP, whatever the model_type.
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
SOFTCAP_KEYS = ("attn_logit_softcapping", "final_logit_softcapping")
# HF activation -> model.mlp_activation (the gated MLP's)
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# The layer kinds transformers names in layer_types; only these two have a meaning here.
FULL, SLIDING = "full_attention", "sliding_attention"


def _supported() -> str:
    return f"what converts: {', '.join(ARCHITECTURES)}"


def language_model_config(cfg: dict) -> dict:
    """``cfg`` itself, or for a multimodal config (``MULTIMODAL``) its language model's config as
    the multimodal class runs it, in its causal-LM class's spelling: the text_config with the
    top-level token ids and tying of the head (the multimodal class ties by the top-level
    flag), and without final_logit_softcapping, which Gemma3ForConditionalGeneration never
    applies (transformers 5.23: its forward returns lm_head's logits as they are)."""
    kind = cfg.get("model_type")
    if kind not in MULTIMODAL:
        return cfg
    arch, text_kind = MULTIMODAL[kind]
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ConversionError(f"config.json: model_type={kind!r} ({arch}) without a text_config; "
                              f"the language model's config is needed")
    out = dict(text)
    out.setdefault("model_type", text_kind)
    if out["model_type"] != text_kind:
        raise ConversionError(f"config.json: text_config has model_type={out['model_type']!r}; "
                              f"{arch}'s language model is {text_kind!r}")
    out["architectures"] = [CONVERTS[text_kind]]
    out["tie_word_embeddings"] = cfg.get("tie_word_embeddings", True)
    out["final_logit_softcapping"] = None
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype", "dtype"):
        if key in cfg and key not in text:
            out[key] = cfg[key]
    return out


def read(cfg: dict) -> dict:
    """The decoder's config as transformers builds it: the language model's of a multimodal
    config, with transformers' defaults for what is left out (``DEFAULTS``)."""
    cfg = language_model_config(cfg)
    return {**DEFAULTS.get(cfg.get("model_type"), {}), **cfg}


def _refuse(cfg: dict):
    kind = cfg.get("model_type")
    arch = (cfg.get("architectures") or ["?"])[0]
    if kind in REFUSED:
        name, features = REFUSED[kind]
        raise ConversionError(f"config.json: {name} (model_type={kind!r}) does not convert: "
                              f"{features}; {_supported()}")
    for key in MOE_KEYS if kind not in MOE else ():
        if cfg.get(key):
            raise ConversionError(f"config.json: {key}={cfg[key]}: a mixture-of-experts MLP "
                                  f"does not convert ({arch}); {_supported()}")
    if cfg.get("attn_logit_softcapping"):
        raise ConversionError(f"config.json: attn_logit_softcapping={cfg['attn_logit_softcapping']}"
                              f": attention logit soft-capping does not convert ({arch}); "
                              f"this model caps the final logits only; {_supported()}")
    if cfg.get("final_logit_softcapping") and kind not in GEMMA:
        raise ConversionError(f"config.json: final_logit_softcapping="
                              f"{cfg['final_logit_softcapping']}: logit soft-capping does not "
                              f"convert ({arch}); {_supported()}")
    if kind not in MODEL_TYPES or arch not in ARCHITECTURES:
        raise ConversionError(
            f"config.json: model_type={kind!r}, architecture {arch!r}; only "
            f"LLaMA-architecture decoders convert ({', '.join(ARCHITECTURES)})")
    if cfg.get("clip_qkv") is not None:
        raise ConversionError(f"config.json: clip_qkv={cfg['clip_qkv']!r}: transformers clamps "
                              f"q, k and v to +-clip_qkv ({arch}); this model's attention does "
                              f"not clip (clip_qkv null converts)")
    if cfg.get("attention_bias") and kind not in GPT_OSS:
        raise ConversionError("config.json: attention_bias=true (biases on q, k, v and o); only "
                              "Qwen2's q/k/v biases and gpt-oss's on all four convert "
                              "(model_type 'qwen2', 'gpt_oss')")
    if cfg.get("mlp_bias"):
        raise ConversionError("config.json: mlp_bias=true; this model's MLP has no biases")
    if cfg.get("use_bidirectional_attention"):
        raise ConversionError("config.json: use_bidirectional_attention=true; this model's "
                              "attention is causal")
    key = _activation_key(cfg)
    act = cfg.get(key, "silu")
    if act not in ACTIVATIONS:
        raise ConversionError(f"config.json: {key}={act!r}; this model's gated MLP takes "
                              f"{' or '.join(map(repr, ACTIVATIONS))}")


def _activation_key(cfg: dict) -> str:
    return "hidden_activation" if cfg.get("model_type") in GEMMA else "hidden_act"


def _window(cfg: dict) -> int | None:
    """The window transformers applies to sliding layers (None: none), checked."""
    kind = cfg.get("model_type")
    window = cfg.get("sliding_window")
    if kind in ("llama", "olmoe") or (kind in ("qwen2", "qwen3", "smollm3", "qwen3_moe")
                           and not cfg.get("use_sliding_window")):
        window = None  # Llama/OlmoeForCausalLM never read it; the others drop it when false
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):
        raise ConversionError(f"config.json: sliding_window={window!r}; it must be a whole "
                              f"number of tokens >= 1, or null for full attention")
    return window


def _rope_layers(cfg: dict, n: int) -> list[bool]:
    """Whether each layer rotates q and k (SmolLM3's no_rope_layers: 1 RoPE, 0 NoPE)."""
    if cfg.get("model_type") != "smollm3":
        return [True] * n
    given = cfg.get("no_rope_layers")
    if given is None:  # SmolLM3Config: every no_rope_layer_interval-th layer has no RoPE
        interval = int(cfg.get("no_rope_layer_interval") or 4)
        return [bool((i + 1) % interval) for i in range(n)]
    if not isinstance(given, list) or len(given) < n:
        raise ConversionError(f"config.json: no_rope_layers={given!r}; it needs one 1 (RoPE) or "
                              f"0 (NoPE) per layer, {n} in all")
    return [bool(x) for x in given[:n]]


def _hf_layer_types(cfg: dict, window, rope: list[bool]) -> list[str]:
    """Each layer's kind (FULL / SLIDING) as transformers builds the model from this config."""
    kind, n = cfg.get("model_type"), int(cfg.get("num_hidden_layers") or 0)
    given = cfg.get("layer_types")
    if kind in EVERY_LAYER_SLIDES:
        # MistralForCausalLM (and Mixtral, Qwen3-MoE) ignore layer_types (every layer reads
        # config.sliding_window); a list of mixed kinds is another model's (Ministral's
        # alternating layers): refused.
        if given and len(set(given)) > 1:
            raise ConversionError(
                f"config.json: model_type {kind!r} with layer_types mixing {FULL!r} and "
                f"{SLIDING!r}: {CONVERTS[kind]} slides every layer by sliding_window="
                f"{window} and ignores layer_types"
                + (" (Ministral's alternation is model_type 'ministral')"
                   if kind == "mistral" else "") + "; a file saying both is ambiguous")
        return [SLIDING if window else FULL] * n
    if given:
        if len(given) != n:
            raise ConversionError(f"config.json: layer_types lists {len(given)} layers but "
                                  f"num_hidden_layers={n}")
        return list(given)
    if kind in ("qwen2", "qwen3"):  # layers from max_window_layers (default 28) on slide
        first = int(cfg.get("max_window_layers", 28))
        return [SLIDING if window and i >= first else FULL for i in range(n)]
    if kind == "smollm3":  # the NoPE layers slide
        return [SLIDING if window and not rope[i] else FULL for i in range(n)]
    if kind in GEMMA:  # Gemma3TextConfig: every sliding_window_pattern-th layer is global
        pattern = int(cfg.get("sliding_window_pattern") or 6)
        return [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    if kind in GPT_OSS:  # GptOssConfig: the even layers (from 0) slide, the odd are full
        return [SLIDING if (i + 1) % 2 else FULL for i in range(n)]
    return [FULL] * n


def layers(cfg: dict) -> tuple[str, int]:
    """(``model.layer_types``, ``model.sliding_window``) for a config read by ``read``:
    each layer's kind as transformers builds the model (empty when every layer is alike) and
    the sliding layers' window (0: none)."""
    window = _window(cfg)
    n = int(cfg.get("num_hidden_layers") or 0)
    rope = _rope_layers(cfg, n)
    types = _hf_layer_types(cfg, window, rope)
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
    names = [("sliding" if t == SLIDING else "full") + ("" if r else "_nope")
             for t, r in zip(types, rope)]
    uniform = len(set(names)) == 1 and names[0] in ("full", "sliding")
    return ("" if uniform else ",".join(names)), (int(window) if sliding else 0)


def _rope_by_layer_type(cfg: dict) -> tuple[dict, dict]:
    """(the full layers' RoPE parameters, the sliding layers'), each one flat dict with
    rope_type and rope_theta, from any spelling, as transformers 5.23 reads them."""
    kind = cfg.get("model_type")
    params = cfg.get("rope_parameters")
    legacy = cfg.get("rope_scaling")
    keyed = isinstance(params, dict) and any(k in (FULL, SLIDING) for k in params)
    if kind in GEMMA:
        # Gemma3TextConfig: rope_parameters keyed by layer type; or rope_theta + rope_scaling
        # (the full layers') + rope_local_base_freq (the sliding layers')
        if params and not keyed:
            raise ConversionError(f"config.json: rope_parameters={params!r}; Gemma 3 keys them "
                                  f"by layer type ({FULL!r}, {SLIDING!r})")
        for k in (FULL, SLIDING):
            if keyed and k in params and not isinstance(params[k], (dict, type(None))):
                raise ConversionError(f"config.json: rope_parameters[{k!r}]={params[k]!r} is not "
                                      f"a dict of RoPE parameters")
        full = dict((params or {}).get(FULL) or {"rope_type": "default"})
        sliding = dict((params or {}).get(SLIDING) or {"rope_type": "default"})
        if legacy and "rope_type" not in legacy and legacy.get("type", "default") != "default":
            # merged into the full layers' {"rope_type": "default"}, transformers 5 ignores the
            # old "type" spelling here; transformers 4 applied it
            raise ConversionError(f"config.json: rope_scaling={legacy!r} names its type as "
                                  f"'type', which transformers 5 ignores for Gemma 3 (4 applied "
                                  f"it); write 'rope_type' for the RoPE meant")
        if legacy:
            full.update(legacy)
        full.setdefault("rope_theta", cfg.get("rope_theta", 1000000.0))
        sliding.setdefault("rope_theta", cfg.get("rope_local_base_freq", 10000.0))
    else:
        # transformers 5: a legacy rope_scaling wins over rope_parameters; keyed parameters
        # mean one RoPE here (the families other than Gemma 3 have one for every layer)
        flat = legacy or params or {}
        if keyed and not legacy:
            given = [v for k, v in params.items() if k in (FULL, SLIDING) and v is not None]
            if any(v != given[0] for v in given[1:]):
                raise ConversionError(
                    f"config.json: rope_parameters differ between {FULL!r} and {SLIDING!r} "
                    f"layers; model_type {kind!r} has one RoPE for every layer (only Gemma 3 "
                    f"has one per layer type)")
            flat = given[0] if given else {}
        full = sliding = dict(flat)
        full.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    for p in (full, sliding):
        p.setdefault("rope_type", p.get("type", "default"))
        factor = p.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        if factor not in (None, 1, 1.0):
            raise ConversionError(f"config.json: partial_rotary_factor={factor}; RoPE here "
                                  f"rotates the whole head")
    return full, sliding


def _rope_fields(p: dict, cfg: dict) -> dict:
    """``model.rope_theta`` and ``model.rope_scaling`` fields for flat RoPE parameters ``p``."""
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


def rope_from_hf(cfg: dict, layer_types: str = "") -> dict:
    """``model.rope_theta``, ``model.rope_scaling`` (the full layers') and
    ``model.local_rope_theta`` (the sliding layers', when it differs; 0: the same RoPE) for a
    config read by ``read``, whose layers are ``layer_types``."""
    full, sliding = _rope_by_layer_type(cfg)
    fields = _rope_fields(full, cfg)
    fields["local_rope_theta"] = 0.0
    if "sliding" in layer_types.split(","):  # some sliding layer rotates q and k
        local = _rope_fields(sliding, cfg)
        if local != {k: fields[k] for k in local}:
            if local["rope_scaling"]["type"] != "none":
                raise ConversionError(
                    f"config.json: the {SLIDING!r} layers' RoPE has rope_type "
                    f"{sliding['rope_type']!r}; here the sliding layers take the full layers' "
                    f"RoPE or an unscaled one of their own (model.local_rope_theta)")
            fields["local_rope_theta"] = local["rope_theta"]
    return fields


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


def _num_experts(cfg: dict) -> tuple[str, object]:
    """(the key, the expert count) of a mixture-of-experts config: ``num_local_experts`` (as
    transformers 5.23 writes both families) or ``num_experts`` (released Qwen3-MoE files; the
    two are one attribute in transformers 5.23's config classes)."""
    for key in ("num_local_experts", "num_experts"):
        if cfg.get(key) is not None:
            return key, cfg[key]
    return "num_local_experts", DEFAULT_EXPERTS[cfg["model_type"]]


def moe_fields(cfg: dict) -> dict:
    """``config.model.moe``'s fields for a config read by ``read``: the router and experts of a
    mixture-of-experts family (``MOE``), every field it may set; ``num_experts`` 0 (the dense
    MLP) for the others."""
    kind = cfg.get("model_type")
    if kind not in MOE:
        return {"num_experts": 0}
    key, experts = _num_experts(cfg)
    whole = lambda v: isinstance(v, int) and not isinstance(v, bool)  # noqa: E731
    if not whole(experts) or experts < 1:
        raise ConversionError(f"config.json: {key}={experts!r}; a mixture of experts needs a "
                              f"whole number of experts >= 1")
    top_k = cfg.get("num_experts_per_tok")
    if not whole(top_k) or not 1 <= top_k <= experts:
        raise ConversionError(f"config.json: num_experts_per_tok={top_k!r}; it must be a whole "
                              f"number from 1 to {key}={experts}")
    every, dense = 1, []
    if kind == "qwen3_moe":  # Qwen3MoeDecoderLayer: a dense MLP where these say so
        n = int(cfg.get("num_hidden_layers") or 0)
        every = cfg.get("decoder_sparse_step", 1)
        if every is None:
            every = 1
        if not whole(every) or every < 1:
            raise ConversionError(f"config.json: decoder_sparse_step={every!r}; it must be a "
                                  f"whole number >= 1 (every n-th layer a mixture of experts)")
        only = cfg.get("mlp_only_layers") or []
        # (transformers tests ``i in mlp_only_layers``: an index past the layers says nothing)
        dense = sorted({i for i in only if whole(i) and 0 <= i < n})
        if not any((i + 1) % every == 0 and i not in dense for i in range(n)):
            raise ConversionError(
                f"config.json: decoder_sparse_step={every} and mlp_only_layers={only!r} leave "
                f"no layer of the {n} a mixture of experts; Qwen3MoeForCausalLM then is a dense "
                f"model, which this import does not take (a Qwen3ForCausalLM config does)")
    width_key, renormalize = MOE[kind]
    try:
        width = int(cfg[width_key])
    except KeyError:
        raise ConversionError(f"config.json lacks {width_key!r}, which a {CONVERTS[kind]} "
                              f"config has") from None
    gpt_oss = kind in GPT_OSS
    limit, alpha = cfg.get("swiglu_limit", 7.0), cfg.get("swiglu_alpha", 1.702)
    if gpt_oss and not (isinstance(limit, (int, float)) and limit > 0
                        and isinstance(alpha, (int, float))):
        raise ConversionError(f"config.json: swiglu_limit={limit!r}, swiglu_alpha={alpha!r}; "
                              f"gpt-oss's clamped unit needs a limit > 0 and a number alpha")
    return {"num_experts": int(experts), "top_k": int(top_k), "expert_dim": width,
            # gpt-oss: the top k logits, then a softmax over them; a bias on the router and on
            # each expert; the clamped unit ((up + 1) * gate * sigmoid(alpha * gate))
            "router": "topk_softmax" if gpt_oss else "softmax_topk",
            "renormalize": (renormalize if isinstance(renormalize, bool)
                            else bool(cfg.get(renormalize))),
            "router_bias": gpt_oss, "expert_bias": gpt_oss,
            "glu": "clamped" if gpt_oss else "gated", "glu_limit": float(limit),
            "glu_alpha": float(alpha),
            "aux_loss": float(cfg.get("router_aux_loss_coef") or 0.0),
            "z_loss": 0.0, "capacity": 0.0,
            "every": int(every), "first_dense": 0, "dense_layers": ",".join(map(str, dense))}


def left_out(cfg: dict) -> list[str]:
    """What a config that converts says that the import leaves out, a line each: Mixtral's
    ``router_jitter_noise`` (transformers multiplies the router's input by noise while training;
    the router here takes none; the model is the same) and a ``router_z_loss_coef`` (OLMoE's
    training weight of the router z-loss: no transformers mixture of experts adds a z-loss to
    its loss, so ``model.moe.z_loss`` stays 0, the loss transformers computes)."""
    cfg = read(cfg)
    if cfg.get("model_type") not in MOE:
        return []
    lines = []
    jitter = cfg.get("router_jitter_noise")
    if jitter:
        lines.append(f"config.json: router_jitter_noise={jitter} is left out: transformers "
                     f"multiplies the router's input by noise in training, the router here takes "
                     f"none (the model is the same)")
    z = cfg.get("router_z_loss_coef")
    if z:
        lines.append(f"config.json: router_z_loss_coef={z} is left out: "
                     f"{CONVERTS[cfg['model_type']]} adds no z-loss to its loss, so "
                     f"model.moe.z_loss stays 0 (set --config.model.moe.z_loss={z} to train "
                     f"with one; the model is the same)")
    return lines


def model_fields(cfg: dict) -> dict:
    """The ``config.model`` fields an HF config of a family that converts sets (every field a
    family may set, so that the ``--config`` file's own values never leak into an import)."""
    cfg = read(cfg)
    _refuse(cfg)
    kind = cfg["model_type"]
    try:
        d, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        fields = {"vocab_size": int(cfg["vocab_size"]), "d_model": d,
                  "num_layers": int(cfg["num_hidden_layers"]), "num_heads": heads,
                  "num_kv_heads": int(cfg.get("num_key_value_heads") or heads),
                  "ffn_dim": int(cfg["intermediate_size"]),
                  "norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
                  "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
                  "qkv_bias": kind in QKV_BIAS or (kind in GPT_OSS
                                                   and bool(cfg.get("attention_bias"))),
                  "o_bias": kind in GPT_OSS and bool(cfg.get("attention_bias")),
                  "attention_sinks": kind in GPT_OSS}
    except KeyError as e:
        raise ConversionError(f"config.json lacks {e.args[0]!r}, which a "
                              f"{CONVERTS[kind]} config has") from None
    fields["layer_types"], fields["sliding_window"] = layers(cfg)
    head_dim = int(cfg.get("head_dim") or d // heads)
    if kind in QK_NORM_PROJECTION and head_dim * heads != d:
        raise ConversionError(
            f"config.json: head_dim={cfg.get('head_dim')!r} with hidden_size={d} and "
            f"num_attention_heads={heads}: {CONVERTS[kind]}'s q_norm weighs hidden_size values, "
            f"so its heads are hidden_size / num_attention_heads wide (transformers cannot run "
            f"another head_dim)")
    fields["head_dim"] = 0 if head_dim * heads == d else head_dim
    gemma = kind in GEMMA
    scalar = cfg.get("query_pre_attn_scalar") if gemma else None
    fields.update(
        qk_norm=kind in QK_NORM,
        qk_norm_scope="projection" if kind in QK_NORM_PROJECTION else "head",
        norm_unit_offset=gemma, sandwich_norms=gemma,
        scale_embeddings=gemma, mlp_activation=ACTIVATIONS[cfg.get(_activation_key(cfg), "silu")],
        query_pre_attn_scalar=float(scalar or 0.0),
        final_logit_softcap=float(cfg.get("final_logit_softcapping") or 0.0) if gemma else 0.0)
    fields.update(rope_from_hf(cfg, fields["layer_types"] or
                               ("sliding" if fields["sliding_window"] else "full")))
    fields["moe"] = moe_fields(cfg)
    return fields


# ---------------------------------------------------------------------------------- export

GEMMA_BLOCK = ("qk_norm", "norm_unit_offset", "sandwich_norms", "scale_embeddings")
# What an export writes itself; an imported config's values of these never pass through.
WRITTEN = ("rope_parameters", "rope_scaling", "rope_theta", "rope_local_base_freq", "torch_dtype",
           "dtype", "original_max_position_embeddings", "transformers_version", "layer_types",
           "use_sliding_window", "max_window_layers", "sliding_window", "sliding_window_pattern",
           "_sliding_window_pattern", "no_rope_layers", "no_rope_layer_interval",
           "query_pre_attn_scalar", "final_logit_softcapping", "attn_logit_softcapping",
           "use_bidirectional_attention", "hidden_act", "hidden_activation", "attention_bias",
           "mlp_bias", "head_dim", "num_experts", "num_local_experts", "num_experts_per_tok",
           "moe_intermediate_size", "norm_topk_prob", "router_aux_loss_coef",
           "router_jitter_noise", "decoder_sparse_step", "mlp_only_layers",
           "output_router_logits", "n_routed_experts", "moe_num_experts", "clip_qkv",
           "router_z_loss_coef", "swiglu_limit", "swiglu_alpha", "quantization_config")


def _experts(m) -> int:
    """``model.moe.num_experts`` (0: the dense MLP; a config from before the field is dense)."""
    moe = m.get("moe", None)
    return int(moe.get("num_experts", 0) or 0) if moe is not None else 0


def _renormalized(m) -> bool:
    """Whether the router's top k weights sum to 1: ``renormalize``, or ``topk_softmax`` (a
    softmax over the top k logits is the top k of the softmax renormalised: the same
    weights)."""
    return str(m.moe.get("router", "softmax_topk")) == "topk_softmax" or bool(m.moe.renormalize)


def _projection_norms(m) -> bool:
    """Whether ``m``'s q/k norms span the whole projection (OLMoE's), not each head."""
    return bool(m.get("qk_norm", False)) and str(m.get("qk_norm_scope", "head")) == "projection"


def _moe_architecture(m, gemma: list, nope: bool, sliding: list) -> str:
    """olmoe (q/k norms over the whole projection), qwen3_moe (per-head q/k norms) or mixtral
    for a mixture of experts ``m``, or one line saying what none of them has."""
    on = lambda f: bool(m.get(f, False))  # noqa: E731
    what = ([f"model.{f}" for f in gemma] + (["NoPE layers"] if nope else [])
            + (["model.qkv_bias"] if on("qkv_bias") else [])
            + (["model.moe.router_bias"] if m.moe.get("router_bias", False) else [])
            + (["sliding and full layers mixed (model.layer_types)"]
               if any(sliding) and not all(sliding) else []))
    if what:
        raise ConversionError(
            f"model.moe.num_experts={_experts(m)} with {', '.join(what)}: no Hugging Face "
            f"architecture has this combination (MixtralForCausalLM, Qwen3MoeForCausalLM and "
            f"OlmoeForCausalLM: LLaMA's block with q/k norms or none, a window on every layer "
            f"or none, a router without a bias)")
    from model.flops import moe_layers
    if len(moe_layers(m)) < m.num_layers and not (on("qk_norm") and not _projection_norms(m)):
        dense = [i for i in range(m.num_layers) if i not in moe_layers(m)]
        raise ConversionError(
            f"model.moe.num_experts={_experts(m)} with dense layers ({', '.join(map(str, dense))} "
            f"of {m.num_layers}: model.moe.every, first_dense, dense_layers) and "
            f"{'q/k norms over the whole projection' if on('qk_norm') else 'no q/k norms'}: "
            f"only Qwen3MoeForCausalLM (per-head q/k norms, model.qk_norm) has layers that are "
            f"not all a mixture of experts (decoder_sparse_step, mlp_only_layers)")
    if _projection_norms(m):
        hd = m.head_dim or m.d_model // m.num_heads
        what = ((["a window (model.sliding_window)"] if any(sliding) else [])
                + ([f"model.head_dim={hd} (not d_model / num_heads = "
                    f"{m.d_model / m.num_heads:g})"] if hd * m.num_heads != m.d_model else []))
        if what:
            raise ConversionError(
                f"model.qk_norm_scope=projection with {', '.join(what)}: no Hugging Face "
                f"architecture has this combination (OlmoeForCausalLM, whose q/k norms span the "
                f"whole projection, has no window and heads of hidden_size / "
                f"num_attention_heads)")
        return "olmoe"
    if on("qk_norm"):
        return "qwen3_moe"
    if not _renormalized(m):
        raise ConversionError(
            "model.moe.renormalize=False without model.qk_norm: no Hugging Face architecture "
            "has this combination (MixtralForCausalLM always renormalises the top k weights; "
            "Qwen3MoeForCausalLM and OlmoeForCausalLM, whose norm_topk_prob may leave them, have "
            "q/k norms)")
    return "mixtral"


def _gpt_oss_features(m) -> list[str]:
    """The fields of ``m`` that only gpt-oss has (the o projection's bias, the experts' biases,
    the clamped unit)."""
    moe = m.get("moe", None)
    experts = _experts(m) > 0
    return ((["model.o_bias"] if m.get("o_bias", False) else [])
            + (["model.moe.expert_bias"] if experts and moe.get("expert_bias", False) else [])
            + (["model.moe.glu=clamped"] if experts and moe.get("glu", "gated") == "clamped"
               else []))


def _gpt_oss_architecture(m, gemma: list, nope: bool) -> str:
    """gpt_oss for a model with attention sinks that has the rest of gpt-oss's block, or one
    line saying what GptOssForCausalLM would lack or add."""
    on = lambda f: bool(m.get(f, False))  # noqa: E731
    e = m.get("moe", None)
    from model.flops import moe_layers
    what = ([f"model.{f}" for f in gemma] + (["NoPE layers"] if nope else [])
            + (["model.qk_norm"] if on("qk_norm") else []))
    if not _experts(m):
        what.append("no mixture of experts (model.moe.num_experts=0)")
    else:
        if len(moe_layers(m)) < m.num_layers:
            what.append("dense layers (model.moe.every, first_dense, dense_layers)")
        for field, want in (("router", "topk_softmax"), ("router_bias", True),
                            ("expert_bias", True), ("glu", "clamped")):
            if e.get(field, None) != want:
                what.append(f"model.moe.{field}={e.get(field, None)!r} (not {want!r})")
    if on("qkv_bias") != on("o_bias"):
        what.append(f"model.qkv_bias={on('qkv_bias')} with model.o_bias={on('o_bias')} "
                    f"(attention_bias is both or neither)")
    if what:
        raise ConversionError(
            f"model.attention_sinks with {', '.join(what)}: no Hugging Face architecture has "
            f"this combination (GptOssForCausalLM, the one with sinks: every layer a mixture of "
            f"experts with its router (topk_softmax, a bias) and experts (biases, glu=clamped), "
            f"biases on q, k, v and o or none, LLaMA's norms)")
    return "gpt_oss"


def architecture(m) -> str:
    """The model_type an export of model config ``m`` writes: a mixture of experts -> olmoe
    with q/k norms over the whole projection, qwen3_moe with per-head ones, else mixtral;
    Gemma's fields -> gemma3_text,
    NoPE layers -> smollm3, q/k norms -> qwen3, q/k/v biases -> qwen2, a window on every layer
    -> mistral, on some layers -> smollm3 (per-layer windows, RoPE on each), else llama. A
    combination no Hugging Face architecture has is one line naming it."""
    from model import pattern
    from model.rope import Rope, from_config
    names = pattern.names(m)
    hd = m.head_dim or m.d_model // m.num_heads
    on = lambda f: bool(m.get(f, False))  # noqa: E731
    local = float(m.get("local_rope_theta", 0.0) or 0.0)
    scalar = float(m.get("query_pre_attn_scalar", 0.0) or 0.0)
    gemma = [f for f in GEMMA_BLOCK[1:] if on(f)]
    if float(m.get("final_logit_softcap", 0.0) or 0.0):
        gemma.append("final_logit_softcap")
    if scalar and scalar != hd:
        gemma.append("query_pre_attn_scalar")
    if local and "sliding" in names and Rope(theta=local) != from_config(m):
        gemma.append("local_rope_theta")  # a RoPE of their own on the sliding layers
    nope = any(k.endswith("_nope") for k in names)
    sliding = [k.startswith("sliding") for k in names]
    own = _gpt_oss_features(m)
    if on("attention_sinks"):
        return _gpt_oss_architecture(m, gemma, nope)
    if own:  # not dropped silently: no other architecture has them
        raise ConversionError(
            f"{', '.join(own)} without model.attention_sinks: no Hugging Face architecture has "
            f"this combination (GptOssForCausalLM, the one with them, has attention sinks)")
    if _experts(m):
        return _moe_architecture(m, gemma, nope, sliding)
    if _projection_norms(m):
        raise ConversionError(
            "model.qk_norm_scope=projection without a mixture of experts (model.moe.num_experts"
            "=0): no Hugging Face architecture has this combination (OlmoeForCausalLM, the one "
            "whose q/k norms span the whole projection, has one; OLMo 2's come with norms after "
            "attention and MLP instead of before)")
    if gemma:
        missing = [f for f in GEMMA_BLOCK if not on(f)]
        extra = (["qkv_bias"] if on("qkv_bias") else []) + (["NoPE layers"] if nope else [])
        if missing or extra:
            what = ", ".join([f"model.{f}" for f in gemma] + [f"not model.{f}" for f in missing]
                             + [f"model.{f}" if f == "qkv_bias" else f for f in extra])
            raise ConversionError(
                f"{what}: no Hugging Face architecture has this combination "
                f"(Gemma3ForCausalLM has all of {', '.join(GEMMA_BLOCK)}, and no q/k/v biases "
                f"or NoPE layers)")
        if m.d_model % m.num_heads:
            raise ConversionError(f"model.d_model={m.d_model} is not a multiple of num_heads="
                                  f"{m.num_heads}, which Gemma3TextConfig requires")
        if scalar and scalar != int(scalar):
            raise ConversionError(f"model.query_pre_attn_scalar={scalar:g}: Gemma3TextConfig "
                                  f"takes a whole number")
        return "gemma3_text"
    if nope:
        for f in ("qk_norm", "qkv_bias"):
            if on(f):
                raise ConversionError(
                    f"model.layer_types has NoPE layers and model.{f}: no Hugging Face "
                    f"architecture has both (SmolLM3ForCausalLM, the one with NoPE layers, has "
                    f"neither q/k norms nor q/k/v biases)")
        return "smollm3"
    if on("qk_norm"):
        if on("qkv_bias"):
            raise ConversionError("model.qk_norm and model.qkv_bias: no Hugging Face "
                                  "architecture has both (Qwen3's attention_bias puts biases "
                                  "on q, k, v and o)")
        return "qwen3"
    if on("qkv_bias"):
        return "qwen2"
    if any(sliding):
        return "mistral" if all(sliding) else "smollm3"
    return "llama"


def _hf_rope(rope) -> tuple[float, dict | None, int | None]:
    """(rope_theta, rope_scaling in transformers' spelling or None, the max_position_embeddings
    dynamic scaling needs or None) of a model.rope.Rope."""
    scaling, max_pos = None, None
    if rope.scaling == "linear":
        scaling = {"rope_type": "linear", "factor": float(rope.factor)}
    elif rope.scaling == "dynamic":
        scaling = {"rope_type": "dynamic", "factor": float(rope.factor)}
        max_pos = int(rope.original_max_len)  # where transformers starts to grow the base
    elif rope.scaling == "llama3":
        scaling = {"rope_type": "llama3", "factor": float(rope.factor),
                   "original_max_position_embeddings": int(rope.original_max_len),
                   "low_freq_factor": float(rope.low_freq_factor),
                   "high_freq_factor": float(rope.high_freq_factor)}
    elif rope.scaling == "yarn":
        scaling = {"rope_type": "yarn", "factor": float(rope.factor),
                   "original_max_position_embeddings": int(rope.original_max_len)}
        # Only what differs from transformers' defaults, so that the config reads as imported.
        for key, value, default in (("beta_fast", float(rope.beta_fast), 32.0),
                                    ("beta_slow", float(rope.beta_slow), 1.0),
                                    ("truncate", bool(rope.truncate), True),
                                    ("attention_factor", float(rope.attention_factor), 0.0)):
            if value != default:
                scaling[key] = value
    return float(rope.theta), scaling, max_pos


def hf_config(m, *, seq_len: int, dtype: str, base: dict | None, bos: int | None,
              eos: int | None) -> dict:
    """An HF ``config.json`` for model config ``m`` (over ``base``, the imported one, if any:
    a multimodal one's language model)."""
    from model import pattern
    from model.rope import from_config
    kind = architecture(m)
    base = language_model_config(base) if base else {}
    same_family = base.get("model_type") == kind
    out = {k: v for k, v in base.items() if k not in WRITTEN}
    hd = m.head_dim or m.d_model // m.num_heads
    theta, scaling, dynamic_max = _hf_rope(from_config(m))
    max_pos = dynamic_max or max(int(seq_len), int(base.get("max_position_embeddings") or 0))
    names = pattern.names(m)
    window = int(m.get("sliding_window", 0))
    types = [SLIDING if k.startswith("sliding") else FULL for k in names]
    sliding = [i for i, t in enumerate(types) if t == SLIDING]
    act = {v: k for k, v in ACTIVATIONS.items()}[str(m.get("mlp_activation", "silu"))]
    out.update({
        "architectures": [CONVERTS[kind]], "model_type": kind,
        "vocab_size": int(m.vocab_size), "hidden_size": int(m.d_model),
        "intermediate_size": int(m.ffn_dim), "num_hidden_layers": int(m.num_layers),
        "num_attention_heads": int(m.num_heads), "num_key_value_heads": int(m.num_kv_heads),
        "head_dim": int(hd), "rms_norm_eps": float(m.norm_eps),
        "attention_dropout": 0.0, "tie_word_embeddings": bool(m.get("tie_embeddings", False)),
        "max_position_embeddings": max_pos, "torch_dtype": dtype, "use_cache": True})
    out["hidden_activation" if kind in GEMMA else "hidden_act"] = act
    if kind in GEMMA:
        local = float(m.get("local_rope_theta", 0.0) or 0.0)
        full = {"rope_type": "default", **(scaling or {}), "rope_theta": theta}
        if local or not scaling or "sliding" not in names:
            # the spelling every version reads: rope_scaling is the full layers' alone
            out.update(rope_theta=theta, rope_local_base_freq=local or theta, rope_scaling=scaling)
        else:  # the sliding layers take the full layers' scaled RoPE: only keyed says it
            out["rope_parameters"] = {FULL: full, SLIDING: dict(full)}
        scalar = float(m.get("query_pre_attn_scalar", 0.0) or 0.0) or hd
        cap = float(m.get("final_logit_softcap", 0.0) or 0.0)
        out.update(layer_types=types, query_pre_attn_scalar=int(scalar),
                   final_logit_softcapping=cap or None, attn_logit_softcapping=None,
                   use_bidirectional_attention=False, attention_bias=False,
                   # Gemma3TextModel builds the sliding mask whatever the layers: a window
                   # always (unused when no layer slides)
                   sliding_window=window or int(base.get("sliding_window") or 4096))
        # transformers before layer_types existed (4.50-4.52) reads every
        # sliding_window_pattern-th layer as full and the rest as sliding: written too where
        # the layers are that pattern
        every = [p for p in range(1, len(types) + 1)
                 if types == [FULL if (i + 1) % p == 0 else SLIDING for i in range(len(types))]]
        if every:
            out["sliding_window_pattern"] = every[0]
    else:
        out.update(rope_theta=theta, rope_scaling=scaling)
    if kind in ("qwen2", "qwen3", "qwen3_moe"):
        # their own switch; without a sliding layer sliding_window and max_window_layers stay
        # as imported (unused). With some, layer_types says which (Qwen3-MoE: every layer
        # slides), and max_window_layers too where they are the last ones (as transformers 4
        # reads it).
        out["use_sliding_window"] = bool(sliding)
        if sliding:
            suffix = sliding == list(range(sliding[0], len(types)))
            out.update(sliding_window=window, layer_types=types,
                       max_window_layers=sliding[0] if suffix else len(types))
            if kind == "qwen3_moe":  # its config has no layer_types
                del out["layer_types"]
        elif same_family:
            for key in ("sliding_window", "max_window_layers"):
                if key in base:
                    out[key] = base[key]
    elif kind in ("mistral", "mixtral"):
        out["sliding_window"] = window if sliding else None
    elif kind == "smollm3":
        out.update(no_rope_layers=[0 if k.endswith("_nope") else 1 for k in names],
                   use_sliding_window=bool(sliding), sliding_window=window if sliding else None,
                   layer_types=types)
    if kind in ("llama", "qwen3", "smollm3", "qwen3_moe", "olmoe"):  # their configs' own fields
        out["attention_bias"] = False
    if kind == "olmoe":
        # no head_dim field (hidden_size / heads: architecture checked it), no window
        # (OlmoeForCausalLM reads none), nothing clipped
        del out["head_dim"]
        out["clip_qkv"] = None
    if kind in MOE:
        e = m.moe
        width = int(e.get("expert_dim", 0) or m.ffn_dim)
        out.update(num_experts_per_tok=int(e.top_k), router_aux_loss_coef=float(e.aux_loss),
                   output_router_logits=False)
        if kind in GPT_OSS:  # num_local_experts; intermediate_size each expert's width
            out.update(num_local_experts=int(e.num_experts), intermediate_size=width,
                       swiglu_limit=float(e.glu_limit), swiglu_alpha=float(e.glu_alpha),
                       attention_bias=bool(m.get("qkv_bias", False)), layer_types=types,
                       # GptOssModel builds the sliding mask whatever the layers: a window
                       # always (unused when no layer slides)
                       sliding_window=window or int(base.get("sliding_window") or 128))
        elif kind == "mixtral":  # always renormalised; each expert's width is intermediate_size
            jitter = base.get("router_jitter_noise", 0.0) if same_family else 0.0
            out.update(num_local_experts=int(e.num_experts), intermediate_size=width,
                       router_jitter_noise=float(jitter or 0.0))
        elif kind == "olmoe":  # num_experts, intermediate_size each expert's width
            out.update(num_experts=int(e.num_experts), intermediate_size=width,
                       norm_topk_prob=_renormalized(m))
        else:  # num_experts: the key every transformers version reads (5.23 writes the other)
            # the dense layers: those the step leaves out, and the rest listed
            from model.flops import moe_layers
            every, moe_at = int(e.get("every", 1) or 1), moe_layers(m)
            out.update(num_experts=int(e.num_experts), moe_intermediate_size=width,
                       norm_topk_prob=_renormalized(m), decoder_sparse_step=every,
                       mlp_only_layers=[i for i in range(int(m.num_layers))
                                        if (i + 1) % every == 0 and i not in moe_at])
    if kind in ("llama", "smollm3"):
        out["mlp_bias"] = False
    if bos is not None:
        out["bos_token_id"] = bos
    imported_eos = out.get("eos_token_id")
    # Instruct models list every token that ends a reply (Llama 3: end of text, of message and
    # of turn); an imported list that holds the tokenizer's end-of-text token stays as it was.
    if eos is not None and not (isinstance(imported_eos, list) and eos in imported_eos):
        out["eos_token_id"] = eos
    return out
