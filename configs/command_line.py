"""train.py's command line before jax starts: a user's mistake is one line and exit code 2
(a config file that does not exist, an override of a field the config does not have, a value
of the wrong type), like the user errors of training/entry.py, not an ml_collections trace."""
from __future__ import annotations

import re
import sys

from configs.loading import load, unknown_field
from errors import ConfigFileError


def check_argv(argv: list[str], name: str, default: str) -> None:
    """Exits with one line when ``--<name> FILE`` names no file or a ``--<name>.a.b=v`` no
    field. Runs before ``DEFINE_config_file``, which already reads sys.argv to apply the
    overrides (its KeyError would be a trace); our own loader names the nearest valid ones."""
    problem = diagnose(argv[1:], name, default)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)


def parse_flags(argv: list[str], config_flag) -> list[str]:
    """``absl.flags.FLAGS(argv)`` for ``app.run(flags_parser=...)``: any other parse error (a
    value of the wrong type, an unknown flag) as one line; ``config_flag`` is the
    DEFINE_config_file holder, touched here since ml_collections defers a load failure."""
    from absl import flags
    try:
        rest = flags.FLAGS(argv)
        config_flag.value.keys()
        return rest
    except Exception as e:  # ml_collections raises KeyError/AttributeError/OSError, absl its own
        default = flags.FLAGS[config_flag.name].default_as_str.strip("'\"")
        problem = diagnose(argv[1:], config_flag.name, default) or _first_line(e)
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)


def diagnose(args: list[str], name: str, default: str) -> str | None:
    """The missing config file or the first unknown field overridden, as one line; None when
    both are fine."""
    path, overrides = _config_args(args, name)
    path = path or default
    try:
        config = load(path)
    except ConfigFileError as e:
        return str(e)
    except Exception as e:  # the file exists but does not run: its own error, one line
        return f"--config {path}: cannot load it: {type(e).__name__}: {_first_line(e)}"
    for dotted in overrides:
        missing = unknown_field(config, dotted)
        if missing:
            return f"--{missing}"
    return None


def _config_args(args: list[str], name: str) -> tuple[str | None, list[str]]:
    """The config file (``--config F`` or ``--config=F``) and the dotted fields overridden
    (``--config.a.b=v`` or ``--config.a.b v``)."""
    path, fields = None, []
    for i, arg in enumerate(args):
        if arg == "--":
            break
        if arg in (f"--{name}", f"-{name}") and i + 1 < len(args):
            path = args[i + 1]
        elif m := re.fullmatch(rf"--?{re.escape(name)}=(.*)", arg, flags=re.S):
            path = m.group(1)
        elif m := re.fullmatch(rf"--?{re.escape(name)}\.([\w.]+)(=.*)?", arg, flags=re.S):
            fields.append(m.group(1))
    return path, fields


def _first_line(error: Exception) -> str:
    text = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
    text = text.strip()
    return text.splitlines()[0] if text else type(error).__name__
