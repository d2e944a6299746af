"""A run directory's own config, to continue from its weights: an import or a train.py run.

Run:  python train.py --config configs/from_run.py:RUN_DIR --workdir runs/next [--config.a.b=v ...]
(RUN_DIR: an import's --out, see scripts/convert_hf.py, or a train.py --workdir.)
Shows: "starting from the weights of step N", then training from those weights with the run's
model (shapes, RoPE, tied head, biases), tokenizer and settings; a fresh optimizer and data order.
Every field can still be overridden (a new seq_len, mesh, rope_theta, learning rate).
"""
import json
import pathlib

from configs.loading import over_base
from errors import ConfigFileError


# The model fields that describe the weights themselves (shapes, norms, RoPE, head): another
# config starting from a run takes these from it and keeps its own for the rest (remat, ...).
WEIGHT_FIELDS = ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                 "ffn_dim", "norm_eps", "rope_theta", "rope_scaling", "tie_embeddings", "qkv_bias")


def from_run(run_dir: str, who: str = "configs/from_run.py"):
    """The config saved in ``run_dir``, set to start from its newest weights."""
    d = pathlib.Path(run_dir or "").expanduser().absolute()
    if not run_dir or not (d / "config.json").is_file():
        raise ConfigFileError(f"{who}:{run_dir}: not a run directory (no config.json); give an "
                              f"import's --out or a train.py --workdir")
    config = over_base(json.loads((d / "config.json").read_text()))
    config.checkpoint.restore_from = str(d)
    config.checkpoint.restore_weights_only = True
    if (d / "tokenizer.json").is_file():
        config.data.tokenizer = str(d / "tokenizer.json")
    return config


def start_from(config, run_dir: str, who: str):
    """``config`` set to start from ``run_dir``'s weights: its model (WEIGHT_FIELDS), its
    tokenizer, a weights-only restore; everything else stays ``config``'s."""
    run = from_run(run_dir, who)
    for field in WEIGHT_FIELDS:
        config.model[field] = run.model[field]
    config.data.tokenizer = run.data.tokenizer
    config.checkpoint.update(restore_from=run.checkpoint.restore_from, restore_weights_only=True)
    return config


def get_config(run_dir: str = ""):
    return from_run(run_dir)
