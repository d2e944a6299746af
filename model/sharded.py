"""A config's model on a mesh, without an optimizer: its structure (graphdef), its abstract
parameters with their shardings, and the batch's shardings. The trainer (training/state.py)
builds its state around one; what reads a trained run (evaluation/: the lm_eval model, the KV
cache, the scorer) needs nothing more, so it never imports training/."""
from __future__ import annotations

import jax
from flax import nnx

from model import lora as lora_lib
from model.decoder import Decoder, backend_from_config
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
