"""The lm-evaluation-harness model (evaluation/harness.py), RULER's offline tasks through it,
and scripts/eval_harness.py, on the suite's trained run and on a tiny random Llama that
transformers' HFLM scores too."""
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
def lm8(run_dir):
    # max_length: RULER's 512-token prompts and their answer prefix (the run trained at 128)
    return StripedJaxLM(run=str(run_dir), batch_size=8, max_length=576, log=lambda m: None)


def direct_logprobs(run_dir, tokens):
    """log-softmax [L, V] (float64) of one unpadded row, one device, dense, natural order."""
    from checkpoints.rundir import open_run
    run = open_run(run_dir, log=lambda m: None)
    graphdef, abstract = single_device_model(run.config)
    params = run.restore_params(abstract).params
    L = len(tokens)
    logits = nnx.merge(graphdef, params)(np.asarray([tokens]), np.arange(L)[None],
                                         np.ones((1, L), np.int32))[0]
    logits = np.asarray(logits, np.float64)
    return logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)


def test_loglikelihoods_are_a_direct_forwards_and_batch_size_changes_nothing(run_dir, lm8, rng):
    vocab = lm8.tok.get_vocab_size()
    requests, expected = [], []
    for i in range(10):
        context = rng.integers(1, vocab, int(rng.integers(1, 90))).tolist()
        logp = direct_logprobs(run_dir, context)
        if i % 2:  # the model's own next token: greedy
            continuation = [int(np.argmax(logp[-1, :vocab]))]
        else:
            continuation = rng.integers(1, vocab, int(rng.integers(1, 30))).tolist()
        whole = context + continuation
        logp = direct_logprobs(run_dir, whole[:-1])
        picks = logp[np.arange(len(context) - 1, len(whole) - 1), continuation]
        greedy = all(int(np.argmax(logp[p, :vocab])) == t for p, t in
                     zip(range(len(context) - 1, len(whole) - 1), continuation))
        requests.append((("ctx", "cont"), context, continuation))
        expected.append((float(picks.sum()), greedy))
    got8 = lm8._loglikelihood_tokens(requests, disable_tqdm=True)
    for (ours, our_greedy), (ref, ref_greedy) in zip(got8, expected):
        assert abs(ours - ref) <= 1e-5 * max(1.0, abs(ref)) and our_greedy == ref_greedy
    assert sum(g for _, g in expected) >= 5  # the greedy rows are greedy
    lm1 = StripedJaxLM(run=str(run_dir), batch_size=1, log=lambda m: None)
    got1 = lm1._loglikelihood_tokens(requests, disable_tqdm=True)
    for (a, ga), (b, gb) in zip(got1, got8):
        assert abs(a - b) <= 1e-6 * max(1.0, abs(a)) and ga == gb
    prompts = [Instance("generate_until", {}, (lm8.tok.decode(r[1][:40]),
                                               {"until": ["\n\n"], "max_gen_toks": 12}), i)
               for i, r in enumerate(requests[:6])]
    assert lm1.generate_until(prompts, True) == lm8.generate_until(prompts, True)


def test_rolling_windows_score_every_token_exactly_once(run_dir, rng):
    lm = StripedJaxLM(run=str(run_dir), batch_size=4, max_length=48, log=lambda m: None)
    seen = []
    score = lm.scorer.__call__

    def recording(params, rows, progress=None):
        seen.extend(rows)
        return score(params, rows, progress)

    lm.scorer = recording
    text = lm.tok.decode(rng.integers(300, lm.tok.get_vocab_size(), 150).tolist())
    ids = lm.tok_encode(text)
    (total,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)], True)
    labels = [(*row.tokens[1:], row.target) for row in seen]
    scored = [t for row, lab in zip(seen, labels) for t in lab[-row.scored:]]
    assert scored == ids and len(seen) == math.ceil(len(ids) / 48)
    assert seen[0].tokens[0] == lm.prefix_token_id  # the first window starts at end-of-text
    # the total is each window's plain forward, summed over the tokens it scores
    direct = 0.0
    for row, lab in zip(seen, labels):
        logp = direct_logprobs(run_dir, list(row.tokens))
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
    lm = StripedJaxLM(run=str(run_dir), max_length=40, log=lambda m: None)
    text = lm.tok.decode(list(range(300, 360)))
    request = [Instance("generate_until", {}, (text, {"until": [], "max_gen_toks": 8}), 0)]
    with pytest.raises(EvalError, match=r"a prompt of \d+ tokens and 8 to generate exceed "
                                        r"max_length=40; raise max_length"):
        lm.generate_until(request, True)
    said = []
    cut = StripedJaxLM(run=str(run_dir), max_length=40, truncate="true", log=said.append)
    assert len(cut.generate_until(request, True)) == 1 and cut.truncated == 1
    assert said[-1] == ("stripedjax: left-truncated 1 prompt(s) to fit max_length 40 with room "
                        "for their generation")


# -- RULER -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ruler(run_dir, tmp_path_factory):
    """Offline RULER: the run's tokenizer as an HF folder, nltk's punkt_tab stand-in, one
    TaskManager (its task index takes seconds to build) for niah at 512 tokens."""
    import os

    from checkpoints.rundir import open_run
    from hf.convert import write_tokenizer
    env = {k: os.environ[k] for k in ("NLTK_DATA",) if k in os.environ}
    offline.prepare(env, folder=tmp_path_factory.mktemp("nltk"))
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # HF offline and NLTK_DATA while these tests run
    import nltk
    nltk.data.path.extend(p for p in env.get("NLTK_DATA", "").split(os.pathsep) if p)
    folder = write_tokenizer(open_run(run_dir, log=lambda m: None),
                             tmp_path_factory.mktemp("tok"), 576)
    yield TaskManager(metadata={"max_seq_lengths": [512], "tokenizer": str(folder)})
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


def test_niah_single_1_on_the_trained_run(ruler, lm8):
    res = simple_evaluate(model=lm8, tasks=["niah_single_1"], task_manager=ruler, limit=2,
                          bootstrap_iters=0, log_samples=True)
    score = res["results"]["niah_single_1"]["512,none"]
    samples = res["samples"]["niah_single_1"]
    assert 0.0 <= score <= 1.0 and len(samples) == 2
    assert score == np.mean([s["512"] for s in samples])
    for s in samples:
        prompt = s["arguments"][0][0]  # (context, generation kwargs) of its one request
        # RULER keeps 128 tokens of the 512 for the answer, then appends an answer prefix
        assert s["target"][0] in prompt and 300 <= len(lm8.tok_encode(prompt)) <= 512 - 128 + 64
        assert isinstance(s["resps"][0][0], str)


def test_the_script_prints_lm_evals_table(run_dir, tmp_path):
    out = tr.script("eval_harness.py", "--run", run_dir, "--", "--tasks", "niah_single_1",
                    "--metadata", '{"max_seq_lengths": [512]}', "--limit", 1,
                    "--output_path", tmp_path / "out", "--log_samples", timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "|niah_single_1|" in out.stdout and "|   512|" in out.stdout
    (results,) = (tmp_path / "out").glob("*/results_*.json")
    got = json.loads(results.read_text())["results"]["niah_single_1"]["512,none"]
    assert 0.0 <= got <= 1.0
    assert (run_dir / "eval" / "hf_tokenizer" / "tokenizer_config.json").is_file()
    bad = tr.script("eval_harness.py", "--run", run_dir, "--", "--model", "hf", "--tasks", "x")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1] == (
        "error: --model is this script's to set (the stripedjax model of --run); leave it out")


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
