"""Hugging Face LLaMA / Mistral / Qwen2 / Qwen3 / Gemma 3 / SmolLM3 / Mixtral / Qwen3-MoE / OLMoE /
gpt-oss tensor names and shapes to this model's parameter tree, and back (Mistral's and SmolLM3's names
are LLaMA's; Mixtral's and Qwen3-MoE's attention is Mistral's and Qwen3's; OLMoE's names are
Qwen3-MoE's).

HF stores each projection as ``[out, in]`` per layer; here the layers are stacked on a leading
axis (lax.scan) and projections are ``[in, ...out]`` with heads split out:
``q_proj [H*hd, D] -> wq [L, D, H, hd]``, ``o_proj [D, H*hd] -> wo [L, H, hd, D]``. Both
spellings rotate the two halves of each head (``rotate_half``), so no row permutation is needed.
Qwen2's q/k/v biases (``model.qkv_bias``) split their heads out the same way:
``q_proj.bias [H*hd] -> bq [L, H, hd]``. Qwen3's and Gemma 3's q/k norms
(``self_attn.q_norm.weight [hd]``) are ``attn.q_norm.scale [L, hd]``; OLMoE's, over the whole
projection (``model.qk_norm_scope=projection``), ``q_norm.weight [H*hd]`` (hidden_size) and
``k_norm.weight [K*hd]``, are ``attn.q_norm.scale [L, H*hd]`` and ``attn.k_norm.scale [L, K*hd]``
(the projection's order: head by head). Gemma 3's four norms a
layer (``model.sandwich_norms``) are input_layernorm -> attn_norm, post_attention_layernorm ->
attn_post_norm, pre_feedforward_layernorm -> mlp_norm, post_feedforward_layernorm ->
mlp_post_norm (in LLaMA post_attention_layernorm is the MLP's pre-norm, mlp_norm); its norms
store w of the 1 + w they scale by, as ``model.norm_unit_offset`` does here: copied as they are.
A multimodal checkpoint (Gemma3ForConditionalGeneration) is read through ``language_model``: its
language model's tensors under the decoder's names, the rest left out and named.

A mixture of experts (``model.moe``: Mixtral, Qwen3-MoE, OLMoE) holds in the MLP slot ``router
[L, D, E]`` (HF's ``gate.weight [E, D]``, transposed) and ``w_gate``, ``w_up [L, E, D, F]``,
``w_down [L, E, F, D]``. Released checkpoints, and transformers 5.23's ``save_pretrained`` by
default, hold one tensor per expert: Mixtral ``block_sparse_moe.experts.{e}.w1/w3/w2.weight``
(gate, up, down) and ``block_sparse_moe.gate.weight``, Qwen3-MoE and OLMoE
``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`` and ``mlp.gate.weight``. transformers 5's
modules fuse them, and ``save_pretrained(save_original_format=False)`` writes them so (every
family under ``mlp.``): ``mlp.experts.gate_up_proj [E, 2F, D]`` (gate rows, then up rows) and
``mlp.experts.down_proj [E, D, F]``. Import reads any of these (``moe_layout`` finds which);
export writes the family's released per-expert names.

gpt-oss (``GptOssForCausalLM``) keeps its own names: ``self_attn.sinks [H]`` -> ``attn.sinks``,
``self_attn.o_proj.bias [D]`` -> ``attn.bo``, ``mlp.router.weight [E, D]`` and ``.bias [E]``
-> ``router`` (transposed) and ``router_bias``, ``mlp.experts.gate_up_proj [E, D, 2F]`` with
gate and up interleaved (gate ``[..., 0::2]``, up ``[..., 1::2]``) -> ``w_gate``, ``w_up``
[E, D, F] as they are, ``gate_up_proj_bias [E, 2F]`` -> ``b_gate``, ``b_up`` likewise,
``down_proj [E, F, D]`` -> ``w_down`` and ``down_proj_bias [E, D]`` -> ``b_down``.

Where only some layers are a mixture of experts (Qwen3-MoE's ``decoder_sparse_step`` and
``mlp_only_layers``: ``model.moe.every``, ``dense_layers``, ``first_dense``; model/flops.py
``moe_layers``), the MLPs are held apart from ``blocks``, one stack per kind: ``moe_mlp``
(``router``, ``w_gate``, ``w_up``, ``w_down``, [MoE layers, ...]) and ``dense_mlp``
(``w_gate``, ``w_up``, ``w_down`` [dense layers, ...]: a dense layer's ``mlp.gate_proj``,
``up_proj`` and ``down_proj``, transposed), each in layer order.
"""
from __future__ import annotations

import numpy as np

from errors import ConversionError
from model.flops import head_dim, moe_layers

LAYER = "model.layers.{i}."
# (our block path, HF name within a layer, kind): kind says how the matrix reshapes.
ATTENTION = (
    (("attn", "wq"), "self_attn.q_proj.weight", "in_heads"),
    (("attn", "wk"), "self_attn.k_proj.weight", "in_kv_heads"),
    (("attn", "wv"), "self_attn.v_proj.weight", "in_kv_heads"),
    (("attn", "wo"), "self_attn.o_proj.weight", "out_heads"),
)
MLP = (
    (("mlp", "w_gate"), "mlp.gate_proj.weight", "t"),
    (("mlp", "w_up"), "mlp.up_proj.weight", "t"),
    (("mlp", "w_down"), "mlp.down_proj.weight", "t"),
)
# A pre-norm block's two norms (LLaMA's names) ...
NORMS = (
    (("attn_norm", "scale"), "input_layernorm.weight", "vector"),
    (("mlp_norm", "scale"), "post_attention_layernorm.weight", "vector"),
)
# ... and model.sandwich_norms' four (Gemma's names: post_attention_layernorm is another norm).
SANDWICH_NORMS = (
    (("attn_norm", "scale"), "input_layernorm.weight", "vector"),
    (("attn_post_norm", "scale"), "post_attention_layernorm.weight", "vector"),
    (("mlp_norm", "scale"), "pre_feedforward_layernorm.weight", "vector"),
    (("mlp_post_norm", "scale"), "post_feedforward_layernorm.weight", "vector"),
)
# model.qk_norm (Qwen3, Gemma 3): an RMSNorm over each head's dims, one weight for all heads.
QK_NORMS = (
    (("attn", "q_norm", "scale"), "self_attn.q_norm.weight", "head_vector"),
    (("attn", "k_norm", "scale"), "self_attn.k_norm.weight", "head_vector"),
)
# ... with model.qk_norm_scope=projection (OLMoE): one over the whole q projection, one over k.
QK_NORMS_PROJECTION = (
    (("attn", "q_norm", "scale"), "self_attn.q_norm.weight", "q_vector"),
    (("attn", "k_norm", "scale"), "self_attn.k_norm.weight", "kv_vector"),
)
# The same for model.qkv_bias (Qwen2): biases on q, k and v, none on o.
BIASES = (
    (("attn", "bq"), "self_attn.q_proj.bias", "bias_heads"),
    (("attn", "bk"), "self_attn.k_proj.bias", "bias_kv_heads"),
    (("attn", "bv"), "self_attn.v_proj.bias", "bias_kv_heads"),
)
# gpt-oss (model.o_bias, model.attention_sinks): the o projection's bias and a logit per head.
O_BIAS = ((("attn", "bo"), "self_attn.o_proj.bias", "vector"),)
SINKS = ((("attn", "sinks"), "self_attn.sinks", "heads_vector"),)
# model.moe's tensors, by layout (``moe_layout``): the MLP slot's prefix within a layer, and the
# per-expert names of (gate, up, down), or None for transformers 5's fused experts. OLMoE's are
# Qwen3-MoE's.
MOE_LAYOUTS = {"mixtral": ("block_sparse_moe.", ("w1", "w3", "w2")),
               "qwen3_moe": ("mlp.", ("gate_proj", "up_proj", "down_proj")),
               "fused": ("mlp.", None),
               # GptOssForCausalLM's own (released and saved alike): ``_GPT_OSS``
               "gpt_oss": ("mlp.", None)}
# gpt-oss's MLP slot within a layer: the router with its bias, and the fused experts with
# theirs, gate and up interleaved along the last axis (gate [..., 0::2], up [..., 1::2]) and
# stored [in, out] (x @ W[e]), unlike the other families' fused [E, out, in]. Its released
# checkpoints hold the two matrices as MXFP4 (hf/mxfp4.py: dequantized before they get here).
_GPT_OSS = ("router.weight", "router.bias", "experts.gate_up_proj", "experts.gate_up_proj_bias",
            "experts.down_proj", "experts.down_proj_bias")
# Buffers some checkpoints carry that hold no parameter (RoPE tables are recomputed).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Where a multimodal checkpoint keeps its language model: (prefix of the decoder's "model."
# tensors, name of its head), as transformers 5 saves it and as released checkpoints
# (transformers 4.50-4.51) have it.
LANGUAGE_MODEL = (("model.language_model.", "lm_head.weight"),
                  ("language_model.model.", "language_model.lm_head.weight"))
# What the rest of a multimodal checkpoint is, by the prefix of its names.
OTHER_PARTS = {"vision_tower": "the vision tower", "multi_modal_projector": "the image projector",
               "audio_tower": "the audio tower", "embed_vision": "the vision embedder",
               "embed_audio": "the audio embedder"}


def _block(m):
    """(our path, HF name, kind) of every per-layer tensor of model config ``m`` (a mixture of
    experts' MLP slot apart: ``_moe_shapes``)."""
    return (ATTENTION + (() if _experts(m) else MLP)
            + (SANDWICH_NORMS if m.get("sandwich_norms", False) else NORMS)
            + (_qk_norms(m) if m.get("qk_norm", False) else ())
            + (BIASES if m.get("qkv_bias", False) else ())
            + (O_BIAS if m.get("o_bias", False) else ())
            + (SINKS if m.get("attention_sinks", False) else ()))


def _qk_norms(m):
    projection = str(m.get("qk_norm_scope", "head")) == "projection"
    return QK_NORMS_PROJECTION if projection else QK_NORMS


def _to_ours(w, kind: str, m):
    hd = head_dim(m)
    if kind == "in_heads":
        return w.T.reshape(m.d_model, m.num_heads, hd)
    if kind == "in_kv_heads":
        return w.T.reshape(m.d_model, m.num_kv_heads, hd)
    if kind == "out_heads":
        return w.T.reshape(m.num_heads, hd, m.d_model)
    if kind == "bias_heads":
        return w.reshape(m.num_heads, hd)
    if kind == "bias_kv_heads":
        return w.reshape(m.num_kv_heads, hd)
    return w.T if kind == "t" else w


def _to_hf(w, kind: str):
    if kind in ("in_heads", "in_kv_heads"):
        return w.reshape(w.shape[0], -1).T
    if kind == "out_heads":
        return w.reshape(-1, w.shape[-1]).T
    if kind in ("bias_heads", "bias_kv_heads"):
        return w.reshape(-1)
    return w.T if kind == "t" else w


def _experts(m) -> int:
    moe = m.get("moe", None)
    return int(moe.get("num_experts", 0) or 0) if moe is not None else 0


def moe_layout(m, tensors=None) -> str | None:
    """Which of ``MOE_LAYOUTS`` a mixture of experts ``m`` reads from ``tensors`` (the first
    layer's names say) or writes (``tensors`` None: the family's released names, Qwen3-MoE's
    (OLMoE's too) with q/k norms, else Mixtral's, as hf/config.py ``architecture`` picks); None
    for a dense model."""
    if not _experts(m):
        return None
    if m.get("attention_sinks", False):  # one layout (hf/config.py: sinks are gpt-oss's)
        return "gpt_oss"
    family = "qwen3_moe" if m.get("qk_norm", False) else "mixtral"
    if tensors is None:
        return family
    first = LAYER.format(i=moe_layers(m)[0])
    for layout, (prefix, names) in MOE_LAYOUTS.items():
        probe = prefix + ("experts.gate_up_proj" if names is None
                          else f"experts.0.{names[0]}.weight")
        if first + probe in tensors:
            return layout
    return family  # check_names says what is missing


def _moe_shapes(m, layout: str) -> dict[str, tuple[int, ...]]:
    """The HF names within a layer of a mixture of experts in ``layout``, with their shapes."""
    E, d = _experts(m), m.d_model
    f = int(m.moe.get("expert_dim", 0) or m.ffn_dim)
    prefix, names = MOE_LAYOUTS[layout]
    if layout == "gpt_oss":
        return dict(zip((prefix + n for n in _GPT_OSS),
                        ((E, d), (E,), (E, d, 2 * f), (E, 2 * f), (E, f, d), (E, d))))
    out = {prefix + "gate.weight": (E, d)}
    if names is None:
        out.update({prefix + "experts.gate_up_proj": (E, 2 * f, d),
                    prefix + "experts.down_proj": (E, d, f)})
        return out
    gate, up, down = names
    for e in range(E):
        out.update({f"{prefix}experts.{e}.{gate}.weight": (f, d),
                    f"{prefix}experts.{e}.{up}.weight": (f, d),
                    f"{prefix}experts.{e}.{down}.weight": (d, f)})
    return out


def _moe_to_ours(tensors, m, layout: str, i: int) -> dict[str, np.ndarray]:
    """Layer ``i``'s router and experts as this model holds them (one layer of
    ``blocks/mlp``)."""
    at = LAYER.format(i=i) + MOE_LAYOUTS[layout][0]
    names = MOE_LAYOUTS[layout][1]
    if layout == "gpt_oss":
        router, bias, gate_up, gate_up_bias, down, down_bias = (
            np.asarray(tensors[at + n]) for n in _GPT_OSS)
        return {"router": router.T, "router_bias": bias,
                "w_gate": gate_up[..., 0::2], "w_up": gate_up[..., 1::2], "w_down": down,
                "b_gate": gate_up_bias[..., 0::2], "b_up": gate_up_bias[..., 1::2],
                "b_down": down_bias}
    out = {"router": np.asarray(tensors[at + "gate.weight"]).T}
    if names is None:
        gate_up = np.asarray(tensors[at + "experts.gate_up_proj"])  # [E, 2F, D]
        f = gate_up.shape[1] // 2
        out.update(w_gate=gate_up[:, :f].transpose(0, 2, 1), w_up=gate_up[:, f:].transpose(0, 2, 1),
                   w_down=np.asarray(tensors[at + "experts.down_proj"]).transpose(0, 2, 1))
        return out
    for ours, name in zip(("w_gate", "w_up", "w_down"), names):
        out[ours] = np.stack([np.asarray(tensors[f"{at}experts.{e}.{name}.weight"]).T
                              for e in range(_experts(m))])
    return out


def _moe_to_hf(mlp: dict, m, i: int, j: int) -> dict[str, np.ndarray]:
    """Layer ``i``'s router and experts (``mlp``'s ``j``-th) under the family's released
    names."""
    layout = moe_layout(m)
    prefix, names = MOE_LAYOUTS[layout]
    at = LAYER.format(i=i) + prefix
    if layout == "gpt_oss":
        def interleave(gate, up):  # [..., F] each -> [..., 2F], gate first in each pair
            return np.stack([np.asarray(gate), np.asarray(up)], axis=-1).reshape(
                *np.shape(gate)[:-1], -1)
        layer = {k: v[j] for k, v in mlp.items()}
        return dict(zip((at + n for n in _GPT_OSS), (
            np.asarray(layer["router"]).T, layer["router_bias"],
            interleave(layer["w_gate"], layer["w_up"]), interleave(layer["b_gate"], layer["b_up"]),
            layer["w_down"], layer["b_down"])))
    out = {at + "gate.weight": np.asarray(mlp["router"][j]).T}
    for e in range(_experts(m)):
        for ours, name in zip(("w_gate", "w_up", "w_down"), names):
            out[f"{at}experts.{e}.{name}.weight"] = np.asarray(mlp[ours][j][e]).T
    return out


def _mixed(m) -> bool:
    """Whether only some of ``m``'s layers are a mixture of experts (the MLPs held apart)."""
    return _experts(m) > 0 and len(moe_layers(m)) < m.num_layers


def _dense_layers(m) -> list[int]:
    """The layers of a mixture of experts ``m`` that hold the dense MLP."""
    moe_at = set(moe_layers(m))
    return [i for i in range(m.num_layers) if i not in moe_at]


def _expected(m, layout: str | None = None) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name of model config ``m`` with its shape (a mixture of experts' in
    ``layout``, by default the family's released names)."""
    hd, d, f = head_dim(m), m.d_model, m.ffn_dim
    shapes = {"in_heads": (m.num_heads * hd, d), "in_kv_heads": (m.num_kv_heads * hd, d),
              "out_heads": (d, m.num_heads * hd), "vector": (d,), "head_vector": (hd,),
              "q_vector": (m.num_heads * hd,), "kv_vector": (m.num_kv_heads * hd,),
              "bias_heads": (m.num_heads * hd,), "bias_kv_heads": (m.num_kv_heads * hd,),
              "heads_vector": (m.num_heads,)}
    mlp = {"mlp.gate_proj.weight": (f, d), "mlp.up_proj.weight": (f, d),
           "mlp.down_proj.weight": (d, f)}
    per_layer = {name: mlp[name] if kind == "t" else shapes[kind] for _, name, kind in _block(m)}
    experts = _moe_shapes(m, layout or moe_layout(m)) if _experts(m) else {}
    out = {"model.embed_tokens.weight": (m.vocab_size, d), "model.norm.weight": (d,)}
    if not m.get("tie_embeddings", False):
        out["lm_head.weight"] = (m.vocab_size, d)
    dense = set(_dense_layers(m)) if _experts(m) else set()
    for i in range(m.num_layers):
        layer = {**per_layer, **(mlp if i in dense else experts)}
        out.update({LAYER.format(i=i) + k: v for k, v in layer.items()})
    return out


def check_names(tensors, m):
    """Every tensor the model needs is there with its shape, and nothing it cannot hold."""
    expected = _expected(m, moe_layout(m, tensors))
    for name, shape in expected.items():
        if name not in tensors:
            raise ConversionError(f"the checkpoint has no tensor {name}, which this config needs")
        got = tuple(tensors[name].shape)
        if got != shape:
            raise ConversionError(f"tensor {name} has shape {got}, but config.json implies {shape}")
    extra = [n for n in tensors.names() if n not in expected and not n.endswith(IGNORED_SUFFIXES)]
    # A tied checkpoint may still store the head; it must then equal the table.
    if "lm_head.weight" in extra and m.get("tie_embeddings", False):
        extra.remove("lm_head.weight")
    if extra:
        raise ConversionError(f"the checkpoint has tensors this model cannot hold, e.g. {extra[0]} "
                              f"({len(extra)} in all): biases or another architecture")


class _Renamed:
    """A checkpoint's tensors under other names (ours -> theirs), as hf/safetensors.Tensors
    serves them."""

    def __init__(self, tensors, names: dict[str, str]):
        self.tensors, self.map = tensors, names

    def names(self) -> list[str]:
        return list(self.map)

    def __contains__(self, name: str) -> bool:
        return name in self.map

    def __getitem__(self, name: str) -> np.ndarray:
        return self.tensors[self.map[name]]


def language_model(tensors, architecture: str = "the multimodal model"):
    """(tensors, None) for a decoder's checkpoint; for a multimodal one (its language model
    under ``model.language_model.`` or ``language_model.model.``) (the language model's tensors
    under the decoder's names, one line naming what is left out: the vision tower and projector
    by the prefix of their names, with their tensor counts)."""
    names = tensors.names()
    if "model.embed_tokens.weight" in tensors:
        return tensors, None
    for prefix, head in LANGUAGE_MODEL:
        if prefix + "embed_tokens.weight" in tensors:
            break
    else:
        return tensors, None  # check_names says what is missing
    ours, rest = {}, {}
    for name in names:
        if name.startswith(prefix):
            ours["model." + name[len(prefix):]] = name
        elif name == head:
            ours["lm_head.weight"] = name
        else:
            parts = name.split(".")
            key = ".".join(parts[:2] if parts[0] == "model" and len(parts) > 2 else parts[:1])
            rest[key] = rest.get(key, 0) + 1
    said = [f"{key}.* ({n} tensors, {OTHER_PARTS.get(key.split('.')[-1], 'not the decoder')})"
            for key, n in rest.items()]
    line = (f"{architecture}: the language model alone is imported (it exports as a decoder); "
            f"left out: {', '.join(said) if said else 'nothing else'}")
    return _Renamed(tensors, ours), line


def _get(tree: dict, path: tuple):
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: dict, path: tuple, value):
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def params_from_hf(tensors, m, dtype=None) -> dict:
    """Our parameter tree (numpy, in ``dtype`` or the checkpoint's own) from HF tensors."""
    check_names(tensors, m)
    cast = (lambda a: a) if dtype is None else (lambda a: a.astype(dtype))
    blocks: dict = {}
    for path, hf_name, kind in _block(m):
        layers = [_to_ours(tensors[LAYER.format(i=i) + hf_name], kind, m)
                  for i in range(m.num_layers)]
        _set(blocks, path, cast(np.stack(layers)))
    params = {"blocks": blocks, "embed": cast(np.asarray(tensors["model.embed_tokens.weight"])),
              "final_norm": {"scale": cast(np.asarray(tensors["model.norm.weight"]))}}
    if _experts(m):
        layout = moe_layout(m, tensors)
        layers = [_moe_to_ours(tensors, m, layout, i) for i in moe_layers(m)]
        experts = {k: cast(np.stack([layer[k] for layer in layers])) for k in layers[0]}
        if _mixed(m):  # the MLPs apart from the blocks, one stack per kind
            params["moe_mlp"] = experts
            params["dense_mlp"] = {}
            for path, hf_name, kind in MLP:
                _set(params["dense_mlp"], path[1:], cast(np.stack(
                    [_to_ours(tensors[LAYER.format(i=i) + hf_name], kind, m)
                     for i in _dense_layers(m)])))
        else:
            blocks["mlp"] = experts
    if not m.get("tie_embeddings", False):
        params["head"] = cast(np.asarray(tensors["lm_head.weight"]).T)
    return params


def hf_from_params(params: dict, m, dtype) -> dict[str, np.ndarray]:
    """HF tensors (name -> ``dtype`` array, in HF's usual order) from our parameter tree."""
    out = {"model.embed_tokens.weight": params["embed"]}
    moe_at, dense = (moe_layers(m), _dense_layers(m)) if _experts(m) else ((), ())
    experts = params["moe_mlp"] if _mixed(m) else params["blocks"].get("mlp")
    for i in range(m.num_layers):
        for path, hf_name, kind in _block(m):
            out[LAYER.format(i=i) + hf_name] = _to_hf(_get(params["blocks"], path)[i], kind)
        if i in dense:  # a mixed model's dense layer: its MLP from the dense stack
            for path, hf_name, kind in MLP:
                out[LAYER.format(i=i) + hf_name] = _to_hf(
                    _get(params["dense_mlp"], path[1:])[dense.index(i)], kind)
        elif _experts(m):
            out.update(_moe_to_hf(experts, m, i, moe_at.index(i)))
    out["model.norm.weight"] = params["final_norm"]["scale"]
    if not m.get("tie_embeddings", False):
        out["lm_head.weight"] = params["head"].T
    return {k: np.ascontiguousarray(np.asarray(v).astype(dtype)) for k, v in out.items()}
