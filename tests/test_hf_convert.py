"""scripts/convert_hf.py against transformers: small random LlamaForCausalLMs,
Qwen2ForCausalLMs and MistralForCausalLMs with a sliding window imported give transformers'
logits (dense, and ring attention in every layout) and its greedy tokens; an export loads back in transformers with the very same tensors;
bad input and every known architecture that does not convert is one line."""
import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

# The reference, from requirements-test.txt (make test installs it).
import torch
from transformers import (AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM,
                          MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM)

from checkpoints.rundir import open_run
from data.tokenizer import EOS, train_bpe
from errors import ConversionError
from hf import config as hf_config
from hf.safetensors import Tensors
from model.decoder import Decoder, single_device_model
from model.layers import AttentionBackend
from parallel.layouts import permutation
from parallel.mesh import make_mesh
from scripts import convert_hf

import llama3_tokenizer

ORIGINAL = 16  # the HF models' pretraining context: every test runs past it
SCALINGS = {
    "none": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL},
}


def tokenizer_files(rng, directory: pathlib.Path):
    """A byte-level BPE trained on random words, saved the way HF fast tokenizers are."""
    words = ["".join(rng.choice(list("abcdefghijklmnop"), rng.integers(2, 8))) for _ in range(300)]
    tok = train_bpe([" ".join(rng.choice(words, 60)) for _ in range(80)], 300)
    (directory / "tokenizer.json").write_text(tok.to_str())
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS}))
    return tok


# family -> (config class, model class, query heads, head dim). Qwen2 here has 7 query heads
# per kv head (with the default kv_heads=2), as Qwen2.5-7B has (28/4).
FAMILIES = {"llama": (LlamaConfig, LlamaForCausalLM, 4, 16),
            "qwen2": (Qwen2Config, Qwen2ForCausalLM, 14, 8),
            "mistral": (MistralConfig, MistralForCausalLM, 4, 16)}


def hf_model(rng, directory: pathlib.Path, *, scaling="none", tied=False, kv_heads=2,
             dtype=torch.float32, shard=None, family="llama", **config):
    """Saves a random LlamaForCausalLM, Qwen2ForCausalLM or MistralForCausalLM (weights and
    biases far from init, so every tensor matters). The end-of-text token's head row is 0, so
    that greedy decoding never stops at its first token (it did about once in 300 seeds)."""
    directory.mkdir(parents=True)
    tok = tokenizer_files(rng, directory)
    max_pos = ORIGINAL * 4 if scaling in ("yarn", "llama3") else ORIGINAL
    config_class, model_class, heads, head_dim = FAMILIES[family]
    cfg = config_class(vocab_size=tok.get_vocab_size(), hidden_size=heads * head_dim,
                       intermediate_size=96, num_hidden_layers=2, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
                       rms_norm_eps=float(rng.uniform(1e-6, 1e-4)),
                       rope_theta=float(rng.uniform(1e3, 1e5)), rope_scaling=SCALINGS[scaling],
                       tie_word_embeddings=tied, eos_token_id=tok.token_to_id(EOS), **config)
    torch.manual_seed(int(rng.integers(2**31)))
    model = model_class(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
            else:
                p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
        model.get_output_embeddings().weight[tok.token_to_id(EOS)] = 0
    model = model.to(dtype)
    model.save_pretrained(directory, **({"max_shard_size": shard} if shard else {}))
    return model.float().eval()


def import_run(hf_dir, out, *extra):
    assert convert_hf.main(["import", "--hf", str(hf_dir), "--out", str(out), *extra]) == 0
    return open_run(out)


def our_logits(run, tokens_BL, backend=AttentionBackend(), perm=None):
    """Logits in natural order from the run's weights, computed in ``perm``'s layout order."""
    graphdef, abstract = single_device_model(run.config)
    params = run.restore_params(abstract).params
    if backend.mesh is not None:
        model_def = nnx.eval_shape(lambda: Decoder(run.config.model, backend, nnx.Rngs(0)))
        graphdef = nnx.split(model_def, nnx.Param)[0]
        params = jax.device_put(params, jax.sharding.NamedSharding(backend.mesh, jax.sharding.PartitionSpec()))
    model = nnx.merge(graphdef, params)
    B, L = tokens_BL.shape
    perm = np.arange(L) if perm is None else perm
    pos = np.broadcast_to(np.arange(L), (B, L))
    out = model(jnp.asarray(tokens_BL[:, perm]), jnp.asarray(pos[:, perm]),
                jnp.ones((B, L), jnp.int32))
    natural = np.empty((B, L, out.shape[-1]), np.float32)
    natural[:, perm] = np.asarray(out)
    return natural


def hf_logits(model, tokens_BL):
    with torch.no_grad():
        return model(torch.tensor(tokens_BL)).logits.numpy()


def relative(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def with_window(run, window: int):
    """The same run (weights, tokenizer) with ``model.sliding_window`` set to ``window``."""
    config = run.config.copy_and_resolve_references()
    config.model.sliding_window = window
    return dataclasses.replace(run, config=config)


@pytest.mark.parametrize("scaling,tied,kv_heads", [
    ("none", False, 4), ("linear", True, 2), ("dynamic", False, 1), ("yarn", True, 2),
    ("llama3", False, 2)])
def test_imported_logits_match_transformers_past_the_original_context(
        rng, tmp_path, scaling, tied, kv_heads):
    model = hf_model(rng, tmp_path / "hf", scaling=scaling, tied=tied, kv_heads=kv_heads)
    run = import_run(tmp_path / "hf", tmp_path / "run")
    m = run.config.model
    assert (m.rope_scaling.type, m.tie_embeddings, m.num_kv_heads) == (scaling, tied, kv_heads)
    tokens = rng.integers(0, m.vocab_size, (2, 4 * ORIGINAL))  # 4x the original context
    assert relative(our_logits(run, tokens), hf_logits(model, tokens)) < 1e-4


@pytest.fixture(scope="module")
def llama_yarn(tmp_path_factory):
    """One random LlamaForCausalLM (yarn, 2 kv heads) and its import, shared by the layouts
    below: they then share the ring's compiled operations too."""
    seed = np.random.SeedSequence().entropy
    rng = np.random.default_rng(seed)
    d = tmp_path_factory.mktemp("llama_yarn")
    model = hf_model(rng, d / "hf", scaling="yarn", kv_heads=2)
    return model, import_run(d / "hf", d / "run"), seed


@pytest.mark.parametrize("layout", ["contiguous", "striped", "zigzag"])
def test_ring_attention_in_every_layout_gives_transformers_logits(llama_yarn, rng, layout):
    model, run, seed = llama_yarn
    mesh = make_mesh({"data": 1, "fsdp": 2, "sequence": 4, "tensor": 1})
    backend = AttentionBackend(impl="ring", layout=layout, mesh=mesh, block_q=8, block_kv=8)
    L = 4 * ORIGINAL
    tokens = rng.integers(0, run.config.model.vocab_size, (2, L))
    got = our_logits(run, tokens, backend, permutation(layout, L, 4))
    assert relative(got, hf_logits(model, tokens)) < 1e-4, seed


def test_greedy_generation_gives_transformers_tokens(rng, tmp_path, capsys):
    # tied: the decode step's head contracts the embedding table in place (Decoder.next_logits)
    model = hf_model(rng, tmp_path / "hf", scaling="llama3", kv_heads=2, tied=True)
    run = import_run(tmp_path / "hf", tmp_path / "run", "--config.data.seq_len=128")
    assert_greedy_tokens_match(rng, run, model, capsys)


def assert_greedy_tokens_match(rng, run, model, capsys):
    """scripts/generate.py's greedy tokens from ``run`` are transformers' ``generate``'s."""
    from scripts import generate
    prompt = " ".join(run.tokenizer.decode([int(i)]) for i in rng.integers(5, 250, 12))
    ids = run.tokenizer.encode(prompt).ids
    new = 3 * ORIGINAL  # runs well past the original context
    capsys.readouterr()
    assert generate.main(["--run", str(run.directory), "--prompt", prompt,  # greedy by default
                          "--max-new-tokens", str(new), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)  # {"ids": [...], "text": ...} and nothing else
    ours = printed["ids"]
    assert printed["text"] == run.tokenizer.decode(ours)
    with torch.no_grad():
        theirs = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False,
                                eos_token_id=run.tokenizer.token_to_id(EOS))[0, len(ids):].tolist()
    if theirs and theirs[-1] == run.tokenizer.token_to_id(EOS):
        theirs = theirs[:-1]  # ours stops before printing the end-of-text token
    assert ours == theirs and len(ours) > 0


@pytest.mark.parametrize("family,dtype,shard", [
    ("llama", torch.float32, "40KB"), ("llama", torch.bfloat16, None),
    ("qwen2", torch.bfloat16, None)])
def test_import_then_export_gives_the_original_tensors(rng, tmp_path, family, dtype, shard):
    """Bit for bit, in the checkpoint's own dtype, from one file or shards with their index;
    transformers loads the export (as the architecture imported) and its tokenizer."""
    hf_model(rng, tmp_path / "hf", scaling="yarn", tied=bool(rng.integers(2)), dtype=dtype,
             shard=shard, family=family)
    assert shard is None or (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    import_run(tmp_path / "hf", tmp_path / "run")
    assert convert_hf.main(["export", "--run", str(tmp_path / "run"),
                            "--out", str(tmp_path / "out")]) == 0
    a, b = Tensors(tmp_path / "hf"), Tensors(tmp_path / "out")
    assert a.names() == b.names()
    for name in a.names():
        assert a[name].dtype == b[name].dtype
        np.testing.assert_array_equal(a[name].view(np.uint8), b[name].view(np.uint8))
    original = json.loads((tmp_path / "hf" / "config.json").read_text())
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(exported) is FAMILIES[family][1]
    assert exported.config.rope_parameters == original["rope_parameters"]
    assert exported.config.tie_word_embeddings == original["tie_word_embeddings"]
    text = " ".join(rng.choice(["abc", "defg", "hij", "klmnop", "ba"], 20))
    ours = open_run(tmp_path / "run").tokenizer.encode(text).ids
    assert AutoTokenizer.from_pretrained(tmp_path / "out")(text).input_ids == ours


def test_trained_rope_is_what_transformers_reads_back(rng, tmp_path):
    """A run whose rope_theta was raised (the extension recipe) exports that base, and
    transformers' logits from the export are ours."""
    hf_model(rng, tmp_path / "hf")
    run = import_run(tmp_path / "hf", tmp_path / "run", "--config.model.rope_theta=500000.0",
                     "--config.data.seq_len=64")
    assert convert_hf.main(["export", "--run", str(run.directory), "--out", str(tmp_path / "out"),
                            "--dtype", "float32"]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    assert exported.config.rope_parameters["rope_theta"] == 500000.0
    tokens = rng.integers(0, run.config.model.vocab_size, (1, 48))
    assert relative(our_logits(run, tokens), hf_logits(exported, tokens)) < 1e-4


def run_cli(capsys, *args):
    code = convert_hf.main(list(args))
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


def test_unsupported_models_and_bad_paths_are_one_line(rng, tmp_path, capsys):
    hf_model(rng, tmp_path / "bias", attention_bias=True)
    code, line = run_cli(capsys, "import", "--hf", str(tmp_path / "bias"), "--out", str(tmp_path / "r1"))
    assert code == 2 and line.startswith("error: config.json: attention_bias=true")
    assert not (tmp_path / "r1").exists()

    hf_model(rng, tmp_path / "ok")
    cfg = json.loads((tmp_path / "ok" / "config.json").read_text())
    (tmp_path / "ok" / "config.json").write_text(json.dumps({**cfg, "hidden_act": "gelu"}))
    code, line = run_cli(capsys, "import", "--hf", str(tmp_path / "ok"), "--out", str(tmp_path / "r2"))
    assert code == 2 and "hidden_act='gelu'" in line
    (tmp_path / "ok" / "config.json").write_text(json.dumps({**cfg, "model_type": "mpt"}))
    code, line = run_cli(capsys, "import", "--hf", str(tmp_path / "ok"), "--out", str(tmp_path / "r2"))
    assert code == 2 and "only LLaMA-architecture decoders convert" in line
    (tmp_path / "ok" / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    code, line = run_cli(capsys, "import", "--hf", str(tmp_path / "ok"), "--out", str(tmp_path / "r2"))
    assert code == 2 and "GPT-2 (model_type='gpt2') does not convert: learned absolute" in line
    (tmp_path / "ok" / "config.json").write_text(json.dumps(
        {**cfg, "rope_parameters": {"rope_type": "linear", "factor": 0.5, "rope_theta": 1e4}}))
    code, line = run_cli(capsys, "import", "--hf", str(tmp_path / "ok"), "--out", str(tmp_path / "r2"))
    assert code == 2 and "model.rope_scaling.factor=0.5 must be >= 1" in line
    (tmp_path / "ok" / "config.json").write_text(json.dumps(cfg))

    weights = tmp_path / "ok" / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) // 2])
    code, line = run_cli(capsys, "import", "--hf", str(tmp_path / "ok"), "--out", str(tmp_path / "r3"))
    assert code == 2 and line.startswith("error: ") and "model.safetensors" in line
    weights.write_bytes(whole)

    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    code, line = run_cli(capsys, "import", "--hf", str(tmp_path / "ok"), "--out", str(tmp_path / "taken"))
    assert code == 2 and "already exists and is not empty" in line
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"

    code, line = run_cli(capsys, "import", "--hf", str(tmp_path / "nowhere"), "--out", str(tmp_path / "r4"))
    assert code == 2 and "no config.json" in line


def test_train_from_an_import_then_export_to_transformers(rng, tmp_path):
    """The whole path: import, train.py from the import's weights at 4x its context with a
    raised RoPE base (configs/from_run.py), export the trained run (the HF side files come
    from the import it started from), and transformers' logits from the export are ours. The
    training is train.py's entry after its flags (``--config configs/from_run.py:RUN_DIR
    --config.a.b=v ...``), in this process: the path is what is checked, not a process start
    (a train.py process given ``FILE.py:RUN_DIR``: configs/extend.py's printed command, run in
    tests/test_readme_commands.py)."""
    import tests.trained_run as tr
    from configs.loading import load
    hf_model(rng, tmp_path / "hf", kv_heads=2)
    import_run(tmp_path / "hf", tmp_path / "base")
    text = tmp_path / "docs.jsonl"
    text.write_text("".join(json.dumps({"text": " ".join(rng.choice(["abc", "defg", "hij", "ba"], 80))})
                            + "\n" for _ in range(40)))
    config = load(f"configs/from_run.py:{tmp_path / 'base'}", [
        "data.seq_len=64", "data.batch_size=4", "data.source=jsonl", f"data.path={text}",
        f"data.cache_dir={tmp_path / 'cache'}", "model.rope_theta=400000.0", "mesh.sequence=4",
        "attention.block_q=8", "attention.block_kv=8", "train.steps=3", "train.lr=1e-3",
        "train.warmup_steps=0", "train.log_every=1", "train.eval_batches=0"])
    done = tr.entry_of(config, tmp_path / "long")
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"starting from the weights of step 0 ({tmp_path / 'base'}" in done.stdout + done.stderr
    assert convert_hf.main(["export", "--run", str(tmp_path / "long"), "--out",
                            str(tmp_path / "out"), "--dtype", "float32"]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out").float().eval()
    assert exported.config.rope_parameters["rope_theta"] == 400000.0
    assert exported.config.max_position_embeddings == 64
    run = open_run(tmp_path / "long")
    # The import's generation config reaches the export unchanged (through restore_from).
    imported, exported_gen = (json.loads((tmp_path / d / "generation_config.json").read_text())
                              for d in ("hf", "out"))
    assert exported_gen == imported
    tokens = rng.integers(0, run.config.model.vocab_size, (1, 64))
    trained = our_logits(run, tokens)
    assert relative(trained, hf_logits(exported, tokens)) < 1e-4
    before = hf_logits(AutoModelForCausalLM.from_pretrained(tmp_path / "hf").float().eval(), tokens)
    assert relative(trained, before) > 1e-3  # the export holds the trained weights, not the import's


def test_eval_and_passkey_read_an_import_as_it_is(rng, tmp_path):
    """scripts/eval.py and eval_passkey.py take an import's run directory (tied head here):
    its tokenizer, its weights, its mesh. Their main() in this process: the scripts' own
    processes run in tests/test_generate_eval.py and tests/test_eval_passkey.py."""
    import importlib
    hf_model(rng, tmp_path / "hf", scaling="linear", tied=True)
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": " ".join(rng.choice(["abc", "defg", "hij"], 60))})
                            + "\n" for _ in range(30)))
    import_run(tmp_path / "hf", tmp_path / "run", "--config.data.source=jsonl",
               f"--config.data.path={docs}", f"--config.data.cache_dir={tmp_path / 'cache'}",
               "--config.data.seq_len=32", "--config.data.batch_size=8")
    run = str(tmp_path / "run")
    assert importlib.import_module("scripts.eval").main(
        ["--run", run, "--batches", "1", "--buckets", "2"]) == 0
    result = json.loads((tmp_path / "run" / "eval" / "eval.json").read_text())
    assert result["step"] == 0 and result["tokens"] > 0 and np.isfinite(result["loss"])
    assert importlib.import_module("scripts.eval_passkey").main(
        ["--run", run, "--lengths", "128", "--depths", "0.5", "--trials", "2"]) == 0
    grid = json.loads((tmp_path / "run" / "eval" / "passkey.json").read_text())
    assert grid["step"] == 0 and grid["trials"] == 2


@pytest.mark.parametrize("scaling", ["linear", "dynamic", "yarn", "llama3"])
def test_released_checkpoints_rope_spelling_reads_the_same(rng, tmp_path, scaling):
    """Released checkpoints carry rope_theta + rope_scaling (older ones with "type", not
    "rope_type"); transformers 5 writes rope_parameters. Both import to the same model (whose
    logits against transformers' are test_imported_logits_match_transformers_past_the_original_
    context's, for every scaling), and transformers reads the old spelling to the same logits."""
    model = hf_model(rng, tmp_path / "hf", scaling=scaling)
    new = import_run(tmp_path / "hf", tmp_path / "new")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    params = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, "rope_scaling": params}))
    old = import_run(tmp_path / "hf", tmp_path / "old")
    assert old.config.model.to_dict() == new.config.model.to_dict()
    assert old.config.model.rope_scaling.type == scaling
    legacy = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").float().eval()
    tokens = rng.integers(0, old.config.model.vocab_size, (1, 3 * ORIGINAL))
    np.testing.assert_array_equal(hf_logits(legacy, tokens), hf_logits(model, tokens))


LLAMA3_ORIGINAL = 64  # the small models' original context: past it the llama3 scaling matters


def llama3_model(rng, directory: pathlib.Path, *, tied: bool):
    """A random LlamaForCausalLM shaped like Llama 3.x, small: 16 query heads on 8 KV heads,
    RoPE base 500,000 with llama3 scaling (Llama-3.2's factor 32 when tied, 3.1-Instruct's 8
    and its three end-of-reply tokens when not),
    the Llama 3 style tokenizer, and config.json in the released checkpoints' spelling
    (rope_theta + rope_scaling). Head width 16 puts RoPE frequencies in all three bands of
    the scaling: kept, smoothed and divided by the factor."""
    directory.mkdir(parents=True)
    words = ["".join(rng.choice(list("abcdefghijklmnop"), rng.integers(2, 8))) for _ in range(300)]
    tok = llama3_tokenizer.build([" ".join(rng.choice(words, 60)) for _ in range(80)], 400)
    (directory / "tokenizer.json").write_text(tok.to_str())
    (directory / "tokenizer_config.json").write_text(json.dumps(llama3_tokenizer.TOKENIZER_CONFIG))
    eos = tok.token_to_id(llama3_tokenizer.EOS)
    if not tied:  # as Llama-3.1-8B-Instruct: a reply also ends at <|eom_id|> or <|eot_id|>
        eos = [eos, tok.token_to_id("<|eom_id|>"), tok.token_to_id("<|eot_id|>")]
    scaling = {"rope_type": "llama3", "factor": 32.0 if tied else 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": LLAMA3_ORIGINAL}
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=256, intermediate_size=384,
                      num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=8,
                      max_position_embeddings=4 * LLAMA3_ORIGINAL, rms_norm_eps=1e-5,
                      rope_theta=500000.0, rope_scaling=scaling, tie_word_embeddings=tied,
                      bos_token_id=tok.token_to_id(llama3_tokenizer.BOS), eos_token_id=eos)
    torch.manual_seed(int(rng.integers(2**31)))
    model = LlamaForCausalLM(cfg).float()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    model.save_pretrained(directory)
    released = json.loads((directory / "config.json").read_text())
    params = released.pop("rope_parameters", None) or released.pop("rope_scaling")
    released["rope_theta"] = params.pop("rope_theta", 500000.0)
    (directory / "config.json").write_text(json.dumps({**released, "rope_scaling": params}))
    return model.eval()


@pytest.mark.parametrize("tied", [True, False], ids=["tied_3.2", "untied_3.1"])
def test_llama3_shaped_import_gives_transformers_logits_and_tokens_and_exports_back(
        rng, tmp_path, tied):
    model = llama3_model(rng, tmp_path / "hf", tied=tied)
    run = import_run(tmp_path / "hf", tmp_path / "run")
    m, s = run.config.model, run.config.model.rope_scaling
    assert (m.num_heads, m.num_kv_heads, m.tie_embeddings, m.rope_theta) == (16, 8, tied, 500000.0)
    assert (s.type, s.factor, s.original_max_len, s.low_freq_factor, s.high_freq_factor) == \
        ("llama3", 32.0 if tied else 8.0, LLAMA3_ORIGINAL, 1.0, 4.0)
    tokens = rng.integers(0, m.vocab_size, (2, 3 * LLAMA3_ORIGINAL))
    assert relative(our_logits(run, tokens), hf_logits(model, tokens)) < 1e-4
    # The import's tokenizer is the HF one: <|begin_of_text|> first, the same ids.
    text = " ".join(rng.choice(["abc", "defg", "hij", "klmnop", "ba", "1234", "日本"], 20))
    ours = run.tokenizer.encode(text).ids
    assert ours[0] == model.config.bos_token_id
    assert AutoTokenizer.from_pretrained(tmp_path / "hf")(text).input_ids == ours

    assert convert_hf.main(["export", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 0
    a, b = Tensors(tmp_path / "hf"), Tensors(tmp_path / "out")
    assert a.names() == b.names() and ("lm_head.weight" in a.names()) != tied
    for name in a.names():
        np.testing.assert_array_equal(a[name], b[name])
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    for key in ("rope_parameters", "tie_word_embeddings", "bos_token_id", "eos_token_id",
                "num_key_value_heads"):
        assert getattr(exported.config, key) == getattr(model.config, key), key
    assert AutoTokenizer.from_pretrained(tmp_path / "out")(text).input_ids == ours


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """One random Qwen2ForCausalLM (7 query heads per kv head, untied, yarn, biases far from
    zero) and its import, shared by the Qwen2 tests below."""
    seed = np.random.SeedSequence().entropy
    rng = np.random.default_rng(seed)
    d = tmp_path_factory.mktemp("qwen2")
    model = hf_model(rng, d / "hf", scaling="yarn", family="qwen2")
    run = import_run(d / "hf", d / "run", "--config.data.seq_len=128")
    return model, run, seed


@pytest.mark.parametrize("layout", ["dense", "contiguous", "striped", "zigzag"])
def test_qwen2_gives_transformers_logits_dense_and_with_ring_attention_in_every_layout(
        qwen2, rng, layout):
    model, run, seed = qwen2
    m = run.config.model
    assert (m.qkv_bias, m.num_heads, m.num_kv_heads, m.tie_embeddings) == (True, 14, 2, False), seed
    L = 4 * ORIGINAL
    tokens = rng.integers(0, m.vocab_size, (2, L))
    if layout == "dense":
        got = our_logits(run, tokens)
    else:
        mesh = make_mesh({"data": 1, "fsdp": 2, "sequence": 4, "tensor": 1})
        backend = AttentionBackend(impl="ring", layout=layout, mesh=mesh, block_q=8, block_kv=8)
        got = our_logits(run, tokens, backend, permutation(layout, L, 4))
    assert relative(got, hf_logits(model, tokens)) < 1e-4, seed


def test_qwen2_greedy_generation_gives_transformers_tokens(qwen2, rng, capsys):
    model, run, _ = qwen2
    assert_greedy_tokens_match(rng, run, model, capsys)


def test_qwen2_sliding_window_fields_read_as_transformers_reads_them(qwen2):
    """Released Qwen2 configs carry sliding_window and max_window_layers with
    use_sliding_window false (and no layer_types): nothing slides, the import is the same.
    With it true, the window is the model's on the layers transformers slides: every layer
    (max_window_layers 0), none, or the upper ones (model.layer_types). An export with a
    window is a Qwen2 config in which transformers slides every layer."""
    _, run, _ = qwen2
    cfg = json.loads((run.directory / "hf" / "config.json").read_text())
    want = hf_config.model_fields(cfg)
    assert want["qkv_bias"] is True and want["sliding_window"] == 0
    released = {k: v for k, v in cfg.items() if k != "layer_types"}
    released.update(use_sliding_window=False, sliding_window=32, max_window_layers=1)
    # 2 layers: from layer 0 on is every layer, from 1 on is layer 1, from 2 on is none
    for window_layers, window in ((0, 32), (1, None), (2, 0)):
        case = {**released, "max_window_layers": window_layers}
        assert hf_config.model_fields(case) == want
        case["use_sliding_window"] = True
        layer_types = Qwen2Config(**case).layer_types
        assert layer_types.count("sliding_attention") == {32: 2, None: 1, 0: 0}[window]
        # the upper layer alone slides: per-layer kinds (model.layer_types)
        got = {**want, "sliding_window": window} if window is not None else \
            {**want, "sliding_window": 32, "layer_types": "full,sliding"}
        assert hf_config.model_fields(case) == got
        # transformers 5 writes the list out: read the same from it
        listed = {**case, "layer_types": layer_types, "max_window_layers": 99}
        assert hf_config.model_fields(listed) == got
        if window is None:
            with pytest.raises(ConversionError, match=r"^config.json: layer_types has "
                                                      r"'sliding_attention' layers but no "
                                                      r"sliding_window applies"):
                hf_config.model_fields({**released, "layer_types": layer_types})
    m = with_window(run, 24).config.model
    out = hf_config.hf_config(m, seq_len=128, dtype="float32", base=cfg, bos=None, eos=None)
    assert (out["model_type"], out["use_sliding_window"], out["sliding_window"]) == \
        ("qwen2", True, 24)
    theirs = Qwen2Config(**out)
    assert theirs.layer_types == ["sliding_attention"] * 2 and theirs.sliding_window == 24
    assert hf_config.model_fields(out)["sliding_window"] == 24


def test_qwen2_with_every_layer_sliding_gives_transformers_logits(qwen2, rng):
    """The qwen2 fixture's weights in a Qwen2 that slides every layer (use_sliding_window,
    max_window_layers 0), at 4 windows: the window read from that config.json gives
    transformers' logits."""
    model, run, seed = qwen2
    cfg = {**json.loads((run.directory / "hf" / "config.json").read_text()),
           "use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 0}
    cfg.pop("layer_types", None)
    sliding = Qwen2ForCausalLM(Qwen2Config(**cfg, attn_implementation="eager")).eval()
    sliding.load_state_dict(model.state_dict())
    tokens = rng.integers(0, run.config.model.vocab_size, (1, 4 * WINDOW))
    got = our_logits(with_window(run, hf_config.model_fields(cfg)["sliding_window"]), tokens)
    theirs = hf_logits(sliding, tokens)
    assert relative(got, theirs) < 1e-4, seed
    assert relative(got, hf_logits(model, tokens)) > 1e-2, seed  # the window matters here


WINDOW = 12  # the Mistral tests' window: not a multiple of the 8-token tiles, under max_pos 16


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """One random MistralForCausalLM with sliding_window=WINDOW (transformers' eager attention,
    which applies the window through the mask create_sliding_window_causal_mask builds) and its
    import, shared by the Mistral tests below."""
    seed = np.random.SeedSequence().entropy
    rng = np.random.default_rng(seed)
    d = tmp_path_factory.mktemp("mistral")
    model = hf_model(rng, d / "hf", family="mistral", sliding_window=WINDOW,
                     attn_implementation="eager")
    run = import_run(d / "hf", d / "run", "--config.data.seq_len=128")
    return model, run, seed


@pytest.mark.parametrize("layout", ["dense", "contiguous", "striped"])
def test_mistral_sliding_window_gives_transformers_logits_dense_and_with_ring_attention(
        mistral, rng, layout):
    """At 5 windows and more, dense and ring attention on 4 devices; the window matters:
    without it ours is transformers' without it, far from transformers' with it."""
    model, run, seed = mistral
    m = run.config.model
    assert (m.sliding_window, m.qkv_bias, m.num_kv_heads) == (WINDOW, False, 2), seed
    assert model.config._attn_implementation == "eager"
    L = 64
    tokens = rng.integers(0, m.vocab_size, (2, L))
    theirs = hf_logits(model, tokens)
    if layout == "dense":
        got = our_logits(run, tokens)
        full = our_logits(with_window(run, 0), tokens)
        model.config.sliding_window = None  # MistralModel reads it at every call
        try:
            theirs_full = hf_logits(model, tokens)
        finally:
            model.config.sliding_window = WINDOW
        assert relative(full, theirs_full) < 1e-4, seed
        assert relative(full, theirs) > 1e-2 and relative(theirs_full, theirs) > 1e-2, seed
    else:
        mesh = make_mesh({"data": 1, "fsdp": 2, "sequence": 4, "tensor": 1})
        backend = AttentionBackend(impl="ring", layout=layout, mesh=mesh, block_q=8, block_kv=8)
        got = our_logits(run, tokens, backend, permutation(layout, L, 4))
    assert relative(got, theirs) < 1e-4, seed


def test_mistral_greedy_generation_gives_transformers_tokens(mistral, rng, capsys):
    model, run, _ = mistral
    assert_greedy_tokens_match(rng, run, model, capsys)  # 60 tokens: 5 windows


def test_mistral_exports_back_bit_for_bit_with_its_window(mistral, tmp_path):
    """Export writes a MistralForCausalLM with the same tensors (bit for bit) and
    sliding_window; transformers reads it so. Without a window the model exports as LLaMA."""
    _, run, _ = mistral
    assert convert_hf.main(["export", "--run", str(run.directory), "--out",
                            str(tmp_path / "out")]) == 0
    a, b = Tensors(run.directory.parent / "hf"), Tensors(tmp_path / "out")
    assert a.names() == b.names()
    for name in a.names():
        assert a[name].dtype == b[name].dtype
        np.testing.assert_array_equal(a[name].view(np.uint8), b[name].view(np.uint8))
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (written["model_type"], written["sliding_window"]) == ("mistral", WINDOW)
    assert not {"use_sliding_window", "max_window_layers", "layer_types"} & set(written)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(exported) is MistralForCausalLM and exported.config.sliding_window == WINDOW
    base = json.loads((run.directory / "hf" / "config.json").read_text())
    plain = hf_config.hf_config(with_window(run, 0).config.model, seq_len=128, dtype="float32",
                                base=base, bos=None, eos=None)
    assert (plain["model_type"], plain["architectures"]) == ("llama", ["LlamaForCausalLM"])
    assert "sliding_window" not in plain and LlamaConfig(**plain).num_hidden_layers == 2


def test_mistral_v01_window_and_v02_null_both_import(mistral):
    """Mistral-7B-v0.1's config.json has sliding_window 4096 (under max_position_embeddings
    32768), v0.2 and later null: the first slides every layer by 4096, the second is full
    attention; nothing else differs. LLaMA never reads the key."""
    _, run, _ = mistral
    cfg = json.loads((run.directory / "hf" / "config.json").read_text())
    want = hf_config.model_fields(cfg)
    assert want["sliding_window"] == WINDOW
    v01 = {**cfg, "sliding_window": 4096, "max_position_embeddings": 32768}
    v02 = {**cfg, "sliding_window": None, "max_position_embeddings": 32768}
    assert hf_config.model_fields(v01) == {**want, "sliding_window": 4096}
    assert hf_config.model_fields(v02) == {**want, "sliding_window": 0}
    assert MistralConfig(**v02).sliding_window is None
    llama = {**v01, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    assert hf_config.model_fields(llama)["sliding_window"] == 0
    for bad in (0, -1, 2.5):
        with pytest.raises(ConversionError, match=rf"^config.json: sliding_window={bad}; it "
                                                  rf"must be a whole number of tokens >= 1"):
            hf_config.model_fields({**cfg, "sliding_window": bad})


# (config.json beyond a LLaMA one, what the one line must say): every known architecture that
# does not convert names itself and what it has that this model lacks.
REFUSALS = {
    "gemma": ({"model_type": "gemma", "architectures": ["GemmaForCausalLM"],
               "hidden_act": "gelu_pytorch_tanh"}, ["Gemma (model_type='gemma')", "GeGLU"]),
    "gemma2": ({"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"],
                "attn_logit_softcapping": 50.0, "sliding_window": 4096},
               ["Gemma 2 (", "attention logit soft-capping"]),
    "olmo2": ({"model_type": "olmo2", "architectures": ["Olmo2ForCausalLM"]},
              ["OLMo 2 (", "norms after attention and MLP instead of before"]),
    "qwen2_moe": ({"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"],
                   "num_experts": 60}, ["Qwen2-MoE (", "mixture-of-experts MLP (num_experts)"]),
    "any moe": ({"model_type": "granitemoe", "architectures": ["GraniteMoeForCausalLM"],
                 "num_local_experts": 32},
                ["num_local_experts=32: a mixture-of-experts MLP does not convert "
                 "(GraniteMoeForCausalLM)"]),
    "any softcap": ({"model_type": "custom", "architectures": ["CustomForCausalLM"],
                     "final_logit_softcapping": 30.0},
                    ["final_logit_softcapping=30.0: logit soft-capping does not convert"]),
    "phi3": ({"model_type": "phi3", "architectures": ["Phi3ForCausalLM"]},
             ["Phi-3 (", "fused qkv_proj and gate_up_proj"]),
    "falcon": ({"model_type": "falcon", "architectures": ["FalconForCausalLM"]},
               ["Falcon (", "parallel attention and MLP"]),
    "gpt_neox": ({"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"]},
                 ["GPT-NeoX (", "partial rotary embedding"]),
    "deepseek_v3": ({"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
                     "n_routed_experts": 256}, ["DeepSeek-V3 (", "multi-head latent attention"]),
    "ministral layers": ({"model_type": "mistral", "architectures": ["MistralForCausalLM"],
                          "sliding_window": 4096, "max_position_embeddings": 32768,
                          "layer_types": ["sliding_attention", "full_attention"]},
                         ["model_type 'mistral' with layer_types mixing", "MistralForCausalLM "
                          "slides every layer by sliding_window=4096 and ignores layer_types"]),
    "llama o bias": ({"attention_bias": True},
                     ["attention_bias=true (biases on q, k, v and o); only Qwen2's q/k/v biases"]),
}


def assert_refused(cfg: dict, fragments) -> str:
    """config.json ``cfg`` stops the import in one line holding each of ``fragments``."""
    with pytest.raises(ConversionError) as e:
        hf_config.model_fields(cfg)
    line = str(e.value)
    assert line.startswith("config.json: ") and "\n" not in line
    for fragment in fragments:
        assert fragment in line, line
    return line


@pytest.mark.parametrize("name", list(REFUSALS))
def test_each_known_architecture_that_does_not_convert_is_one_line_naming_it(name):
    changes, fragments = REFUSALS[name]
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 300,
           "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "intermediate_size": 96, "max_position_embeddings": 64, **changes}
    line = assert_refused(cfg, fragments)
    if changes.get("model_type", "llama") not in ("llama", "mistral", "qwen2"):
        assert line.endswith(", ".join(hf_config.ARCHITECTURES)), line
