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


@pytest.fixture(scope="module")
def greedy_run(run_dir):
    """The README's command as a process of its own, with --json alone (greedy by default):
    (the process's output, its one JSON object). The tests below compare the same script's
    other modes, its main() run in the test process, with it."""
    out = tr.script("generate.py", "--run", run_dir, "--prompt", PROMPT, "--max-new-tokens", 12,
                    "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    return out, json.loads(out.stdout)


def generate(capfd, *args) -> str:
    """scripts/generate.py's main() in this process (its programs compiled by the process
    above, loaded from the run's compilation cache): what it wrote on stdout."""
    from scripts import generate as script
    capfd.readouterr()
    assert script.main([str(a) for a in args]) == 0
    return capfd.readouterr().out


def test_generate_greedy_matches_the_model_and_json_alone_prints_one_object(
        run_dir, greedy_run, tmp_path, capfd):
    """The README's command (greedy by default, --json alone) against the model's own logits;
    --greedy and --json FILE give the same tokens, the text after the prompt, a fuller record."""
    _, record = greedy_run
    tok = Tokenizer.from_file(str(run_dir / "tokenizer.json"))
    ids = tok.encode(PROMPT).ids

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
    L = c.data.seq_len
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
    assert 1 <= len(record["ids"]) <= 12 and record["ids"][0] == int(jnp.argmax(next_logits))

    # --greedy and --json FILE: the text printed after the prompt, the fuller record in FILE
    out = generate(capfd, "--run", run_dir, "--prompt", PROMPT, "--max-new-tokens", 12,
                   "--greedy", "--json", tmp_path / "greedy.json")
    greedy = json.loads((tmp_path / "greedy.json").read_text())
    assert greedy["tokens"] == record["ids"] and greedy["greedy"]
    assert out == PROMPT + greedy["text"] + "\n" and greedy["text"] == record["text"]
    assert tok.decode(greedy["tokens"]) == greedy["text"]
    assert greedy["prompt_tokens"] == ids and greedy["step"] == tr.STEPS
    # --json alone printed exactly one JSON object, the whole of the process's stdout
    out, _ = greedy_run
    assert set(record) == {"ids", "text"} and out.stdout.count("\n") == 1


def test_generate_bad_arguments_are_one_line(tmp_path, capsys):
    from scripts import generate as script
    assert script.main(["--run", str(tmp_path), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("error: --run ")
    assert "Traceback" not in err


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


def test_eval_config_overrides_change_the_run_for_one_evaluation(run_dir, capsys):
    """--config.FIELD=VALUE: the run's config for this evaluation only (a longer row with a
    RoPE scaling, the mesh the devices are simulated for); a bad one is one line."""
    import importlib.util

    from checkpoints.rundir import open_run
    from parallel.host_devices import simulate_for_run
    spec = importlib.util.spec_from_file_location("eval_script", tr.ROOT / "scripts" / "eval.py")
    ev = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ev)
    run = open_run(run_dir, log=lambda m: None)
    args = ev.parse_args(["--run", str(run_dir), "--config.data.seq_len=256",
                          "--config.model.rope_scaling.type=yarn",
                          "--config.model.rope_scaling.factor=2",
                          "--config.model.rope_scaling.original_max_len=128",
                          "--config.mesh.fsdp=1", "--config.mesh.sequence=8"])
    got = ev.with_overrides(run, args.overrides).config
    assert (got.data.seq_len, got.model.rope_scaling.type, got.model.rope_scaling.factor,
            got.mesh.sequence) == (256, "yarn", 2.0, 8)
    assert run.config.data.seq_len == tr.config().data.seq_len  # the run itself is unchanged
    env = {"XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
    assert simulate_for_run(run_dir, environ=env, say=lambda m: None,
                            overrides=args.overrides) == 8
    for bad, message in (("model.rope_scaling.type=linear --config.model.rope_scaling.factor=0.5",
                          "must be >= 1"), ("model.nope=1", "nope"),
                         ("data.seq_len", "is not --config.FIELD=VALUE")):
        capsys.readouterr()
        flags = [f"--config.{b}" for b in bad.split(" --config.")]
        assert ev.main(["--run", str(run_dir), *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err


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


def test_top1_sampling_is_greedy_and_a_longer_cache_changes_nothing(run_dir, greedy_run,
                                                                    tmp_path, capfd, rng):
    """Sampling among the single likeliest token (--top-k 1 --temperature 0.7) is greedy
    decoding through the sampling path; with 80 new tokens instead of 12 the cache grows and
    the first tokens stay the same: its empty slots change nothing."""
    _, record = greedy_run
    generate(capfd, "--run", run_dir, "--prompt", PROMPT, "--max-new-tokens", 80, "--top-k", 1,
             "--temperature", 0.7, "--seed", int(rng.integers(1000)),
             "--json", tmp_path / "top1.json")
    top1 = json.loads((tmp_path / "top1.json").read_text())
    assert not top1["greedy"] and top1["top_k"] == 1
    assert top1["tokens"][:len(record["ids"])] == record["ids"]


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


def test_compare_evals_tables_and_plots_several_results_side_by_side(tmp_path, capsys, rng):
    """scripts/compare_evals.py on eval.json files of random losses: each column is its file's
    bucket losses in order, the last row their overall loss; different buckets stop in a line."""
    from scripts import compare_evals
    results = {}
    for name in ("plain", "yarn"):
        buckets = [{"start": s, "end": s + 64, "tokens": int(rng.integers(1, 99)),
                    "loss": float(rng.uniform(0.5, 7))} for s in range(0, 256, 64)]
        results[name] = {"loss": float(rng.uniform(1, 3)), "buckets": buckets}
        (tmp_path / name).mkdir()
        (tmp_path / name / "eval.json").write_text(json.dumps(results[name]))
    capsys.readouterr()
    assert compare_evals.main([f"{n}={tmp_path / n}" for n in results]
                              + ["--out", str(tmp_path / "cmp.png"), "--mark", "128"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| positions | tokens | plain | yarn |"
    for i, line in enumerate(lines[2:6]):
        cells = [c.strip() for c in line.strip("|").split("|")]
        b = results["plain"]["buckets"][i]
        assert cells[:2] == [f"{b['start']}-{b['end'] - 1}", str(b["tokens"])]
        assert cells[2:] == [f"{results[n]['buckets'][i]['loss']:.3f}" for n in results]
    assert lines[6].split("|")[3].strip() == f"{results['plain']['loss']:.3f}"
    assert (tmp_path / "cmp.png").read_bytes()[:4] == b"\x89PNG"
    results["yarn"]["buckets"].pop()
    (tmp_path / "yarn" / "eval.json").write_text(json.dumps(results["yarn"]))
    with pytest.raises(SystemExit, match="different position buckets"):
        compare_evals.main([f"{n}={tmp_path / n}" for n in results])
