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
    out = tmp_path / "bench.json"
    assert bench_step.main(["--seq-len", "64", "--steps", "2", "--warmup", "0",
                            "--json", str(out), "--trace-dir", str(tmp_path / "trace")]) == 0
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
