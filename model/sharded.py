"""A config's model on a mesh, without an optimizer: its structure (graphdef), its abstract
parameters with their shardings, and the batch's shardings (and its LoRA adapters' counts).
The trainer (training/state.py) builds its state around one; what reads a trained run
(evaluation/: the lm_eval model, the KV cache, the scorer) needs nothing more, so it never
imports training/."""
from __future__ import annotations

import math

import jax
from flax import nnx

from model import lora as lora_lib
from model.decoder import AttentionBackend, Decoder, backend_from_config
from model.flops import matmul_params
from parallel.mesh import batch_sharding, param_shardings

BATCH_KEYS = ("tokens", "labels", "positions", "segment_ids", "loss_mask")


class ShardedModel:
    """``graphdef``, ``abstract_params`` (ShapeDtypeStructs carrying their shardings: what
    checkpoints/rundir.Run.restore_params restores into), ``param_shardings``,
    ``batch_shardings`` and the attention ``backend`` of ``config`` on ``mesh``."""

    def __init__(self, config, mesh):
        self.config, self.mesh = config, mesh
        self.backend = backend_from_config(config, mesh)
        self.lora = lora_lib.spec_of(config)  # LoRA adapters (model/lora.py), or None
        abstract_model = nnx.eval_shape(lambda: Decoder(config.model, self.backend, nnx.Rngs(0),
                                                        self.lora))
        self.graphdef, self.abstract_state = nnx.split(abstract_model, nnx.Param)
        self.param_shardings = nnx.to_pure_dict(param_shardings(self.abstract_state, mesh))
        self.batch_shardings = {k: batch_sharding(mesh) for k in BATCH_KEYS}
        self.abstract_params = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            nnx.to_pure_dict(self.abstract_state), self.param_shardings)


def lora_counts(config) -> dict | None:
    """The run's adapters (``rank``, ``targets``) and parameter counts under them, from the
    model's shapes alone (no weights): ``adapters``, ``trained`` (adapters and
    modules_to_save), ``frozen``, and ``frozen_matmul`` (matmul weights whose own gradient the
    backward never computes: the planner's step time); None without adapters."""
    spec = lora_lib.spec_of(config)
    if spec is None:
        return None
    m = config.model
    tied = bool(m.get("tie_embeddings", False))
    abstract = nnx.to_pure_dict(nnx.state(nnx.eval_shape(
        lambda: Decoder(m, AttentionBackend(), nnx.Rngs(0), spec)), nnx.Param))
    trained, frozen = lora_lib.split(abstract, lora_lib.trained_mask(abstract, spec, tied))
    size = lambda tree: sum(math.prod(a.shape) for a in jax.tree.leaves(tree))  # noqa: E731
    head_trains = "lm_head" in spec.modules_to_save or (tied and "embed_tokens" in
                                                         spec.modules_to_save)
    return {"rank": spec.rank, "targets": list(spec.targets),
            "adapters": size(lora_lib.adapters_only(abstract)), "trained": size(trained),
            "frozen": size(frozen),
            "frozen_matmul": matmul_params(m) - (m.vocab_size * m.d_model if head_trains else 0)}
