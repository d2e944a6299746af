"""scripts/profile_step.py and training/profile.py: where a train step's time goes."""
import json
import sys

import pytest

from training import profile
from training.profile import Interval

sys.path.insert(0, "scripts")
import profile_step  # noqa: E402


def test_overlapping_ops_share_their_time_and_gaps_are_the_host():
    """Two ops overlapping for 2 ns share it; the 3 ns with nothing running are host gaps; the
    rows add up to the window (seconds: ns / 1e9)."""
    ivs = [Interval(0, 4, "matmuls"), Interval(2, 6, "collectives"), Interval(9, 10, "loss"),
           Interval(12, 20, "norms")]  # the last one runs past the window's end at 11
    got = {k: v * 1e9 for k, v in profile.attribute(ivs, (0, 11)).items() if v}
    assert got == pytest.approx({"matmuls": 3.0, "collectives": 3.0, "loss": 1.0,
                                 "host gaps": 4.0})
    assert sum(got.values()) == pytest.approx(11.0)


HLO = """HloModule jit__train_step

%fused_dot (p0: f32[4,4], p1: f32[4,4]) -> f32[4,4] {
  %p0 = f32[4,4]{1,0} parameter(0)
  %p1 = f32[4,4]{1,0} parameter(1)
  ROOT %dot.1 = f32[4,4]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_add (p0: f32[4,4]) -> f32[4,4] {
  %p0 = f32[4,4]{1,0} parameter(0)
  ROOT %add.1 = f32[4,4]{1,0} add(%p0, %p0)
}

ENTRY %main (a: f32[4,4]) -> f32[4,4] {
  %a = f32[4,4]{1,0} parameter(0)
  %fusion.1 = f32[4,4]{1,0} fusion(%a, %a), kind=kOutput, calls=%fused_dot, metadata={op_name="jit(_train_step)/jvp()/dot_general"}
  %fusion.2 = f32[4,4]{1,0} fusion(%fusion.1), kind=kLoop, calls=%fused_add, metadata={op_name="jit(_train_step)/jvp()/attention_fwd/jit(local)/add"}
  %fusion.3 = f32[4,4]{1,0} fusion(%fusion.2), kind=kLoop, calls=%fused_add, metadata={op_name="jit(_train_step)/transpose(jvp())/rms_norm/mul"}
  %all-reduce-start.1 = f32[4,4]{1,0} all-reduce-start(%fusion.3), to_apply=%fused_add
  %gemm.1 = f32[4,4]{1,0} custom-call(%a, %a), custom_call_target="__cublas$gemm"
  ROOT %fusion.4 = f32[4,4]{1,0} fusion(%gemm.1), kind=kLoop, calls=%fused_add, metadata={op_name="jit(_train_step)/optimizer/mul"}
}
"""


def test_ops_fall_in_their_rows():
    ops, comps = profile.parse_hlo(HLO)
    rows = {name: profile.row_of(ops[name], comps) for name in
            ("fusion.1", "fusion.2", "fusion.3", "all-reduce-start.1", "gemm.1", "fusion.4")}
    assert rows == {"fusion.1": "matmuls", "fusion.2": "attention forward", "fusion.3": "norms",
                    "all-reduce-start.1": "collectives", "gemm.1": "matmuls",
                    "fusion.4": "optimizer"}
    assert profile.row_of(None, comps) == "elementwise and other"


def test_profile_of_a_cpu_step_adds_up_to_the_step(tmp_path, capsys):
    out = tmp_path / "profile.json"
    code = profile_step.main(["--config", "configs/tiny.py", "--steps", "2", "--warmup", "1",
                              "--trace-dir", str(tmp_path / "trace"), "--json", str(out),
                              "--config.data.seq_len=256", "--config.model.remat=full"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "| attention backward |" in printed and "| host gaps |" in printed
    got = json.loads(out.read_text())
    rows = got["rows_s"]
    assert list(rows) == list(profile.ROWS)
    assert abs(sum(rows.values()) / got["wall_s"] - 1) < 0.10  # the rows are the step
    for row in ("attention forward", "attention backward", "matmuls", "loss", "optimizer",
                "collectives"):
        assert rows[row] > 0, row
    assert got["remat"] == "full" and got["kernel"] == "xla"


def test_a_bad_config_is_one_line(capsys):
    assert profile_step.main(["--config", "configs/tiny.py", "--config.model.remat=most"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.remat='most'" in err[0]
