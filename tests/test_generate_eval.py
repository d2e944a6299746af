"""scripts/generate.py and scripts/eval.py on a real trained run directory."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tokenizers import Tokenizer

import trained_run as tr

PROMPT = "def main(argv):\n    "


@pytest.fixture(scope="module")
def run_dir():
    return tr.reference()


def generated(run_dir, tmp_path, name, *args):
    out_json = tmp_path / f"{name}.json"
    out = tr.script("generate.py", "--run", run_dir, "--prompt", PROMPT, "--max-new-tokens", 12,
                    "--json", out_json, *args)
    assert out.returncode == 0, out.stderr[-3000:]
    return out, json.loads(out_json.read_text())


@pytest.fixture(scope="module")
def greedy_run(run_dir, tmp_path_factory):
    """generate.py --greedy on the trained run, once for the tests that compare with it."""
    return generated(run_dir, tmp_path_factory.mktemp("greedy"), "greedy", "--greedy")


def test_generate_greedy_matches_the_model_and_top1_sampling(run_dir, greedy_run, tmp_path):
    out, greedy = greedy_run
    tok = Tokenizer.from_file(str(run_dir / "tokenizer.json"))
    assert greedy["step"] == tr.STEPS and 1 <= len(greedy["tokens"]) <= 12
    assert out.stdout == PROMPT + greedy["text"] + "\n"
    assert tok.decode(greedy["tokens"]) == greedy["text"]
    assert greedy["prompt_tokens"] == tok.encode(PROMPT).ids

    # The first greedy token is the argmax of the trained model's next-token logits, computed
    # here independently on the run's own 8-device mesh and layout.
    from checkpoints.manager import Checkpoints
    from parallel.layouts import inverse, permutation
    from parallel.mesh import make_mesh
    from training.state import Trainer
    c = tr.config()
    trainer = Trainer(c, make_mesh(c.mesh))
    params = Checkpoints(run_dir / "checkpoints", log=print).restore_params(
        trainer.abstract_state.params).params
    L, ids = c.data.seq_len, greedy["prompt_tokens"]
    tokens = np.zeros((c.data.batch_size, L), np.int32)
    tokens[:, :len(ids)] = ids
    mesh_seq = trainer.mesh.shape["sequence"]
    perm = permutation(c.attention.layout, L, mesh_seq)
    positions = np.broadcast_to(np.arange(L, dtype=np.int32), tokens.shape)
    batch = {"tokens": tokens[:, perm], "positions": positions[:, perm],
             "segment_ids": np.ones_like(tokens)}
    logits = jax.jit(lambda p, b: nnx.merge(trainer.graphdef, p)(
        b["tokens"], b["positions"], b["segment_ids"]))(params, {
            k: jax.device_put(np.ascontiguousarray(v), trainer.batch_shardings[k])
            for k, v in batch.items()})
    natural = np.asarray(logits)[0][inverse(perm)]
    next_logits = natural[len(ids) - 1, :tok.get_vocab_size()]
    assert greedy["tokens"][0] == int(jnp.argmax(next_logits))

    # Sampling among the single likeliest token is greedy decoding through the sampling path.
    _, top1 = generated(run_dir, tmp_path, "top1", "--top-k", 1, "--temperature", 0.7,
                        "--seed", 3)
    assert top1["tokens"] == greedy["tokens"] and not top1["greedy"]


def test_generate_bad_arguments_are_one_line(run_dir, tmp_path):
    out = tr.script("generate.py", "--run", tmp_path, "--prompt", "x")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("error: --run ")
    assert "Traceback" not in out.stderr


def test_eval_table_plot_and_json(run_dir, tmp_path):
    out_dir = tmp_path / "eval"
    out = tr.script("eval.py", "--run", run_dir, "--batches", 1, "--buckets", 8, "--out", out_dir)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((out_dir / "eval.json").read_text())
    # One held-out batch and the final weights: the loss the run itself logged at its end.
    logged = tr.evals(run_dir)[tr.STEPS]["eval_loss"]
    assert result["step"] == tr.STEPS and abs(result["loss"] - logged) <= 1e-5 * logged
    assert result["layout"] == "striped" and result["mesh"]["sequence"] == 4

    buckets = result["buckets"]
    assert len(buckets) == 8 and buckets[0]["start"] == 0
    assert buckets[-1]["end"] == tr.config().data.seq_len
    assert sum(b["tokens"] for b in buckets) == result["tokens"] > 0
    weighted = sum(b["loss"] * b["tokens"] for b in buckets if b["tokens"]) / result["tokens"]
    assert abs(weighted - result["loss"]) <= 1e-5 * result["loss"]

    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"run {run_dir}, step {tr.STEPS}: held-out loss ")
    rows = [ln.split() for ln in lines[2:10]]
    assert [r[0] for r in rows] == [f"{b['start']}-{b['end'] - 1}" for b in buckets]
    png = (out_dir / "loss_by_position.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_context_lengths_and_buckets_against_a_direct_count():
    """Each token's context (tokens of its own document before it) and the bucketed mean loss,
    on fresh random packed rows, against a plain per-token loop."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("eval_script", tr.ROOT / "scripts" / "eval.py")
    ev = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ev)
    rng = np.random.default_rng()
    B, L, buckets = 3, 64, 4
    seg = np.sort(rng.integers(1, 6, (B, L)), axis=1)  # documents 1.. in order, random lengths
    loss = rng.random((B, L))
    mask = (rng.random((B, L)) < 0.8).astype(np.float32)
    got = ev.context_lengths(seg)
    for b in range(B):
        for i in range(L):
            assert got[b, i] == sum(seg[b, j] == seg[b, i] for j in range(i))
    rows = ev.bucketize(loss * mask, mask, got, L, buckets)  # eval's losses come masked
    for r in rows:
        sel = [(b, i) for b in range(B) for i in range(L)
               if r["start"] <= got[b, i] < r["end"] and mask[b, i]]
        assert r["tokens"] == len(sel)
        if sel:
            want = sum(loss[b, i] for b, i in sel) / len(sel)
            assert abs(r["loss"] - want) <= 1e-9 * want


def test_generate_is_greedy_by_default_and_json_alone_prints_one_object(run_dir, greedy_run):
    """--json with no file prints exactly one JSON object on stdout: the ids and text of the
    default (greedy) continuation, equal to --greedy's. With more new tokens the cache grows
    and the first tokens stay the same: its empty slots change nothing."""
    _, greedy = greedy_run
    out = tr.script("generate.py", "--run", run_dir, "--prompt", PROMPT, "--max-new-tokens", 12,
                    "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    record = json.loads(out.stdout)  # the whole of stdout: one object, nothing else
    assert set(record) == {"ids", "text"} and out.stdout.count("\n") == 1
    assert record["ids"] == greedy["tokens"] and record["text"] == greedy["text"]

    longer = tr.script("generate.py", "--run", run_dir, "--prompt", PROMPT, "--max-new-tokens",
                       80, "--json")
    assert longer.returncode == 0, longer.stderr[-3000:]
    ids = json.loads(longer.stdout)["ids"]
    assert ids[:len(record["ids"])] == record["ids"]


def test_window_is_the_smallest_multiple_of_64_capped_at_seq_len(rng):
    from evaluation import recompute as gen
    for _ in range(200):
        prompt, new = int(rng.integers(1, 5000)), int(rng.integers(1, 5000))
        seq_len = int(rng.integers(1, 200)) * 64
        w = gen.window_size(prompt, new, seq_len)
        if prompt + new <= seq_len:
            assert w % 64 == 0 and prompt + new <= w < prompt + new + 64 and w <= seq_len
        else:
            assert w == seq_len
