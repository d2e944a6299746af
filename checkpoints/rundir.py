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
        """The tokenizer's end-of-text: an imported model's own (its tokenizer_config.json's
        ``eos_token``, as transformers reads it, HFLM's ``eot_token_id``), found beside the
        run's tokenizer, in its import's side files or in the runs it started from; else the
        tokenizer's end-of-text token (data.tokenizer.eos_id). Generation ends at any of
        ``stop_ids``, this one among them."""
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

    @functools.cached_property
    def stop_ids(self) -> tuple[int, ...]:
        """Every id where generation ends: ``eos`` and the ids an imported model's generation
        config lists (``generation_eos``: Gemma 3's ``<end_of_turn>`` beside its ``<eos>``,
        Llama 3's end of text, of message and of turn), from the same places as ``eos``. What
        transformers' ``generate`` stops at, with the tokenizer's end-of-text that lm_eval's
        HFLM adds as a stop string."""
        from data.chat_template import candidate_dirs
        listed = generation_eos(candidate_dirs(str(self.directory / "tokenizer.json")))
        return tuple(dict.fromkeys([self.eos, *listed]))

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


def _json(path: pathlib.Path):
    try:
        got = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return got if isinstance(got, dict) else None


def _ids(value) -> list[int]:
    values = value if isinstance(value, (list, tuple)) else [value]
    return [int(v) for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0]


def generation_eos(dirs) -> list[int]:
    """The end ids transformers' ``generate`` stops at for an HF model directory: the first of
    ``dirs`` holding a generation_config.json or a model's config.json (one with a
    ``model_type``: an import's hf/ side files), read as ``from_pretrained`` and ``generate``
    read them (transformers 5.23: GenerationMixin.adjust_generation_fn loads
    generation_config.json, else GenerationConfig.from_model_config of config.json;
    _prepare_special_tokens makes one id a list of one). generation_config.json's
    ``eos_token_id``, an int or a list (none when it has no such key); without that file,
    config.json's top-level ``eos_token_id``, else that of its first ``decoder``, ``generator``
    or ``text_config``. [] when no directory has either file."""
    for d in map(pathlib.Path, dirs):
        gen = _json(d / "generation_config.json")
        if gen is not None:
            return _ids(gen.get("eos_token_id"))
        cfg = _json(d / "config.json")
        if cfg is None or "model_type" not in cfg:  # a run's own config.json is not HF's
            continue
        ids = cfg.get("eos_token_id")
        if ids is None:
            sub = next((cfg[k] for k in ("decoder", "generator", "text_config") if cfg.get(k)),
                       None)
            ids = sub.get("eos_token_id") if isinstance(sub, dict) else None
        return _ids(ids)
    return []


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

