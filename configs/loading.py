"""Loading a config file and applying ``field=value`` overrides, without importing jax.

For the scripts that take ``--config FILE`` outside ``train.py`` (whose absl flags do this):
the planner, the benchmarks and the layout comparison.
"""
from __future__ import annotations

import importlib.util
import pathlib
import sys

from errors import ConfigFileError  # also importable as configs.loading.ConfigFileError

ROOT = pathlib.Path(__file__).resolve().parent.parent


def load(path: str, overrides=()):
    """``get_config()`` of the file at ``path`` (relative paths from the repository root),
    with each ``"a.b=value"`` of ``overrides`` applied, typed like the field it replaces."""
    file = pathlib.Path(path)
    if not file.is_absolute() and not file.is_file():
        file = ROOT / file
    if not file.is_file():
        raise ConfigFileError(f"--config {path}: no such file")
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # configs import their base as ``configs.base``
    spec = importlib.util.spec_from_file_location(f"_config_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    for item in overrides:
        dotted, eq, text = item.partition("=")
        if not eq:
            raise ConfigFileError(f"override {item!r} is not FIELD=VALUE (e.g. model.remat=full)")
        set_field(config, dotted, text)
    return config


def set_field(config, dotted: str, text: str) -> None:
    """Sets ``config.<dotted>`` from ``text``, converted to the type of the value it replaces."""
    *parents, leaf = dotted.split(".")
    node = config
    for name in parents:
        if name not in node:
            raise ConfigFileError(f"config.{dotted}: no field {name!r} in the config")
        node = node[name]
    if leaf not in node:
        raise ConfigFileError(f"config.{dotted}: no such field")
    old = node[leaf]
    try:
        if isinstance(old, bool):
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            value = text.lower() in ("true", "1")
        elif isinstance(old, int):
            value = int(text)
        elif isinstance(old, float):
            value = float(text)
        else:
            value = text
    except ValueError:
        raise ConfigFileError(f"config.{dotted}={text!r}: expected a {type(old).__name__}") from None
    node[leaf] = value
