"""The lm-evaluation-harness model (evaluation/harness.py), RULER's offline tasks through it,
and scripts/eval_harness.py, on the suite's trained run and on a tiny random Llama that
transformers' HFLM scores too."""
import ast
import json
import math

import jax
import numpy as np
import pytest
from flax import nnx
from lm_eval import simple_evaluate
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.tasks import TaskManager

import trained_run as tr
from errors import EvalError
from evaluation import offline
from evaluation.harness import StripedJaxLM
from model.decoder import single_device_model


@pytest.fixture(scope="module")
def run_dir():
    return tr.reference()


@pytest.fixture(scope="module")
def lm(run_dir):
    # the defaults: batch_size auto (the run's data.batch_size, 4), max_length the run's 128
    return StripedJaxLM(run=str(run_dir), log=lambda m: None)


ROWS, LENGTH = 16, 128  # the direct forward's one shape: every row here fits in it


@pytest.fixture(scope="module")
def direct_logprobs(run_dir):
    """``logprobs(rows) -> [log-softmax [len(row), V] (float64)]``: the run's weights, restored
    once, on one device, dense attention, natural order. Each row is padded at its end to
    LENGTH tokens in a segment of its own, which neither its causal mask nor its segment's lets
    a real token see: one compiled forward serves every row."""
    from checkpoints.rundir import open_run
    run = open_run(run_dir, log=lambda m: None)
    graphdef, abstract = single_device_model(run.config)
    params = run.restore_params(abstract).params
    forward = jax.jit(lambda p, t, pos, seg: nnx.merge(graphdef, p)(t, pos, seg))

    def logprobs(rows):
        out = []
        for first in range(0, len(rows), ROWS):
            chunk = rows[first:first + ROWS]
            tokens = np.zeros((ROWS, LENGTH), np.int32)
            segments = np.zeros((ROWS, LENGTH), np.int32)
            for i, row in enumerate(chunk):
                assert 0 < len(row) <= LENGTH
                tokens[i, :len(row)], segments[i, :len(row)] = row, 1
            positions = np.broadcast_to(np.arange(LENGTH, dtype=np.int32), tokens.shape)
            logits = np.asarray(forward(params, tokens, positions, segments), np.float64)
            for i, row in enumerate(chunk):
                x = logits[i, :len(row)]
                out.append(x - np.logaddexp.reduce(x, axis=-1, keepdims=True))
        return out

    return logprobs


def test_loglikelihoods_are_a_direct_forwards_and_batch_size_changes_nothing(run_dir, lm, rng,
                                                                              direct_logprobs):
    vocab = lm.tok.get_vocab_size()
    contexts = [rng.integers(1, vocab, int(rng.integers(1, 90))).tolist() for _ in range(10)]
    requests, wholes = [], []
    for i, (context, logp) in enumerate(zip(contexts, direct_logprobs(contexts))):
        if i % 2:  # the model's own next token: greedy
            continuation = [int(np.argmax(logp[-1, :vocab]))]
        else:
            continuation = rng.integers(1, vocab, int(rng.integers(1, 30))).tolist()
        requests.append((("ctx", "cont"), context, continuation))
        wholes.append((context + continuation)[:-1])
    expected = []
    for (_, context, continuation), logp in zip(requests, direct_logprobs(wholes)):
        scored = np.arange(len(context) - 1, len(context) + len(continuation) - 1)
        picks = logp[scored, continuation]
        greedy = all(int(np.argmax(logp[p, :vocab])) == t for p, t in zip(scored, continuation))
        expected.append((float(picks.sum()), greedy))
    got = lm._loglikelihood_tokens(requests, disable_tqdm=True)
    # short continuations: the head ran on the scored tokens alone, gathered over the
    # sequence axis (evaluation/scoring.py); the rolling windows below take the full head
    assert "_forward_scored" in vars(lm.scorer)
    for (ours, our_greedy), (ref, ref_greedy) in zip(got, expected):
        assert abs(ours - ref) <= 1e-5 * max(1.0, abs(ref)) and our_greedy == ref_greedy
    assert sum(g for _, g in expected) >= 5  # the greedy rows are greedy
    # 2 rows per pass (1 rounded up to the data x fsdp axes) against the run's 4
    lm1 = StripedJaxLM(run=str(run_dir), batch_size=1, log=lambda m: None)
    assert (lm1.rows_per_pass, lm.rows_per_pass) == (2, 4)
    got1 = lm1._loglikelihood_tokens(requests, disable_tqdm=True)
    for (a, ga), (b, gb) in zip(got1, got):
        assert abs(a - b) <= 1e-6 * max(1.0, abs(a)) and ga == gb
    prompts = [Instance("generate_until", {}, (lm.tok.decode(r[1][:40]),
                                               {"until": ["\n\n"], "max_gen_toks": 12}), i)
               for i, r in enumerate(requests[:6])]
    assert lm1.generate_until(prompts, True) == lm.generate_until(prompts, True)


def test_rolling_windows_score_every_token_exactly_once(lm, rng, direct_logprobs, monkeypatch):
    seen = []  # windows of max_length (128) tokens
    score = lm.scorer.__call__

    def recording(params, rows, progress=None):
        seen.extend(rows)
        return score(params, rows, progress)

    monkeypatch.setattr(lm, "scorer", recording)
    text = lm.tok.decode(rng.integers(300, lm.tok.get_vocab_size(), 400).tolist())
    ids = lm.tok_encode(text)
    (total,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)], True)
    assert "_forward" in vars(score.__self__)  # every token scored: the head over all of them
    labels = [(*row.tokens[1:], row.target) for row in seen]
    scored = [t for row, lab in zip(seen, labels) for t in lab[-row.scored:]]
    assert scored == ids and len(seen) == math.ceil(len(ids) / 128) >= 3
    assert seen[0].tokens[0] == lm.prefix_token_id  # the first window starts at end-of-text
    # the total is each window's plain forward, summed over the tokens it scores
    direct = 0.0
    for row, lab, logp in zip(seen, labels, direct_logprobs([list(r.tokens) for r in seen])):
        n = len(row.tokens)
        direct += logp[np.arange(n - row.scored, n), lab[-row.scored:]].sum()
    assert abs(total - direct) <= 1e-5 * abs(direct)


def test_against_transformers_hflm_on_a_tiny_llama(rng, tmp_path):
    """lm_eval's own HFLM on a random LlamaForCausalLM and ours on its import: the same
    log-likelihoods (within 1e-4) and the same greedy generations."""
    from lm_eval.models.huggingface import HFLM
    from test_hf_convert import hf_model, import_run
    hf_model(rng, tmp_path / "hf", kv_heads=2)
    import_run(tmp_path / "hf", tmp_path / "run", "--config.data.seq_len=64")
    theirs = HFLM(pretrained=str(tmp_path / "hf"), device="cpu", dtype="float32", batch_size=4,
                  max_length=64)
    ours = StripedJaxLM(run=str(tmp_path / "run"), batch_size=4, max_length=64,
                        log=lambda m: None)
    words = [ours.tok.decode([int(i)]) for i in rng.integers(5, 250, 200)]
    def text(low, high):
        return " ".join(rng.choice(words, int(rng.integers(low, high))))
    ll = [Instance("loglikelihood", {}, (text(2, 20), " " + text(1, 6)), i) for i in range(8)]
    for (a, ga), (b, gb) in zip(ours.loglikelihood(ll, True), theirs.loglikelihood(ll, True)):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(b)) and ga == gb
    gen = [Instance("generate_until", {}, (" ".join(rng.choice(words, 10)),
                                           {"until": ["zz"], "max_gen_toks": 10,
                                            "do_sample": False}), i) for i in range(4)]
    assert ours.generate_until(gen, True) == theirs.generate_until(gen, True)


def test_bad_arguments_and_a_prompt_past_max_length_are_one_line(run_dir):
    with pytest.raises(EvalError, match="unknown model argument.*pretrained.*valid: run, step"):
        StripedJaxLM(run=str(run_dir), pretrained="x")
    with pytest.raises(EvalError, match="batch_size='many' must be a positive integer"):
        StripedJaxLM(run=str(run_dir), batch_size="many")
    # A prompt cut to 76 - 12 = 64 tokens generates in the program of the first test's
    # generations (rows of 64, 12 new tokens, 2 rows)
    lm = StripedJaxLM(run=str(run_dir), max_length=76, log=lambda m: None)
    text = lm.tok.decode(list(range(300, 400)))
    request = [Instance("generate_until", {}, (text, {"until": [], "max_gen_toks": 12}), 0)]
    with pytest.raises(EvalError, match=r"a prompt of \d+ tokens and 12 to generate exceed "
                                        r"max_length=76; raise max_length"):
        lm.generate_until(request, True)
    said = []
    cut = StripedJaxLM(run=str(run_dir), max_length=76, truncate="true", log=said.append)
    assert len(cut.generate_until(request, True)) == 1 and cut.truncated == 1
    assert said[-1] == ("stripedjax: left-truncated 1 prompt(s) to fit max_length 76 with room "
                        "for their generation")


# -- RULER -------------------------------------------------------------------------------------

def import_ruler_data_with_fewer_words():
    """lm_eval's RULER data module, imported once with fewer words to draw needle keys from
    (after NLTK_DATA is set: at import it looks for punkt_tab).
    At import it builds and sorts every adjective-noun pair of wonderwords' lists (912 x 6,782:
    6.2M strings, 10-12 CPU s here, each time a process loads it); the tests' prompts draw their
    keys from the first 60 x 60 pairs. The module's code runs as it is; what it is given to
    choose from is smaller."""
    import importlib
    import sys

    import wonderwords
    name = "lm_eval.tasks.ruler.prepare_niah"
    if name in sys.modules:
        return sys.modules[name]
    real = wonderwords.RandomWord

    class FewerWords(real):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            for category in ("nouns", "adjectives"):
                self._categories[category] = self._categories[category][:60]

    wonderwords.RandomWord = FewerWords
    try:
        module = importlib.import_module(name)
    finally:
        wonderwords.RandomWord = real
    assert 0 < len(module.WORDS) <= 60 * 60  # (the lists repeat a few words)
    return module


@pytest.fixture(scope="module")
def ruler(run_dir, tmp_path_factory):
    """Offline RULER: the run's tokenizer as an HF folder, nltk's punkt_tab stand-in, one
    TaskManager for niah at 512 tokens. It indexes RULER's own folder of lm_eval's tasks: the
    index of all of them takes 8 s to build."""
    import os
    import pathlib

    import lm_eval.tasks

    from checkpoints.rundir import open_run
    from hf.convert import write_tokenizer
    env = {k: os.environ[k] for k in ("NLTK_DATA",) if k in os.environ}
    offline.prepare(env, folder=tmp_path_factory.mktemp("nltk"))
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # HF offline and NLTK_DATA while these tests run
    import nltk
    nltk.data.path.extend(p for p in env.get("NLTK_DATA", "").split(os.pathsep) if p)
    import_ruler_data_with_fewer_words()
    folder = write_tokenizer(open_run(run_dir, log=lambda m: None),
                             tmp_path_factory.mktemp("tok"), 576)
    yield TaskManager(include_defaults=False,
                      include_path=str(pathlib.Path(lm_eval.tasks.__file__).parent / "ruler"),
                      metadata={"max_seq_lengths": [512], "tokenizer": str(folder)})
    for k, v in saved.items():  # the worker's later test files see their own environment
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


class Stub(TemplateLM):
    """Answers a niah prompt from the prompt itself: the value of the needle whose key the
    question names (``wrong``: another number)."""

    def __init__(self, wrong=False):
        super().__init__()
        self.wrong = wrong

    def generate_until(self, requests, disable_tqdm=False):
        import re
        out = []
        for r in requests:
            prompt = r.args[0]
            key = re.findall(r"special magic \w+ for (\S+) mentioned", prompt)[-1]
            values = re.findall(rf"for {re.escape(key)} is: (\S+?)\.\n", prompt + "\n")
            out.append(" 1234567." if self.wrong else " " + ", ".join(values) + ".")
        return out

    eot_token_id = 0
    tok_encode = _loglikelihood_tokens = loglikelihood_rolling = None


@pytest.mark.parametrize("wrong,want", [(False, 1.0), (True, 0.0)])
def test_a_stub_reading_the_needle_scores_one_and_a_wrong_one_zero(ruler, wrong, want):
    res = simple_evaluate(model=Stub(wrong), tasks=["niah_single_1", "niah_multikey_2"],
                          task_manager=ruler, limit=6, bootstrap_iters=0, log_samples=True)
    for task in ("niah_single_1", "niah_multikey_2"):
        assert res["results"][task]["512,none"] == want
        assert len(res["samples"][task]) == 6


def test_the_script_prints_lm_evals_table(run_dir, tmp_path, capsys, monkeypatch, ruler):
    """The README's command on the trained run, its main() in this process (lm_eval and RULER's
    data code are loaded already): lm_eval's table on stdout and its results and samples files,
    niah_single_1 prompted at RULER's 512 tokens through the run's tokenizer folder and answered
    by the run's stripedjax model. lm_eval indexes RULER's folder of its tasks only (the index
    of all of them, lm_eval's own work, takes 8 s). A process of its own stops on a lm_eval flag
    that is the script's to set."""
    import os
    import pathlib
    import sys

    import lm_eval.tasks

    from scripts import eval_harness
    ruler_tasks = str(pathlib.Path(lm_eval.tasks.__file__).parent / "ruler")

    class RulerTasks(lm_eval.tasks.TaskManager):
        def __init__(self, *args, include_path=None, include_defaults=True, **kwargs):
            super().__init__(*args, include_path=include_path or ruler_tasks,
                             include_defaults=False, **kwargs)

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", RulerTasks)
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # main() hands lm_eval its own argv
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "NLTK_DATA"):  # offline.prepare's
        if name in os.environ:  # restored after the test, whatever main() sets
            monkeypatch.setenv(name, os.environ[name])
        else:
            monkeypatch.delenv(name, raising=False)
    capsys.readouterr()
    assert eval_harness.main(["--run", str(run_dir), "--", "--tasks", "niah_single_1",
                              "--metadata", '{"max_seq_lengths": [512]}', "--limit", "1",
                              "--output_path", str(tmp_path / "out"), "--log_samples"]) == 0
    out = capsys.readouterr().out
    assert "|niah_single_1|" in out and "|   512|" in out
    (results,) = (tmp_path / "out").glob("*/results_*.json")
    score = json.loads(results.read_text())["results"]["niah_single_1"]["512,none"]
    (samples,) = (tmp_path / "out").glob("*/samples_niah_single_1_*.jsonl")
    (sample,) = map(json.loads, samples.read_text().splitlines())
    assert score == sample["512"] and score in (0.0, 1.0)
    prompt = sample["arguments"]["gen_args_0"]["arg_0"]
    # RULER keeps 128 tokens of the 512 for the answer, then appends an answer prefix
    tokenizer = run_dir / "eval" / "hf_tokenizer"
    assert (tokenizer / "tokenizer_config.json").is_file()
    from tokenizers import Tokenizer
    length = len(Tokenizer.from_file(str(tokenizer / "tokenizer.json")).encode(prompt).ids)
    (target,) = ast.literal_eval(sample["target"])  # the file holds the list's repr
    assert target in prompt and 300 <= length <= 512 - 128 + 64
    assert isinstance(sample["resps"][0][0], str)
    # a user's mistake in lm_eval's flags: one line and exit code 2 (script_main's, as a process)
    code = eval_harness.main(["--run", str(run_dir), "--", "--model", "hf", "--tasks", "x"])
    err = capsys.readouterr().err
    assert code == 2 and err.strip().splitlines()[-1] == (
        "error: --model is this script's to set (the stripedjax model of --run); leave it out")
    assert "Traceback" not in err


def test_a_data_build_past_its_time_limit_is_one_line():
    import time
    with pytest.raises(EvalError, match="building the data of task ruler_vt did not finish "
                                        "in 0.2 s; RULER's ruler_vt"):
        with offline.time_limit(0.2, "building the data of task ruler_vt"):
            while True:
                time.sleep(0.01)


def test_offline_preparation_respects_the_users_settings(tmp_path):
    env = {"HF_HUB_OFFLINE": "0", "NLTK_DATA": str(tmp_path / "mine")}
    said = offline.prepare(env, folder=tmp_path / "ours")
    assert env["HF_HUB_OFFLINE"] == "0" and env["HF_DATASETS_OFFLINE"] == "1"
    assert env["NLTK_DATA"].split(":") == [str(tmp_path / "mine"), str(tmp_path / "ours")]
    assert (tmp_path / "ours" / "tokenizers" / "punkt_tab").is_dir() and len(said) == 2
    (tmp_path / "mine" / "tokenizers" / "punkt_tab").mkdir(parents=True)
    env = {"NLTK_DATA": str(tmp_path / "mine")}
    assert offline.prepare(env) == ["HF_HUB_OFFLINE=1", "HF_DATASETS_OFFLINE=1"]
    assert env["NLTK_DATA"] == str(tmp_path / "mine")


def test_per_length_picks_the_first_samples_of_every_length(tmp_path):
    from scripts import eval_harness as eh
    args = eh.parse_args(["--run", "R", "--per-length", "3", "--", "--tasks", "niah_single_1",
                          "niah_multikey_2", "--metadata", '{"max_seq_lengths": [512, 1024]}'])
    argv, max_length = eh.lm_eval_argv(args, tmp_path, seq_len=128)
    samples = json.loads(argv[argv.index("--samples") + 1])
    assert samples == {t: [0, 1, 2, 500, 501, 502] for t in ("niah_single_1", "niah_multikey_2")}
    assert max_length == 1024 + 64 and argv[:4] == ["lm-eval", "run", "--model", "stripedjax"]
    metadata = json.loads(argv[argv.index("--metadata") + 1])
    assert metadata == {"max_seq_lengths": [512, 1024], "tokenizer": str(tmp_path)}
    assert json.loads(argv[argv.index("--model_args") + 1]) == {"run": "R", "max_length": 1088}
    with pytest.raises(EvalError, match="--per-length chooses the samples: leave out --limit"):
        eh.lm_eval_argv(eh.parse_args(["--run", "R", "--per-length", "3", "--", "--tasks", "x",
                                       "--limit", "2", "--metadata",
                                       '{"max_seq_lengths": [512]}']), tmp_path, 128)
    # a default the layout does not take moves to the next length it does; a given one stays
    argv, max_length = eh.lm_eval_argv(args, tmp_path, 128, fit=lambda n: -(-n // 4096) * 4096)
    assert max_length == 4096 and json.loads(argv[argv.index("--model_args") + 1])[
        "max_length"] == 4096
    given = eh.parse_args(["--run", "R", "--max-length", "1100", "--", "--tasks", "x"])
    assert eh.lm_eval_argv(given, tmp_path, 128, fit=lambda n: 4096)[1] == 1100
    user = eh.parse_args(["--run", "R", "--", "--tasks", "x", "--model_args", "truncate=true"])
    argv, max_length = eh.lm_eval_argv(user, tmp_path, seq_len=128)
    assert max_length == 128 and argv[argv.index("--model_args") + 1] == \
        "run=R,max_length=128,truncate=true"


def test_generation_settings_are_read_as_hflm_reads_them():
    from evaluation.harness import GenSettings
    from evaluation.kv_cache import Sampling
    g = GenSettings.of({"until": "\n\n", "max_new_tokens": 5, "temperature": 0.0}, "<eos>", 256)
    assert g == GenSettings(("\n\n", "<eos>"), 5, Sampling())
    g = GenSettings.of({"until": ["a", "<eos>"], "temperature": 0.7, "top_k": 3}, "<eos>", 256)
    assert g == GenSettings(("a", "<eos>"), 256, Sampling(False, 0.7, 3))
    assert GenSettings.of({"do_sample": False, "temperature": 0.7}, "", 9).sampling == Sampling()
    assert GenSettings.of({"max_gen_toks": 7, "max_tokens": 3}, "", 9).max_new == 7


def test_generation_ends_at_every_end_id_of_the_imports_generation_config(tmp_path):
    """A Gemma 3 import (tokenizer_config.json's eos_token <eos>, generation_config.json's
    eos_token_id [<eos>, <end_of_turn>]): generate_until's reply ends at <end_of_turn>, as
    transformers' generate under HFLM ends it, not in an invented next turn. The model is a
    script of tokens run through the generator's end rules (kv_cache.stop_set)."""
    import chat_templates as ct
    from checkpoints.rundir import Run
    from evaluation.kv_cache import stop_set
    run_dir = tmp_path / "gemma"
    tok = ct.write_tokenizer_dir("gemma3", run_dir / "hf")
    (run_dir / "tokenizer.json").write_text(tok.to_str())
    (run_dir / "config.json").write_text(json.dumps({"checkpoint": {"restore_from": ""}}))
    (run_dir / "hf" / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 4]}))
    eot = tok.token_to_id("<end_of_turn>")
    said = (tok.encode("Paris", add_special_tokens=False).ids + [eot]
            + tok.encode("\n", add_special_tokens=False).ids + [tok.token_to_id("<start_of_turn>")]
            + tok.encode("user\nAnd Italy?", add_special_tokens=False).ids)

    class Scripted:  # Generator.generate's host loop over tokens the "model" says
        def generate(self, params, rows, max_new, *, length, eos, sampling, seed, stop, real):
            self.eos, out = eos, []
            for row in range(len(rows)):
                got = []
                for t in said[:max_new]:
                    if t in stop_set(eos):
                        break
                    got.append(t)
                    if stop is not None and stop(row, got):
                        break
                out.append(got)
            return out

    lm = StripedJaxLM.__new__(StripedJaxLM)
    TemplateLM.__init__(lm)
    lm.run, lm.tok, lm.generator = Run(run_dir, None, tok, "", None), tok, Scripted()
    lm.params = None
    lm.log, lm.truncate, lm.truncated, lm.seed, lm._calls = (lambda m: None), False, 0, 0, 0
    lm._max_length, lm._max_gen_toks, lm.rows_per_pass, lm.batch_shards = 64, 32, 2, 1
    lm.buckets = lambda n: 64
    assert lm.eot_token_id == tok.token_to_id("<eos>")  # HFLM's: the tokenizer's eos_token
    got = lm.generate_until([Instance("generate_until", {}, ("The capital of France?", {
        "until": ["\n\n"], "max_gen_toks": 32}), 0)], disable_tqdm=True)
    assert got == ["Paris"] and set(lm.generator.eos) == {1, eot}


def test_the_generation_benchmark_against_transformers_on_the_trained_run(run_dir, tmp_path,
                                                                          capsys):
    """scripts/bench_generate.py --run --against transformers at tiny sizes, its main() in this
    process: our KV cache and transformers' generate pick the same greedy tokens after both
    prompts, our scorer and HFLM the same log-likelihoods and greedy flags (main returns 0 only
    then), and its table and JSON hold every measurement."""
    from scripts import bench_generate
    out = tmp_path / "vs.json"
    capsys.readouterr()
    assert bench_generate.main(
        ["--run", str(run_dir), "--against", "transformers", "--prompt", "40", "--short", "20",
         "--new", "4", "--requests", "4", "--request-tokens", "48", "--batch", "2",
         "--repeats", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    for row in ("prefill, 40 tokens", "decode after 20 tokens", "decode after 40 tokens",
                "log-likelihood, 4 x ~48"):
        assert row in printed
    got = json.loads(out.read_text())
    assert got["same_tokens"] == {"20": True, "40": True}
    ll = got["loglikelihood"]
    assert ll["same_greedy"] and ll["largest_difference"] < 1e-3
    assert 0 <= ll["padding_share"] < 1
    # every measurement is there (their values at these sizes are noise: timing is not tested)
    for ratio in (got["prefill_ratio"], ll["ratio"], *(d["ratio"] for d in got["decode"].values())):
        assert math.isfinite(ratio)
