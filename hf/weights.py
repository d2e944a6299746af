"""Hugging Face LLaMA / Mistral / Qwen2 tensor names and shapes to this model's parameter tree,
and back (Mistral's names are LLaMA's).

HF stores each projection as ``[out, in]`` per layer; here the layers are stacked on a leading
axis (lax.scan) and projections are ``[in, ...out]`` with heads split out:
``q_proj [H*hd, D] -> wq [L, D, H, hd]``, ``o_proj [D, H*hd] -> wo [L, H, hd, D]``. Both
spellings rotate the two halves of each head (``rotate_half``), so no row permutation is needed.
Qwen2's q/k/v biases (``model.qkv_bias``) split their heads out the same way:
``q_proj.bias [H*hd] -> bq [L, H, hd]``.
"""
from __future__ import annotations

import numpy as np

from errors import ConversionError

LAYER = "model.layers.{i}."
# (our block path, HF name within a layer, kind): kind says how the matrix reshapes.
BLOCK = (
    (("attn", "wq"), "self_attn.q_proj.weight", "in_heads"),
    (("attn", "wk"), "self_attn.k_proj.weight", "in_kv_heads"),
    (("attn", "wv"), "self_attn.v_proj.weight", "in_kv_heads"),
    (("attn", "wo"), "self_attn.o_proj.weight", "out_heads"),
    (("mlp", "w_gate"), "mlp.gate_proj.weight", "t"),
    (("mlp", "w_up"), "mlp.up_proj.weight", "t"),
    (("mlp", "w_down"), "mlp.down_proj.weight", "t"),
    (("attn_norm", "scale"), "input_layernorm.weight", "vector"),
    (("mlp_norm", "scale"), "post_attention_layernorm.weight", "vector"),
)
# The same for model.qkv_bias (Qwen2): biases on q, k and v, none on o.
BIASES = (
    (("attn", "bq"), "self_attn.q_proj.bias", "bias_heads"),
    (("attn", "bk"), "self_attn.k_proj.bias", "bias_kv_heads"),
    (("attn", "bv"), "self_attn.v_proj.bias", "bias_kv_heads"),
)
# Buffers some checkpoints carry that hold no parameter (RoPE tables are recomputed).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _head_dim(m) -> int:
    return m.head_dim or m.d_model // m.num_heads


def _block(m):
    """(our path, HF name, kind) of every per-layer tensor of model config ``m``."""
    return BLOCK + (BIASES if m.get("qkv_bias", False) else ())


def _to_ours(w, kind: str, m):
    hd = _head_dim(m)
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


def _expected(m) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name of model config ``m`` with its shape."""
    hd, d = _head_dim(m), m.d_model
    per_layer = {"self_attn.q_proj.weight": (m.num_heads * hd, d),
                 "self_attn.k_proj.weight": (m.num_kv_heads * hd, d),
                 "self_attn.v_proj.weight": (m.num_kv_heads * hd, d),
                 "self_attn.o_proj.weight": (d, m.num_heads * hd),
                 "mlp.gate_proj.weight": (m.ffn_dim, d), "mlp.up_proj.weight": (m.ffn_dim, d),
                 "mlp.down_proj.weight": (d, m.ffn_dim),
                 "input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,)}
    if m.get("qkv_bias", False):
        per_layer.update({"self_attn.q_proj.bias": (m.num_heads * hd,),
                          "self_attn.k_proj.bias": (m.num_kv_heads * hd,),
                          "self_attn.v_proj.bias": (m.num_kv_heads * hd,)})
    out = {"model.embed_tokens.weight": (m.vocab_size, d), "model.norm.weight": (d,)}
    if not m.get("tie_embeddings", False):
        out["lm_head.weight"] = (m.vocab_size, d)
    for i in range(m.num_layers):
        out.update({LAYER.format(i=i) + k: v for k, v in per_layer.items()})
    return out


def check_names(tensors, m):
    """Every tensor the model needs is there with its shape, and nothing it cannot hold."""
    expected = _expected(m)
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


def params_from_hf(tensors, m, dtype=None) -> dict:
    """Our parameter tree (numpy, in ``dtype`` or the checkpoint's own) from HF tensors."""
    check_names(tensors, m)
    cast = (lambda a: a) if dtype is None else (lambda a: a.astype(dtype))
    blocks: dict = {}
    for path, hf_name, kind in _block(m):
        layers = [_to_ours(tensors[LAYER.format(i=i) + hf_name], kind, m)
                  for i in range(m.num_layers)]
        blocks.setdefault(path[0], {})[path[1]] = cast(np.stack(layers))
    params = {"blocks": blocks, "embed": cast(np.asarray(tensors["model.embed_tokens.weight"])),
              "final_norm": {"scale": cast(np.asarray(tensors["model.norm.weight"]))}}
    if not m.get("tie_embeddings", False):
        params["head"] = cast(np.asarray(tensors["lm_head.weight"]).T)
    return params


def hf_from_params(params: dict, m, dtype) -> dict[str, np.ndarray]:
    """HF tensors (name -> ``dtype`` array, in HF's usual order) from our parameter tree."""
    out = {"model.embed_tokens.weight": params["embed"]}
    for i in range(m.num_layers):
        for path, hf_name, kind in _block(m):
            out[LAYER.format(i=i) + hf_name] = _to_hf(params["blocks"][path[0]][path[1]][i], kind)
    out["model.norm.weight"] = params["final_norm"]["scale"]
    if not m.get("tie_embeddings", False):
        out["lm_head.weight"] = params["head"].T
    return {k: np.ascontiguousarray(np.asarray(v).astype(dtype)) for k, v in out.items()}
