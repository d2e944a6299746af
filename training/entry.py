"""The user-facing edge of a run: user mistakes become one line and an exit code, not a trace."""
from __future__ import annotations

import sys


def user_errors() -> tuple[type[BaseException], ...]:
    from parallel.layouts import LayoutError
    from parallel.mesh import MeshError
    from training.validate import ConfigError
    errors = [ConfigError, LayoutError, MeshError]
    try:
        from data import DataError
        errors.append(DataError)
    except ImportError:
        pass
    return tuple(errors)


def main_with_errors(config, workdir) -> int:
    from training.loop import Diverged, run
    try:
        run(config, workdir)
    except user_errors() as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Diverged as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
