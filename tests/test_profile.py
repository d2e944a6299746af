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


def _plane(name, lines):
    """A trace plane as jax.profiler.ProfileData gives it: lines of events with stats."""
    from types import SimpleNamespace as NS
    return NS(name=name, lines=[NS(name=ln, events=[
        NS(name=e, start_ns=s, end_ns=t, stats=list(stats.items())) for e, s, t, stats in evs])
        for ln, evs in lines])


def test_a_raw_gpu_trace_reads_every_kernel_by_its_hlo_op():
    """A GPU trace as jax.profiler writes it on an H200 (2026-12-04): CUPTI's stream lines, each
    kernel naming its HLO op (stat hlo_op; the kernel's own name is a library's or a reused
    fusion's); no derived "XLA Ops" line. Kernels inside a command buffer name only the buffer
    (profile_step compiles the traced step without them): they fall in "elementwise and other".
    Another GPU's plane and the host plane's events are not device 0's."""
    from types import SimpleNamespace as NS
    ops, comps = profile.parse_hlo(HLO)
    gpu0 = _plane("/device:GPU:0", [
        ("Stream #14(Memset,Compute,MemcpyD2H)", [
            ("nvjet_sm90_tst_128x128_64x6_1x2_h_bz_NNT", 0, 10, {"hlo_op": "gemm.1"}),
            ("loop_add_fusion_3", 10, 14, {"hlo_op": "fusion.2"}),  # a reused kernel's name
            ("loop_broadcast_fusion_35", 14, 15, {"hlo_op": "command_buffer_1"})]),
        ("Stream #86(MemcpyD2D)", [("MemcpyD2D", 15, 17, {"hlo_op": "fusion.3"})]),
        ("Stream #92(Compute)", [])])
    gpu1 = _plane("/device:GPU:1", [("Stream #14(Compute)", [("x", 0, 99, {"hlo_op": "gemm.1"})])])
    host = _plane("/host:CPU", [("python3", [("profile_step", 0, 20, {})])])
    trace = NS(planes=[host, gpu0, gpu1])
    got = [(iv.start, iv.end, iv.row) for iv in profile.device_ops(trace, ops, comps, device=0)]
    assert got == [(0, 10, "matmuls"), (10, 14, "attention forward"),
                   (14, 15, "elementwise and other"), (15, 17, "norms")]
    assert profile.step_windows(trace) == [(0, 20)]
    # with a derived "XLA Ops" line (xprof's conversion), that line alone: no kernel twice
    derived = _plane("/device:GPU:0", [("XLA Ops", [("fusion.1", 0, 10, {})]),
                                       ("Stream #14(Compute)", [("k", 0, 10, {"hlo_op": "fusion.1"})])])
    assert [iv.row for iv in profile.device_ops(NS(planes=[derived]), ops, comps)] == ["matmuls"]
    said = profile.describe(trace)
    assert "plane '/device:GPU:0': 3 lines" in said
    assert "line 'Stream #14(Memset,Compute,MemcpyD2H)': 3 events" in said and "'hlo_op'" in said


def test_an_asynchronous_cpu_thunk_runs_until_what_it_unblocked_starts():
    """XLA's CPU runtime traces a thunk it hands to Eigen's pool (a weight gradient's dot, a big
    copy) as a launch (stat _p, a context id) and an "end: <op>" event (stat _c, the same id)
    that it records only after running, on the thread that finished the op, the thunks the op
    unblocked. The op runs from its launch to the first of those (the thread's next launch), or
    to its end event where the thread launched nothing after it, and never past the step that
    launched it. A synchronous thunk keeps its own span; another device's thunks stay out."""
    from types import SimpleNamespace as NS
    ops, comps = profile.parse_hlo(HLO)
    launch = lambda op, s, t, ctx, device=0: (op, s, t, {"hlo_op": op, "device_ordinal": device,
                                                       "_p": ctx})
    host = _plane("/host:CPU", [
        ("python3", [("profile_step", 0, 35, {})]),
        ("tf_XLAEigen/1", [launch("fusion.1", 0, 1, 7), launch("fusion.2", 2, 5, 8),
                           launch("fusion.1", 3, 4, 9, device=1)]),
        ("tf_XLAEigen/2", [launch("fusion.4", 30, 33, 10),  # what fusion.1 unblocked
                           ("end: fusion.1", 34, 34, {"_c": 7}),
                           ("end: fusion.1", 90, 91, {"_c": 9})]),
        ("tf_XLAEigen/3", [("end: fusion.2", 50, 50, {"_c": 8})])])  # after the step
    trace = NS(planes=[host])
    got = [(iv.start, iv.end, iv.row) for iv in profile.device_ops(trace, ops, comps, device=0)]
    assert sorted(got) == [(0, 30, "matmuls"), (2, 35, "attention forward"),
                           (30, 33, "optimizer")]
    rows = profile.attribute(profile.device_ops(trace, ops, comps), (0, 35))
    assert rows["host gaps"] == 0 and rows["matmuls"] * 1e9 == pytest.approx(2 + 28 / 2)


def test_a_real_cpu_trace_runs_an_eigen_dot_until_its_consumer(tmp_path):
    """The runtime's own trace of a dot it hands to Eigen (a weight gradient's x^T dy, 2,048 x
    576 -> 1,536, as the step's dW) and a sort of its result: the dot's launch event is a
    fraction of its run and its end event comes after the sort. Read by device_ops, the dot runs
    from its launch to the sort's, and the two fill each traced call (by the launch alone the
    dot was a few milliseconds of matmul and the rest host gaps)."""
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2048, 576), np.float32))
    dy = jnp.asarray(rng.standard_normal((2048, 1536), np.float32))
    compiled = jax.jit(lambda a, b: jnp.sort(jax.lax.dot_general(
        a, b, (((0,), (0,)), ((), ()))), axis=0)).lower(x, dy).compile()
    compiled(x, dy).block_until_ready()
    jax.profiler.start_trace(str(tmp_path))
    try:
        for i in range(3):
            with jax.profiler.StepTraceAnnotation(profile.STEP_EVENT, step_num=i):
                compiled(x, dy).block_until_ready()
        time.sleep(0.05)  # the last call's end events
    finally:
        jax.profiler.stop_trace()
    data = jax.profiler.ProfileData.from_file(str(next(tmp_path.glob("**/*.xplane.pb"))))
    ops, comps = profile.parse_hlo(compiled.as_text())
    intervals = profile.device_ops(data, ops, comps)
    windows = profile.step_windows(data)
    assert len(windows) == 3
    for lo, hi in windows:
        mine = sorted((iv.start, iv.end, iv.row) for iv in intervals if lo <= iv.start <= hi)
        dots = [iv for iv in mine if iv[2] == "matmuls"]
        assert len(dots) == 1 and dots[0][1] - dots[0][0] > 5e6, mine  # 23 ms bare
        after = [iv for iv in mine if iv[0] > dots[0][0]]
        assert after and dots[0][1] <= after[0][0], mine  # not past what it unblocked
        rows = profile.attribute(intervals, (lo, hi))
        assert rows["host gaps"] < 0.1 * (hi - lo) / 1e9, rows


def test_the_gpu_trace_options_are_options_this_jax_knows():
    """profile_step compiles a GPU step with GPU_TRACE_OPTIONS: a misspelt option or value would
    fail there only, so it is compiled here (XLA checks every option on any platform)."""
    import jax
    import jax.numpy as jnp
    lowered = jax.jit(lambda x: x * 2).lower(jnp.ones(3))
    assert float(lowered.compile(compiler_options=profile.GPU_TRACE_OPTIONS)(jnp.ones(3))[0]) == 2
    with pytest.raises(Exception, match="not a valid enum value"):
        lowered.compile(compiler_options={"xla_gpu_enable_command_buffer": "NO_SUCH_TYPE"})


def test_profile_of_a_cpu_step_adds_up_to_the_step(tmp_path, capsys):
    # the tiny config's step on 2 rows of 256 tokens (a row per fsdp shard): the same ops as on
    # its 8 x 512, an eighth of the tokens to run
    out = tmp_path / "profile.json"
    code = profile_step.main(["--config", "configs/tiny.py", "--steps", "2", "--warmup", "1",
                              "--trace-dir", str(tmp_path / "trace"), "--json", str(out),
                              "--config.data.seq_len=256", "--config.data.batch_size=2",
                              "--config.model.remat=full"])
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


# HLO's module name and %fused_dot, then a kernel's loop whose library fusions call it
LOOP_HLO = HLO[:HLO.index("%fused_add")] + """%masked (a: f32[4,4]) -> f32[4,4] {
  %a = f32[4,4]{1,0} parameter(0)
  ROOT %ynn_fusion.2 = f32[4,4]{1,0} fusion(%a, %a), kind=kCustom, calls=%fused_dot, backend_config={"fusion_config":{"kind":"__ynn_fusion"}}
}

%body (t: f32[4,4]) -> f32[4,4] {
  %t = f32[4,4]{1,0} parameter(0)
  %ynn_fusion.1 = f32[4,4]{1,0} fusion(%t, %t), kind=kCustom, calls=%fused_dot, backend_config={"fusion_config":{"kind":"__ynn_fusion"}}
  %i = s32[] constant(0)
  ROOT %cond.1 = f32[4,4]{1,0} conditional(%i, %ynn_fusion.1, %ynn_fusion.1), branch_computations={%masked, %masked}
}

%test (t: f32[4,4]) -> pred[] {
  ROOT %c = pred[] constant(false)
}

ENTRY %main (a: f32[4,4]) -> f32[4,4] {
  %a = f32[4,4]{1,0} parameter(0)
  %while.1 = f32[4,4]{1,0} while(%a), condition=%test, body=%body, metadata={op_name="jit(_train_step)/transpose(jvp())/attention_bwd/while"}
  ROOT %ynn_fusion.3 = f32[4,4]{1,0} fusion(%while.1, %a), kind=kCustom, calls=%fused_dot, backend_config={"fusion_config":{"kind":"__ynn_fusion"}}
}
"""


def test_library_fusions_without_op_name_take_their_loops_scope():
    """XLA's CPU backend makes YNNPACK fusions of the attention kernel's tile einsums without an
    op_name (seen in SmolLM2's compiled step, 2026-12-07): inside the kernel's while body, and in
    a conditional's branch inside it, they take the while's scope (attention backward), not the
    matmuls row; one at the top level with no caller stays a matmul."""
    ops, comps = profile.parse_hlo(LOOP_HLO)
    rows = {n: profile.row_of(ops[n], comps) for n in ("ynn_fusion.1", "ynn_fusion.2",
                                                         "ynn_fusion.3")}
    assert rows == {"ynn_fusion.1": "attention backward", "ynn_fusion.2": "attention backward",
                    "ynn_fusion.3": "matmuls"}
    assert ops["cond.1"].calls == ("masked", "masked")
