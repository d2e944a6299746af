"""The lm-evaluation-harness model for a run directory: ``stripedjax``.

    lm_eval.simple_evaluate(model=StripedJaxLM(run="runs/x"), tasks=[...], metadata={...})
    python scripts/eval_harness.py --run RUN [--max-length N] -- --tasks ... (the CLI)

Model arguments (``--model_args run=RUN,step=N,...``):
- ``run``: a train.py --workdir, or a run imported from Hugging Face (scripts/convert_hf.py);
  ``step``: its checkpoint (default: the newest complete one).
- ``max_length``: the longest row, prompt and generation together (default: the run's
  data.seq_len). A longer prompt stops with one line unless ``truncate=true``, which keeps its
  last tokens and reports how many prompts it cut.
- ``batch_size``: rows per forward pass or generation batch (``auto``: the run's
  data.batch_size), rounded up to a multiple of the mesh's data x fsdp axes.
- ``max_gen_toks``: the generation cap when a task sets none (256).

Rows run on the run's own mesh, attention and layout (evaluation/setup.py): a long prompt's
attention is context parallel over every device. Log-likelihoods come from one forward pass
per batch of rows (evaluation/scoring.py), generations from the KV cache
(evaluation/kv_cache.py), greedy unless a task asks to sample. Requests are scored exactly as
lm_eval's ``HFLM`` scores them: the same truncation to ``max_length + 1`` tokens, the same
rolling windows, the same stop strings (the end-of-text token's among them), the same end
ids (those transformers' generate stops at: an imported model's generation_config.json
eos_token_id, checkpoints/rundir.py ``Run.stop_ids``). A chat template
is applied only where the run's tokenizer has one (an imported model's tokenizer_config.json).
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import pathlib
import sys

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from errors import EvalError

DEFAULT_MAX_GEN_TOKS = 256
MAX_NEW_NAMES = ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")
KNOWN_GEN_KWARGS = {"until", "do_sample", "temperature", "top_k", *MAX_NEW_NAMES}


def _say(msg: str):
    print(msg, file=sys.stderr, flush=True)


@register_model("stripedjax")
class StripedJaxLM(TemplateLM):
    """A run directory as an lm_eval language model (see the module's docstring)."""

    def __init__(self, run: str, step: int | None = None, batch_size: int | str = "auto",
                 max_length: int | None = None, max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
                 truncate: bool = False, seed: int = 0, device: str | None = None,
                 max_batch_size: int | None = None, log=_say, **unknown):
        super().__init__()
        if unknown:  # lm_eval passes only what its caller wrote after --model_args
            valid = [p for p in inspect.signature(StripedJaxLM).parameters
                     if p not in ("unknown", "log", "device", "max_batch_size")]
            raise EvalError(f"stripedjax: unknown model argument(s) {', '.join(sorted(unknown))}; "
                            f"valid: {', '.join(valid)}")
        from checkpoints.rundir import open_run
        from evaluation.kv_cache import Generator
        from evaluation.lengths import Buckets
        from evaluation.scoring import Scorer
        from parallel.mesh import batch_shards
        from evaluation.setup import eval_setup
        from model.sharded import ShardedModel
        self.log = log
        self.run = open_run(run, log=log)
        config, mesh = eval_setup(self.run.config, log)
        sharded = ShardedModel(config, mesh)
        self._max_length = _positive_int(max_length or config.data.seq_len, "max_length")
        self._max_gen_toks = _positive_int(max_gen_toks, "max_gen_toks")
        rows = (int(config.data.batch_size) if str(batch_size).lower() == "auto"
                else _positive_int(batch_size, "batch_size"))
        self.truncate, self.truncated = _flag(truncate), 0
        self.seed, self._calls = _positive_int(seed, "seed", zero=True), 0
        self.buckets = Buckets(config, mesh, self._max_length)
        if self._max_length < 2 or self.buckets(self._max_length) is None:
            from evaluation.lengths import nearby_valid, unit
            near = nearby_valid(config, mesh, self._max_length, 2, unit(config, mesh))
            raise EvalError(f"stripedjax: max_length={self._max_length} is no row length "
                            f"the run's layout and mesh accept; valid lengths near it: "
                            f"{', '.join(map(str, near)) or 'none'}")
        got = self.run.restore_params(
            sharded.abstract_params,
            step=None if step is None else _positive_int(step, "step", zero=True))
        self.params, self.step = got.params, got.step
        self.tok = self.run.tokenizer
        vocab = self.tok.get_vocab_size()
        self.scorer = Scorer(sharded, vocab, self.buckets, rows)
        self.generator = Generator(sharded, vocab)
        self.rows_per_pass = self.scorer.rows_per_pass
        self.batch_shards = batch_shards(mesh)
        self._chat_tokenizer = None
        log(f"stripedjax: {self.run.directory} step {self.step}; {config.attention.impl} "
            f"attention, {config.attention.layout} layout, mesh "
            f"{'x'.join(str(v) for v in mesh.shape.values())}; max_length {self._max_length}, "
            f"{self.rows_per_pass} rows per pass")

    # -- what lm_eval reads ------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.run.eos  # an imported model's own (checkpoints/rundir.py), as HFLM's

    @functools.cached_property
    def prefix_token_id(self) -> int:
        """What an empty context starts with: begin-of-text where the tokenizer has one."""
        from hf.convert import BOS_NAMES
        bos = next((self.tok.token_to_id(n) for n in BOS_NAMES
                    if self.tok.token_to_id(n) is not None), None)
        return self.eot_token_id if bos is None else bos

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self.rows_per_pass

    @property
    def tokenizer_name(self) -> str:
        return str(self.run.directory).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   **kwargs) -> list[int]:
        # as HFLM: the tokenizer's own special tokens (an imported Llama's begin-of-text),
        # unless the string already starts with them
        if add_special_tokens is None:
            add_special_tokens = not string.startswith(self.tok.decode(
                [self.prefix_token_id], skip_special_tokens=False))
        return self.tok.encode(string, add_special_tokens=bool(add_special_tokens)).ids

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(tokens), skip_special_tokens=skip_special_tokens)

    # -- chat templates: only the tokenizer's own -------------------------------------------
    def _chat(self):
        if self._chat_tokenizer is None:
            import tempfile

            from transformers import AutoTokenizer

            from hf.convert import write_tokenizer
            folder = write_tokenizer(self.run, pathlib.Path(tempfile.mkdtemp()), self._max_length)
            self._chat_tokenizer = AutoTokenizer.from_pretrained(str(folder))
        return self._chat_tokenizer

    def chat_template(self, chat_template=False) -> str | None:
        template = self._chat().chat_template
        if not template:
            raise EvalError(f"--apply_chat_template: the tokenizer of {self.run.directory} has "
                            f"no chat template (only an imported model's tokenizer_config.json "
                            f"brings one); leave the flag out")
        return template if isinstance(template, str) else str(template)

    def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
        return self._chat().apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt)

    # -- requests ----------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        from evaluation.scoring import Row
        rows = []
        for _, context_enc, continuation_enc in requests:
            whole = (list(context_enc) + list(continuation_enc))[-(self._max_length + 1):]
            rows.append(Row(tokens=tuple(whole[:-1]), target=whole[-1],
                            scored=min(len(continuation_enc), len(whole) - 1)))
        with _progress(len(rows), "loglikelihood", disable_tqdm) as bar:
            scores = self.scorer(self.params, rows, progress=bar.update)
        for (key, _, _), answer in zip(requests, scores):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return scores

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval import utils
        windows, owner = [], []
        for i, request in enumerate(requests):
            (string,) = request.args
            for window in map(utils.make_disjoint_window, utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self._max_length, context_len=1)):
                windows.append((None, *window))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (loglik, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[i] += loglik
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos_text = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        out: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(repr(sorted(request.args[1].items())), []).append(i)
        with _progress(len(requests), "generate_until", disable_tqdm) as bar:
            for members in groups.values():
                kwargs = dict(requests[members[0]].args[1])
                ignored = sorted(set(kwargs) - KNOWN_GEN_KWARGS)
                if ignored:
                    self.log(f"stripedjax: ignoring generation setting(s) {', '.join(ignored)} "
                             f"(supported: {', '.join(sorted(KNOWN_GEN_KWARGS))})")
                gen = GenSettings.of(kwargs, eos_text, self._max_gen_toks)
                prompts = {i: self._prompt(requests[i].args[0], gen.max_new) for i in members}
                members.sort(key=lambda i: -len(prompts[i]))
                for first in range(0, len(members), self.rows_per_pass):
                    batch = members[first:first + self.rows_per_pass]
                    texts = self._generate([prompts[i] for i in batch], gen)
                    for i, text in zip(batch, texts):
                        out[i] = text
                        self.cache_hook.add_partial("generate_until", requests[i].args, text)
                    bar.update(len(batch))
        if self.truncated:
            self.log(f"stripedjax: left-truncated {self.truncated} prompt(s) to fit max_length "
                     f"{self._max_length} with room for their generation")
        return out

    def _prompt(self, context: str, max_new: int) -> list[int]:
        room = self._max_length - max_new
        ids = self.tok_encode(context) or [self.prefix_token_id]
        if len(ids) <= room:
            return ids
        if room < 1:
            raise EvalError(f"stripedjax: max_gen_toks={max_new} leaves no room for a prompt "
                            f"in max_length={self._max_length}; lower it (--gen_kwargs "
                            f"max_gen_toks=N) or raise max_length")
        if not self.truncate:
            raise EvalError(
                f"stripedjax: a prompt of {len(ids)} tokens and {max_new} to generate exceed "
                f"max_length={self._max_length}; raise max_length (scripts/eval_harness.py "
                f"--max-length), lower max_gen_toks (--gen_kwargs max_gen_toks=N), or pass "
                f"truncate=true to keep each prompt's last tokens")
        self.truncated += 1
        return ids[-room:]

    def _generate(self, prompts: list[list[int]], gen: "GenSettings") -> list[str]:
        # a multiple of the data x fsdp axes: filler rows, dropped below
        rows = prompts + [prompts[-1]] * (-len(prompts) % self.batch_shards)
        length = self.buckets(max(len(p) for p in rows))
        if length is None:
            raise EvalError(f"stripedjax: a prompt of {max(map(len, rows))} tokens has no row "
                            f"length the layout accepts within max_length={self._max_length}")
        stops = [u for u in gen.until if u]
        longest = max((len(u) for u in stops), default=0)

        def stop(row, tokens):  # a stop string in the text generated so far
            tail = self.tok_decode(tokens[-(longest + 8):]) if longest else ""
            return any(u in tail for u in stops)

        self._calls += 1  # each batch its own keys: repeated requests sample anew
        # ends at any id HF's generate stops at (the generation config's), as HFLM's rows do
        got = self.generator.generate(self.params, rows, gen.max_new, length=length,
                                      eos=self.run.stop_ids, sampling=gen.sampling,
                                      seed=self.seed * 100_003 + self._calls,
                                      stop=stop if stops else None, real=len(prompts))
        texts = []
        for tokens in got[:len(prompts)]:
            text = self.tok_decode(tokens)
            for u in stops:
                text = text.split(u)[0]
            texts.append(text)
        return texts


@dataclasses.dataclass(frozen=True)
class GenSettings:
    """A task's generation kwargs as HFLM reads them."""
    until: tuple[str, ...]  # stop strings, the end-of-text token's among them
    max_new: int
    sampling: object  # evaluation.kv_cache.Sampling

    @classmethod
    def of(cls, kwargs: dict, eos_text: str, default_max: int) -> "GenSettings":
        from evaluation.kv_cache import Sampling
        until = kwargs.get("until")
        until = [until] if isinstance(until, str) else list(until or [])
        if eos_text and eos_text not in until:
            until.append(eos_text)
        max_new = next((int(kwargs[n]) for n in MAX_NEW_NAMES if kwargs.get(n) is not None),
                       default_max)
        temperature = float(kwargs.get("temperature") or 0.0)
        do_sample = kwargs.get("do_sample")
        greedy = not (do_sample if do_sample is not None else temperature > 0) or temperature <= 0
        top_k = int(kwargs.get("top_k") or 0)
        sampling = Sampling() if greedy else Sampling(False, temperature, top_k)
        return cls(tuple(until), max_new, sampling)


def _positive_int(value, name: str, zero: bool = False) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = -1
    if n < (0 if zero else 1):
        raise EvalError(f"stripedjax: {name}={value!r} must be a "
                        f"{'non-negative' if zero else 'positive'} integer"
                        f"{' or auto' if name == 'batch_size' else ''}")
    return n


def _flag(value) -> bool:
    if isinstance(value, str):
        if value.lower() not in ("true", "false", "1", "0"):
            raise EvalError(f"stripedjax: truncate={value!r} must be true or false")
        return value.lower() in ("true", "1")
    return bool(value)


class _progress:
    """A tqdm bar on stderr (none when lm_eval disables them)."""

    def __init__(self, total: int, what: str, disable: bool):
        from tqdm import tqdm
        self.bar = tqdm(total=total, desc=f"stripedjax {what}", disable=disable, file=sys.stderr)

    def __enter__(self):
        return self.bar

    def __exit__(self, *exc):
        self.bar.close()
        return False
