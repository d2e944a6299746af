"""Does a checkpoint fit this run? Model shape and tokenizer, checked before any array is read.

A mismatch is the user's to fix (another config, another --workdir), so it stops the run with
one line naming the field, never a trace from deep inside orbax.
"""
from __future__ import annotations

import pathlib

import jax

from errors import CheckpointError  # also importable as checkpoints.compat.CheckpointError

# The model fields that decide parameter shapes; anything else (rope_theta, remat, dtype, ...)
# may change between runs sharing weights.
SHAPE_FIELDS = ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                "ffn_dim", "tie_embeddings", "qkv_bias")


def _resolved(model: dict) -> dict:
    out = {f: model.get(f) for f in SHAPE_FIELDS}
    if not out["head_dim"] and out["d_model"] and out["num_heads"]:
        out["head_dim"] = out["d_model"] // out["num_heads"]
    return out


def model_mismatch(stored_model: dict, model) -> str | None:
    """"model.a=x in the checkpoint but y now, ..." for shape fields that differ, else None."""
    old, new = _resolved(dict(stored_model)), _resolved({f: model.get(f) for f in SHAPE_FIELDS})
    diffs = [f"model.{f}={old[f]} in the checkpoint but {new[f]} now"
             for f in SHAPE_FIELDS if old[f] is not None and old[f] != new[f]]
    return ", ".join(diffs) or None


def checker(config, fingerprint: str, *, check_tokenizer: bool = True):
    """A ``check(meta, step, path)`` for Checkpoints.restore*: the stored config's model shape
    and tokenizer fingerprint against this run's."""

    def check(meta: dict, step: int, path: pathlib.Path):
        stored_config = meta.get("config") or {}
        if "model" in stored_config:
            diff = model_mismatch(stored_config["model"], config.model)
            if diff:
                raise CheckpointError(
                    f"checkpoint step {step} ({path}) has another model shape: {diff}; use the "
                    f"checkpoint's model settings or a new --workdir")
        stored_fp = meta.get("tokenizer")
        if check_tokenizer and stored_fp and stored_fp != fingerprint:
            raise CheckpointError(
                f"checkpoint step {step} ({path}) was trained with tokenizer {stored_fp}, but "
                f"this config gives {fingerprint}; use the same data.tokenizer / data.source / "
                f"data.max_docs / model.vocab_size")

    return check


def check_param_shapes(stored_tree, abstract_params, path: pathlib.Path):
    """Every parameter this model has exists in the checkpoint with the same shape; catches
    checkpoints without run metadata and any shape the config fields do not name."""
    stored = dict(jax.tree_util.tree_flatten_with_path(
        stored_tree, is_leaf=lambda x: hasattr(x, "shape"))[0])
    stored = {jax.tree_util.keystr(k): v for k, v in stored.items()}
    for keypath, want in jax.tree_util.tree_flatten_with_path(abstract_params)[0]:
        name = jax.tree_util.keystr(keypath)
        got = stored.get(name)
        if got is None:
            raise CheckpointError(f"checkpoint {path} has no parameter {name}: it is from "
                                  f"another model; use its model settings or a new --workdir")
        if tuple(got.shape) != tuple(want.shape):
            raise CheckpointError(
                f"checkpoint {path} has parameter {name} of shape {tuple(got.shape)} but this "
                f"model's is {tuple(want.shape)}; use the checkpoint's model settings or a new "
                f"--workdir")
