"""scripts/bench_step.py: our train step and transformers + torch's on the same model and tokens."""
import json
import math
import sys

import pytest

sys.path.insert(0, "scripts")
import bench_step  # noqa: E402


def test_both_sides_take_the_same_model_and_tokens_and_the_profile_adds_up(tmp_path, capsys):
    """The tiny model at 64 tokens: both sides' first-step losses are a random model's, ln(vocab)
    (so both read the same vocabulary and predict the same 63 tokens); the table's ratio is the
    JSON's medians; our traced step's rows add up to the wall clock measured around it."""
    import torch
    out = tmp_path / "bench.json"
    threads = torch.get_num_threads()  # bench_step sets torch's for the process: put back after
    try:
        assert bench_step.main(["--seq-len", "64", "--steps", "2", "--warmup", "0",
                                "--json", str(out), "--trace-dir", str(tmp_path / "trace")]) == 0
    finally:
        torch.set_num_threads(threads)
    got = json.loads(out.read_text())
    ours, torch = got["ours"], got["torch"]
    vocab = 2048  # configs/tiny.py
    for side in (ours, torch):
        assert len(side["walls_s"]) == 2 and side["median_s"] > 0
        # the process's CPU seconds over a step: some, and no more than its cores over the step
        cpu = side["user_s"] + side["system_s"]
        assert 0 < cpu <= got["cores"] * max(side["walls_s"]) + 0.1, side
        assert side["faults"] >= 0
        assert abs(side["first_loss"] - math.log(vocab)) < 0.2, side["first_loss"]
    assert torch["attention"] == "sdpa"
    assert sum(ours["rows_s"].values()) == pytest.approx(ours["traced_s"], rel=0.05)
    table = capsys.readouterr().out
    assert f"| {ours['median_s'] / torch['median_s']:.2f}x |" in table
    assert f"| {ours['user_s']:.1f} + {ours['system_s']:.1f} | {ours['faults']:,} |" in table
    assert "| matmuls |" in table and "| loss |" in table
    # the rows with matmuls against the same matmuls alone, timed in the same run
    for row in ("matmuls", "loss"):
        hot, cold = ours["bare"][row]["hot"], ours["bare"][row]["cold"]
        assert hot["s"] > 0 and cold["s"] > 0
        rate = ours["flops"][row] / ours["rows_s"][row] / 1e12
        assert (f" {hot['s']:.3g} s, {hot['tflops']:.3g} TFLOP/s | {cold['s']:.3g} s, "
                f"{cold['tflops']:.3g} TFLOP/s | {rate / hot['tflops']:.0%}, "
                f"{rate / cold['tflops']:.0%} |") in table


@pytest.mark.parametrize("config, tied", [("configs/tiny.py", False),
                                          ("configs/qwen3_0_6b.py", True)])
def test_the_bare_matmuls_are_the_profile_rows_flops(config, tied):
    """bench_step.step_matmuls lists each shape the step multiplies, so many times: their FLOPs
    (6 x tokens x in x out each, forward and both gradients) are exactly training/profile.py's
    counts for the matmuls row and the loss's head (a tied table read as [vocab, d_model])."""
    from planning.cli import load_config
    from training.profile import row_flops
    c = load_config(config, ["--config.data.batch_size=1", "--config.data.seq_len=512",
                             f"--config.model.tie_embeddings={tied}"])
    shapes = bench_step.step_matmuls(c.model)
    want = row_flops(c, 1)
    for row in ("matmuls", "loss"):
        assert sum(6 * 512 * i * o * n for i, o, _, n in shapes[row]) == want[row], row
    assert shapes["loss"] == [(c.model.d_model, c.model.vocab_size, tied, 1)]
    c.model.moe.num_experts = 8  # grouped experts: no bare counterpart
    assert bench_step.step_matmuls(c.model) == {}


@pytest.mark.parametrize("flags, said", [
    (["--sides", "ours,jax"], "--sides takes some of ours,torch (got 'ours,jax')"),
    (["--steps", "0"], "--steps must be >= 1 (got 0)"),
    (["--cores", "-1"], "--cores must be >= 0 (got -1)"),
    (["--cores", "999"], "--cores 999: this process may use"),
    (["--seq-len", "100"], "block_q=64 does not divide the per-device chunk of 100 tokens"),
])
def test_a_bad_flag_or_length_is_one_line(flags, said, capsys):
    """Flags, and a length the config's tiles do not divide (configs/tiny.py's 64), as train.py
    says it: one line, exit 2, before anything compiles."""
    assert bench_step.main(flags) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and said in err and err.count("\n") == 1, err
