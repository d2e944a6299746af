"""Loading a config file and applying ``field=value`` overrides, without importing jax.

For the scripts that take ``--config FILE`` outside ``train.py`` (whose absl flags do this):
the planner, the benchmarks and the layout comparison; and for the one-line messages of a
missing config file or an unknown field, in train.py and the scripts alike.
"""
from __future__ import annotations

import difflib
import importlib.util
import pathlib
import re
import sys

from errors import ConfigFileError  # also importable as configs.loading.ConfigFileError

ROOT = pathlib.Path(__file__).resolve().parent.parent


def load(path: str, overrides=()):
    """``get_config()`` of the file at ``path`` (relative paths from the repository root;
    ``FILE.py:ARG`` calls ``get_config(ARG)``, as train.py's flag does), with each
    ``"a.b=value"`` of ``overrides`` applied, typed like the field it replaces."""
    path, colon, argument = path.partition(".py:")
    file = resolve(path + ".py" if colon else path)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # configs import their base as ``configs.base``
    spec = importlib.util.spec_from_file_location(f"_config_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config(argument) if colon else module.get_config()
    return apply_overrides(config, overrides)


def apply_overrides(config, overrides=()):
    """``config`` with each ``"a.b=value"`` of ``overrides`` set, typed like the field it
    replaces (``set_field``)."""
    for item in overrides:
        dotted, eq, text = item.partition("=")
        if not eq:
            raise ConfigFileError(f"override {item!r} is not FIELD=VALUE (e.g. model.remat=full)")
        set_field(config, dotted, text)
    return config


def resolve(path: str) -> pathlib.Path:
    """The config file ``path`` names (a relative path from the working directory, else from
    the repository root); ConfigFileError naming the nearest config files when there is none."""
    file = pathlib.Path(path)
    if not file.is_absolute() and not file.is_file():
        file = ROOT / file
    if file.is_file():
        return file
    known = sorted(f"configs/{f.name}" for f in (ROOT / "configs").glob("*.py")
                   if re.search(r"^def get_config\(", f.read_text(), flags=re.M))
    # Compare stems: every path shares configs/ and .py, which would make any two names close.
    names = {pathlib.Path(k).stem: k for k in known}
    near = [names[n] for n in difflib.get_close_matches(file.stem, names, n=3, cutoff=0.5)]
    raise ConfigFileError(f"--config {path}: no such file; "
                          + (f"nearest: {', '.join(near)}" if near else f"configs: {', '.join(known)}"))


def field_names(config, prefix: str = "") -> list[str]:
    """Every field of ``config`` as a dotted path (``train.steps``), sections included."""
    names = []
    for key in config.keys():
        value, name = config[key], f"{prefix}{key}"
        names.append(name)
        if hasattr(value, "keys") and not isinstance(value, dict):  # a ConfigDict section
            names += field_names(value, name + ".")
    return names


def unknown_field(config, dotted: str) -> str | None:
    """None when ``config.<dotted>`` exists, else one line naming the nearest valid fields."""
    node = config
    for i, name in enumerate(dotted.split(".")):
        if not hasattr(node, "keys") or name not in node:
            where = ".".join(dotted.split(".")[:i])
            near = difflib.get_close_matches(dotted, field_names(config), n=3, cutoff=0.6)
            if not near:  # nothing close: the fields of the section it was looked up in
                keys = sorted(node.keys()) if hasattr(node, "keys") else []
                return (f"config.{dotted}: no such field; {'config.' + where if where else 'the config'} "
                        f"has: {', '.join(keys)}")
            return f"config.{dotted}: no such field; nearest: {', '.join(near)}"
        node = node[name]
    return None


def set_field(config, dotted: str, text: str) -> None:
    """Sets ``config.<dotted>`` from ``text``, converted to the type of the value it replaces."""
    missing = unknown_field(config, dotted)
    if missing:
        raise ConfigFileError(missing)
    *parents, leaf = dotted.split(".")
    node = config
    for name in parents:
        node = node[name]
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


def over_base(saved: dict):
    """A saved config (a run's ``config.json``) over configs/base.py: a run written before a
    field existed reads it at its default (e.g. train.loss_chunk)."""
    import ml_collections

    from configs import base
    config = base.get_config()

    def merge(into, values):
        for key, value in values.items():
            if isinstance(value, dict) and key in into and isinstance(into[key], ml_collections.ConfigDict):
                merge(into[key], value)
            else:
                with into.unlocked():
                    into[key] = value
    merge(config, saved)
    return config
