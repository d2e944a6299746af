"""Runs printed commands of one script in one Python process, in order, each as the user's
shell would run it less the interpreter's start-up: the script executed as ``__main__`` with
``sys.argv`` set to the command's words, its stdout and stderr captured, its exit status taken
from ``SystemExit`` (an exception is status 1 and its traceback the output).

    python tests/run_commands.py '[["scripts/plan.py", "--config", ...], ...]'

Prints one JSON list of {"returncode", "output"} on the real stdout. Used by
tests/test_readme_commands.py for scripts whose runs share no state (test_readme_commands.SHARED).
"""
import contextlib
import io
import json
import runpy
import sys
import traceback


def run(argv: list[str]) -> dict:
    captured, code = io.StringIO(), 0
    sys.argv = list(argv)
    with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
        try:
            runpy.run_path(argv[0], run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:  # noqa: BLE001  (a crash is the command's failure, reported)
            traceback.print_exc()
            code = 1
    return {"returncode": code, "output": captured.getvalue()}


if __name__ == "__main__":
    print(json.dumps([run(argv) for argv in json.loads(sys.argv[1])]))
