"""scripts/eval_passkey.py and data/passkey.py: prompt construction, the layout path against
one-device dense, the command line, and a trained model against an untrained one."""
import importlib.util
import json

import jax
import numpy as np
import pytest

import trained_run as tr
from conftest import RUN_CODEGEN
from helpers import initial_params, initial_state
from data import passkey

spec = importlib.util.spec_from_file_location("eval_passkey", tr.ROOT / "scripts" / "eval_passkey.py")
ep = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ep)


@pytest.fixture(scope="module")
def tokenizer():
    from data.tokenizer import train_bpe
    docs_rng = np.random.default_rng(0)
    return train_bpe([passkey.document(docs_rng, 6) for _ in range(200)], 400)


def test_prompts_have_the_requested_length_and_needle_depth(tokenizer, rng):
    for _ in range(20):
        key = passkey.random_key(rng)
        # the needle's and the answer's tokens depend on the key's digits (BPE merges)
        fixed = passkey.fixed_tokens(tokenizer, key)
        length = int(rng.integers(fixed + 2, 600))
        depth = float(rng.choice([0.0, 1.0, rng.random()]))
        e = passkey.build(tokenizer, length, depth, key)
        assert e.tokens.shape == (length,) and e.tokens.dtype == np.int32
        assert len(key) == passkey.DIGITS and key[0] != "0"
        needle = tokenizer.decode(e.tokens[e.needle_start:e.needle_start + e.needle_len].tolist())
        assert needle == passkey.NEEDLE.format(key=key)
        assert tokenizer.decode(e.tokens[e.answer_start:].tolist()) == f" {key}"
        assert tokenizer.decode(e.tokens[:e.answer_start].tolist()).endswith(passkey.QUESTION)
        # The needle appears once, at `depth` of the filler: the filler tokens before it over
        # all filler tokens, rounded to a token.
        text = tokenizer.decode(e.tokens.tolist())
        assert text.count("pass key is") == 2 and text.count(key) == 3
        question = len(tokenizer.encode(passkey.QUESTION, add_special_tokens=False).ids)
        prefix = len(passkey.prefix_ids(tokenizer))
        assert prefix == 1 and e.tokens[0] == tokenizer.token_to_id("<|endoftext|>")
        filler = e.answer_start - question - e.needle_len - prefix
        assert abs(e.needle_start - prefix - depth * filler) <= 0.5 + 1e-9
        before = tokenizer.decode(e.tokens[:e.needle_start].tolist())
        assert "pass" not in before and not any(ch.isdigit() for ch in before)


def _config(layout: str, shards: int):
    c = tr.config()
    c.model.update(vocab_size=400, d_model=32, ffn_dim=64, num_heads=4, num_kv_heads=2)
    impl = "dense" if shards == 1 else "ring"
    c.attention.update(impl=impl, layout=layout, block_q=8, block_kv=8)
    c.mesh.update(data=1, fsdp=2 if shards > 1 else 1, sequence=shards, tensor=1)
    c.data.update(batch_size=4)
    return c


def random_params(rng, trainer):
    """The model's parameters drawn from ``rng`` (norm scales around 1), on the trainer's
    devices: no initialization program to compile."""
    def draw(path, leaf):
        scale = "scale" in jax.tree_util.keystr(path)
        x = rng.uniform(0.5, 1.5, leaf.shape) if scale else rng.normal(0.0, 0.2, leaf.shape)
        return x.astype(leaf.dtype)
    params = jax.tree_util.tree_map_with_path(draw, trainer.abstract_state.params)
    return jax.device_put(params, trainer.param_shardings)


def test_layout_path_matches_one_device_dense(tokenizer, rng):
    """Rows through the ring on 4 devices (x 2 fsdp), striped and contiguous, give the same
    answer logits, argmaxes and prompt losses as one device with dense attention."""
    from parallel.mesh import make_mesh
    dense = ep.Scorer(_config("contiguous", 1), make_mesh(_config("contiguous", 1).mesh,
                                                            jax.devices()[:1]))
    params = random_params(rng, dense.trainer)
    unit = 8 * 4  # the tile (8) on each of 4 shards
    fixed = passkey.fixed_tokens(tokenizer, passkey.random_key(rng))
    length = int(rng.integers(fixed // unit + 1, fixed // unit + 4)) * unit
    examples = [passkey.build(tokenizer, length, float(rng.random()), passkey.random_key(rng))
                for _ in range(3)]  # 3 rows: a pass of 4 with one filler row
    want = dense(params, examples, tokenizer.get_vocab_size())
    for layout in ("striped", "contiguous"):
        c = _config(layout, 4)
        ring = ep.Scorer(c, make_mesh(c.mesh, jax.devices()[:8]))
        placed = jax.device_put(params, ring.trainer.param_shardings)
        got = ring(placed, examples, tokenizer.get_vocab_size())
        for g, w in zip(got, want):
            np.testing.assert_allclose(g["logits"], w["logits"], rtol=2e-4, atol=2e-4)
            assert abs(g["loss"] - w["loss"]) <= 1e-4 * w["loss"]
            assert (g["predicted"] == w["predicted"]).all() and g["correct"] == w["correct"]


@pytest.fixture(scope="module")
def run_dir():
    return tr.reference()


def test_cli_grid_table_json_and_heatmap(run_dir, tmp_path, rng):
    depths = sorted({0.0, 1.0, round(float(rng.random()), 2)})
    trials = int(rng.integers(1, 4))
    out = tr.script("eval_passkey.py", "--run", run_dir, "--lengths", "96,128", "--depths",
                    ",".join(map(str, depths)), "--trials", trials, "--json", tmp_path / "p.json",
                    "--png", tmp_path / "p.png", "--seed", int(rng.integers(1000)))
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "p.json").read_text())
    assert result["lengths"] == [96, 128] and result["depths"] == depths
    assert result["trials"] == trials and result["step"] == tr.STEPS
    for grid in (result["accuracy"], result["answer_token_accuracy"]):
        assert np.shape(grid) == (2, len(depths))
        assert all(0.0 <= v <= 1.0 for row in grid for v in row)
    # An accuracy is a count over `trials` rows.
    assert all(abs(v * trials - round(v * trials)) < 1e-9 for row in result["accuracy"] for v in row)
    assert len(result["loss"]) == 2 and all(np.isfinite(result["loss"]))
    assert result["layout"] == "striped" and result["mesh"]["sequence"] == 4
    assert result["rows_per_pass"] % (result["mesh"]["data"] * result["mesh"]["fsdp"]) == 0
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"run {run_dir}, step {tr.STEPS}: passkey accuracy")
    assert [ln.split()[0] for ln in lines[2:4]] == ["96", "128"]
    png = (tmp_path / "p.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, says", [
    (("--lengths", "130"), "error: --lengths: 130 cannot run on the striped layout over 4 "
                           "sequence shards"),
    (("--lengths", "12"), "error: --lengths: 12 is shorter than the needle"),
    (("--lengths", "12x"), "error: --lengths='12x': expected a comma list of integers"),
    (("--depths", "0,1.5"), "error: --depths=0,1.5: every depth must be in [0, 1]"),
])
def test_cli_user_errors_are_one_line(run_dir, args, says, capsys):
    assert ep.main(["--run", str(run_dir), *map(str, args)]) == 2  # in-process: no jax startup
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(says), last
    if "130" in says:
        assert last.endswith("valid lengths near it: 124, 128, 132, 136")


def test_cli_missing_run(tmp_path, capsys):
    assert ep.main(["--run", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: --run ")


def test_a_model_trained_on_passkeys_retrieves_them_and_an_untrained_one_does_not(tokenizer, rng):
    """A tiny model trained briefly on passkey rows of 40 tokens (a minimal loop over the
    trainer's own step) scores well above chance (1 in 90,000 keys) on fresh keys at every
    depth; the same architecture untrained scores nothing. Retrieval appears in about half
    the steps it takes with the defaults (400 or more) when the loss leaves out the key's
    first occurrence, which nothing before it predicts (its gradient is noise), with 8 heads
    rather than 4, weights drawn 3x wider (init_std 0.06) and Adam's b1 at 0.8. (Width
    matters more than steps here: at d_model 64 retrieval takes several times as many steps
    to appear.)"""
    from parallel.mesh import make_mesh
    from training.state import Trainer
    L, rows, steps = 40, 16, 2000
    c = _config("contiguous", 1)
    c.model.update(d_model=128, ffn_dim=256, num_heads=8, num_kv_heads=8, init_std=0.06)
    c.data.update(seq_len=L, batch_size=rows)
    c.train.update(steps=steps, lr=3e-3, warmup_steps=20, min_lr_ratio=1.0, weight_decay=0.0,
                   b1=0.8)
    mesh = make_mesh(c.mesh, jax.devices()[:1])
    trainer, scorer = Trainer(c, mesh), ep.Scorer(c, mesh)

    def batch():
        examples = [passkey.build(tokenizer, L, float(rng.random()), passkey.random_key(rng))
                    for _ in range(rows)]
        tokens = np.stack([e.tokens for e in examples])
        labels = np.zeros_like(tokens)
        labels[:, :-1] = tokens[:, 1:]
        mask = np.ones(tokens.shape, np.float32)
        mask[:, -1] = 0.0
        for i, e in enumerate(examples):  # the needle's key: its tokens are the answer's
            key, row = e.tokens[e.answer_start:].tolist(), e.tokens.tolist()
            at = next(j for j in range(e.needle_start, e.needle_start + e.needle_len)
                      if row[j:j + len(key)] == key)
            mask[i, at - 1:at - 1 + len(key)] = 0.0  # the targets at the key's tokens
        return {"tokens": tokens, "labels": labels, "loss_mask": mask,
                "positions": np.broadcast_to(np.arange(L, dtype=np.int32), tokens.shape),
                "segment_ids": np.ones_like(tokens)}

    def accuracy(params) -> float:
        examples = [passkey.build(tokenizer, L, depth, passkey.random_key(rng))
                    for depth in (0.0, 0.25, 0.5, 0.75, 1.0) for _ in range(16)]
        return float(np.mean([s["correct"] for s in
                              scorer(params, examples, tokenizer.get_vocab_size())]))

    # drawn as the initialiser draws them (its program would take seconds to compile)
    state = initial_state(trainer, initial_params(rng, c, trainer.abstract_state.params))
    untrained = accuracy(state.params)
    # Retrieval appears abruptly, after a number of steps that varies with the seed (150 to
    # 250 in the seeds tried): train until a held-aside check of 80 keys sees 30% of them,
    # then score 80 fresh keys. Stopping on a lucky check and then missing 10% of the fresh
    # keys has odds under 1.2e-4 a check, whatever the model's true accuracy.
    # (conftest's RUN_CODEGEN: code generation only, the same computation up to rounding; the
    # trained accuracy over seeds 1-6 was 0.29-0.63 against the 0.1 asserted)
    step = trainer.train_step.lower(state, batch()).compile(compiler_options=RUN_CODEGEN)
    done = 0
    while done < steps:
        for _ in range(50):
            state, _ = step(state, batch())
        done += 50
        if done >= 100 and accuracy(state.params) >= 0.3:
            break
    trained = accuracy(state.params)
    print(f"untrained {untrained}, trained {trained} after {done} steps")
    # 8 of 80 fresh keys right by chance (1e-5 a key) has probability about 1e-30.
    assert untrained <= 0.05 and trained >= 0.1, (untrained, trained, done)
