"""A run directory's own config, to continue from its weights: an import or a train.py run.

Run:  python train.py --config configs/from_run.py:RUN_DIR --workdir runs/next [--config.a.b=v ...]
(RUN_DIR: an import's --out, see scripts/convert_hf.py, or a train.py --workdir.)
Shows: "starting from the weights of step N", then training from those weights with the run's
model (shapes, RoPE, tied head), tokenizer and settings; a fresh optimizer and data order.
Every field can still be overridden (a new seq_len, mesh, rope_theta, learning rate).
"""
import json
import pathlib

from configs.loading import over_base
from errors import ConfigFileError


def from_run(run_dir: str):
    """The config saved in ``run_dir``, set to start from its newest weights."""
    d = pathlib.Path(run_dir or "").expanduser().absolute()
    if not run_dir or not (d / "config.json").is_file():
        raise ConfigFileError(f"configs/from_run.py:{run_dir}: not a run directory (no "
                              f"config.json); give an import's --out or a train.py --workdir")
    config = over_base(json.loads((d / "config.json").read_text()))
    config.checkpoint.restore_from = str(d)
    config.checkpoint.restore_weights_only = True
    if (d / "tokenizer.json").is_file():
        config.data.tokenizer = str(d / "tokenizer.json")
    return config


def get_config(run_dir: str = ""):
    return from_run(run_dir)
