"""What lm-evaluation-harness needs to run RULER's synthetic tasks on a machine without a
network, and the guard against their generators that never finish.

- nltk: importing RULER's niah code calls ``nltk.download("punkt_tab")`` unless nltk finds the
  resource. Only the essay haystacks (niah_single_2/3, ...) ever use it; for the offline tasks
  (niah_single_1, niah_multikey_2/3, ruler_vt, ruler_cwe, ruler_fwe) an empty
  ``tokenizers/punkt_tab`` folder on ``NLTK_DATA`` stops the attempt.
- Hugging Face: ``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE`` make a task that would download
  fail at once instead of waiting on the network.
- ``ruler_vt`` and ``ruler_cwe`` build their data in ``while True`` loops that never end when
  the tokenizer compresses text too weakly to fit their examples (lm-evaluation-harness issue
  2963): every task's data build gets a time limit and stops with one line naming the task.
"""
from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import tempfile

from errors import EvalError


def prepare(environ=os.environ, folder: pathlib.Path | None = None) -> list[str]:
    """Sets what the offline tasks need, before nltk or lm_eval is imported; the user's own
    settings win. Returns what it set, one line each."""
    said = []
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if name not in environ:
            environ[name] = "1"
            said.append(f"{name}=1")
    if not _punkt_tab_found(environ):
        folder = folder or pathlib.Path(tempfile.mkdtemp(prefix="nltk-offline-"))
        (folder / "tokenizers" / "punkt_tab").mkdir(parents=True, exist_ok=True)
        paths = [p for p in environ.get("NLTK_DATA", "").split(os.pathsep) if p]
        environ["NLTK_DATA"] = os.pathsep.join([*paths, str(folder)])
        said.append(f"NLTK_DATA+={folder} (an empty punkt_tab: the essay tasks would need the "
                    f"real one)")
    return said


def _punkt_tab_found(environ) -> bool:
    roots = [p for p in environ.get("NLTK_DATA", "").split(os.pathsep) if p]
    roots += [str(pathlib.Path.home() / "nltk_data"), "/usr/share/nltk_data",
              "/usr/local/share/nltk_data", "/usr/lib/nltk_data", "/usr/local/lib/nltk_data"]
    return any((pathlib.Path(r) / "tokenizers" / "punkt_tab").exists() for r in roots)


@contextlib.contextmanager
def time_limit(seconds: float, what: str):
    """Raises EvalError if the body runs past ``seconds`` (main thread only: SIGALRM)."""
    if seconds <= 0:
        yield
        return

    def expired(*_):
        raise EvalError(f"{what} did not finish in {seconds:g} s; RULER's ruler_vt and "
                        f"ruler_cwe generators loop forever when the tokenizer compresses text "
                        f"too weakly to fit their examples (lm-evaluation-harness issue 2963): "
                        f"leave those tasks out or evaluate at longer lengths "
                        f"(--build-timeout sets the limit)")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def limit_task_builds(seconds: float) -> None:
    """Every lm_eval task's data build (``ConfigurableTask.download``, where RULER generates
    its samples) under ``time_limit``."""
    from lm_eval.api.task import ConfigurableTask
    download = getattr(ConfigurableTask.download, "__wrapped__", ConfigurableTask.download)

    def limited(self, *args, **kwargs):
        name = getattr(self.config, "task", None) or type(self).__name__
        with time_limit(seconds, f"building the data of task {name}"):
            return download(self, *args, **kwargs)

    limited.__wrapped__ = download
    ConfigurableTask.download = limited
