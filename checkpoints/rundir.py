"""A trained run directory as the scripts see it: its config, its tokenizer, its newest params.

train.py leaves ``config.json``, ``tokenizer.json``, ``tokenizer_fingerprint.txt`` and
``checkpoints/`` in the run directory; with those, generate/eval need neither the data cache
nor the command line the run was started with. The model to restore into is built above this
layer (``model.decoder.single_device_model``); this module does not know the model.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import sys

import ml_collections

from checkpoints.compat import checker
from checkpoints.manager import Checkpoints, Restored
from configs.loading import over_base
from errors import CheckpointError


@dataclasses.dataclass
class Run:
    directory: pathlib.Path
    config: ml_collections.ConfigDict
    tokenizer: object  # tokenizers.Tokenizer
    fingerprint: str
    checkpoints: Checkpoints

    @functools.cached_property
    def eos(self) -> int:
        """Where generation ends: an imported model's own end-of-text (its
        tokenizer_config.json's ``eos_token``, as transformers reads it: an instruct model's
        end of turn), found beside the run's tokenizer, in its import's side files or in the
        runs it started from; else the tokenizer's end-of-text token (data.tokenizer.eos_id)."""
        from data.chat_template import candidate_dirs
        from data.tokenizer import eos_id
        eos = None
        for d in candidate_dirs(str(self.directory / "tokenizer.json")):
            try:
                eos = json.loads((d / "tokenizer_config.json").read_text()).get("eos_token")
                break
            except (OSError, ValueError, AttributeError):
                continue
        eos = eos.get("content") if isinstance(eos, dict) else eos
        own = self.tokenizer.token_to_id(eos) if isinstance(eos, str) else None
        return eos_id(self.tokenizer) if own is None else own

    def chat_template(self):
        """The run's chat template (data/chat_template.py): the one it trained with, or the one
        its tokenizer came with; DataError in one line when it has none."""
        from data import chat_template
        return chat_template.load("", str(self.directory / "tokenizer.json"))

    def restore_params(self, abstract_params, step: int | None = None) -> Restored:
        got = self.checkpoints.restore_params(
            abstract_params, step=step, check=checker(self.config, self.fingerprint))
        if got is None:
            raise CheckpointError(f"{self.checkpoints.directory} holds no checkpoint yet")
        return got


def _log(msg: str):
    print(msg, file=sys.stderr, flush=True)


def open_run(directory: str | pathlib.Path, log=_log) -> Run:
    from tokenizers import Tokenizer

    from data.tokenizer import fingerprint as tokenizer_fingerprint
    d = pathlib.Path(directory).expanduser().absolute()
    if not (d / "config.json").is_file():
        raise CheckpointError(f"--run {d}: not a run directory (no config.json; give the "
                              f"--workdir of a train.py run)")
    config = over_base(json.loads((d / "config.json").read_text()))
    tok_file = d / "tokenizer.json"
    if not tok_file.is_file():
        raise CheckpointError(f"--run {d}: no tokenizer.json (runs write it since checkpoints "
                              f"gained run metadata; resume the run once to write it)")
    tokenizer = Tokenizer.from_file(str(tok_file))
    fp = tokenizer_fingerprint(tokenizer)
    fp_file = d / "tokenizer_fingerprint.txt"
    if fp_file.is_file() and fp_file.read_text().strip() != fp:
        raise CheckpointError(f"--run {d}: tokenizer.json does not match "
                              f"tokenizer_fingerprint.txt ({fp} vs {fp_file.read_text().strip()})")
    return Run(d, config, tokenizer, fp, Checkpoints(d / "checkpoints", log=log))

