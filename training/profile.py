"""Where a train step's time goes: a ``jax.profiler`` trace of a few steps, read back
(``jax.profiler.ProfileData``) and cut into rows (scripts/profile_step.py prints them).

Every XLA op the trace shows running on the first device is put in one row, by the op's own
HLO (the compiled step's text) and the name scopes the code sets (``attention_fwd``,
``attention_bwd``, ``rms_norm``, ``loss``, ``optimizer``):

    attention forward / backward   ops under those scopes (the ring's kernels; its K/V
                                   transfers are collectives)
    matmuls                        dot / convolution, GEMM custom calls, fusions around a dot
    norms                          ops under ``rms_norm`` (and their gradients)
    loss                           the output head's chunked cross-entropy
    optimizer                      the AdamW update and the gradient norm
    collectives                    all-reduce / all-gather / reduce-scatter / permute / all-to-all
    elementwise and other          everything else (RoPE, SwiGLU's gates, casts, copies)
    host gaps                      time in the step with no op running on the device

Each traced step is the span of its ``StepTraceAnnotation``; ops that overlap (a CPU runs a
device's thunks on several threads) share their common time equally, so the rows add up to the
step exactly and the step to the wall clock the script measures around it.
"""
from __future__ import annotations

import bisect
import collections
import dataclasses
import re

ROWS = ("attention forward", "attention backward", "matmuls", "norms", "loss", "optimizer",
        "collectives", "elementwise and other", "host gaps")
SCOPES = (("attention_bwd", "attention backward"), ("attention_fwd", "attention forward"),
          ("optimizer", "optimizer"), ("loss", "loss"), ("rms_norm", "norms"))
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all",
               "collective-broadcast", "send", "recv")
CONTAINERS = ("while", "conditional", "call")  # their bodies' ops are traced on their own
STEP_EVENT = "profile_step"


@dataclasses.dataclass(frozen=True)
class Op:
    opcode: str
    op_name: str  # the jax name stack (metadata op_name)
    target: str  # a custom call's target
    calls: tuple[str, ...]  # called computations


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*[^=]*?\s([\w\-]+)\(")


def parse_hlo(text: str) -> tuple[dict[str, Op], dict[str, str]]:
    """(instruction name -> Op, computation name -> its text) of a compiled module's text.

    An instruction without an ``op_name`` (XLA's CPU backend drops it on the library fusions it
    makes, e.g. a YNNPACK fusion of the attention kernel's tile einsums) takes the one of the
    instruction that runs its computation (the ``while`` or ``conditional`` of that kernel's
    loop, up the chain of callers), so that it falls in its scope's row."""
    ops, comps, current, body = {}, {}, None, []
    where = {}  # instruction -> the computation that holds it
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if head and not line.startswith(" "):
            current, body = head.group(1), []
            continue
        if line.startswith("}"):
            if current:
                comps[current] = "\n".join(body)
            current = None
            continue
        body.append(line)
        m = _INSTR.match(re.sub(r"/\*.*?\*/", "", line))  # tuple shapes carry /*index=5*/
        if not m:
            continue
        name = re.search(r'op_name="([^"]*)"', line)
        target = re.search(r'custom_call_target="([^"]*)"', line)
        calls = re.findall(r"(?:calls|to_apply|body|condition|true_computation|false_computation)"
                           r"=%?([\w.\-]+)", line)
        branches = re.search(r"branch_computations=\{([^}]*)\}", line)
        if branches:
            calls += re.findall(r"%?([\w.\-]+)", branches.group(1))
        ops[m.group(1)] = Op(m.group(2), name.group(1) if name else "",
                             target.group(1) if target else "", tuple(calls))
        where[m.group(1)] = current
    caller = {}  # computation -> the first instruction that runs it
    for op_name, op in ops.items():
        for c in op.calls:
            caller.setdefault(c, op_name)
    for name, op in ops.items():
        seen, comp = set(), where.get(name)
        while not op.op_name and comp in caller and comp not in seen:
            seen.add(comp)
            up = caller[comp]
            op = dataclasses.replace(op, op_name=ops[up].op_name)
            comp = where.get(up)
        ops[name] = op
    return ops, comps


def _has_dot(op: Op, comps: dict) -> bool:
    return any(re.search(r"\s(dot|convolution)\(", comps.get(c, "")) for c in op.calls)


def row_of(op: Op | None, comps: dict) -> str:
    if op is None:
        return "elementwise and other"
    base = op.opcode.removesuffix("-start").removesuffix("-done")
    if base in COLLECTIVES:
        return "collectives"
    for scope, row in SCOPES:
        if scope in op.op_name:
            return row
    if (op.opcode in ("dot", "convolution") or "gemm" in op.target.lower()
            or "cublas" in op.target.lower() or (op.opcode == "fusion" and _has_dot(op, comps))):
        return "matmuls"
    return "elementwise and other"


@dataclasses.dataclass
class Interval:
    start: int
    end: int
    row: str


# Compiler options for a traced GPU step: no command buffers, so every kernel names its HLO op.
GPU_TRACE_OPTIONS = {"xla_gpu_enable_command_buffer": ""}
# A GPU plane's derived line of XLA ops (written by xprof's conversion; a raw trace may lack it).
GPU_OP_LINES = ("XLA Ops", "Ops")


def device_ops(profile, ops: dict, comps: dict, device: int = 0) -> list[Interval]:
    """The leaf XLA ops of ``device`` in the trace: on a GPU's ``/device:GPU:N`` plane its
    ``XLA Ops`` line, or where the trace holds only CUPTI's stream lines, every kernel that names
    its HLO op (stat ``hlo_op``); on a CPU the thunks whose ``device_ordinal`` is ``device``,
    an asynchronous one until it finished (``async_end``)."""
    out = []
    windows = step_windows(profile)
    for plane in profile.planes:
        gpu = re.search(r"/device:GPU:(\d+)", plane.name)
        if gpu and int(gpu.group(1)) != device:
            continue
        lines = list(plane.lines)
        derived = [ln for ln in lines if ln.name in GPU_OP_LINES]
        finish = None if gpu else async_finish(lines, device, windows)
        for line in (derived or lines) if gpu else lines:
            for e in line.events:
                stats = dict(e.stats)
                name = stats.get("hlo_op") or (e.name if gpu and derived else None)
                if not name or (not gpu and stats.get("device_ordinal") != device):
                    continue
                op = ops.get(name)
                if op is not None and op.opcode in CONTAINERS:
                    continue
                end = int(e.end_ns)
                if finish is not None:
                    end = max(end, finish(int(e.start_ns), stats.get(ASYNC_START)))
                out.append(Interval(int(e.start_ns), end, row_of(op, comps)))
    return out


# A CPU thunk that runs asynchronously (a dot or copy handed to Eigen's pool) is traced as its
# launch (stat "_p", a context id; a fraction of its run) and an "end: <op>" event (stat "_c",
# the same id) recorded after it finished. Without the pair a 40 ms weight-gradient dot read as
# its launch's 0.1 ms of matmul and the rest as host gaps. The end event is late, though: the
# runtime first runs the thunks the op unblocked, inline on the thread that finished it, and
# records the end after them (it can land in the next step, or after the trace stopped). So
# the op runs until the first of those: the thread's first thunk launched after the op's
# launch, and within the step that launched it.
ASYNC_START, ASYNC_END = "_p", "_c"


def async_finish(lines, device: int, windows: list[tuple[int, int]]):
    """``finish(launch_ns, context_id) -> ns``: when an asynchronous thunk launched then
    finished, by the rule above (0 for a thunk with no ``end:`` event)."""
    ends, launches = {}, []  # context id -> (end event's ns, its line); each line's launches
    for index, line in enumerate(lines):
        starts = []
        for e in line.events:
            stats = dict(e.stats)
            if e.name.startswith("end: ") and stats.get(ASYNC_END) is not None:
                ends[stats[ASYNC_END]] = (int(e.start_ns), index)
            elif stats.get("hlo_op") and stats.get("device_ordinal") == device:
                starts.append(int(e.start_ns))
        launches.append(sorted(starts))

    def finish(launch_ns: int, ctx) -> int:
        if ctx not in ends:
            return 0
        end_ns, index = ends[ctx]
        on_line = launches[index]
        nxt = bisect.bisect_right(on_line, launch_ns)  # the thread's first launch after it
        if nxt < len(on_line):
            end_ns = min(end_ns, on_line[nxt])
        return min([end_ns] + [hi for lo, hi in windows if lo <= launch_ns <= hi])
    return finish


def describe(profile, limit: int = 12) -> str:
    """What a trace holds, for a trace the rows cannot be read from: each plane's lines, their
    event counts and one event's name and stat names."""
    said = []
    for plane in profile.planes:
        lines = list(plane.lines)
        said.append(f"plane {plane.name!r}: {len(lines)} lines")
        for line in lines[:limit]:
            events = list(line.events)
            first = events[0] if events else None
            sample = (f"; first {first.name[:60]!r} stats {sorted(dict(first.stats))[:8]}"
                      if first is not None else "")
            said.append(f"  line {line.name!r}: {len(events)} events{sample}")
    return "\n".join(said)


def step_windows(profile) -> list[tuple[int, int]]:
    """The spans of the traced steps (the ``StepTraceAnnotation`` events named STEP_EVENT)."""
    spans = [(int(e.start_ns), int(e.end_ns)) for plane in profile.planes
             for line in plane.lines for e in line.events if e.name == STEP_EVENT]
    return sorted(spans)


def attribute(intervals: list[Interval], window: tuple[int, int]) -> dict[str, float]:
    """Seconds per row inside ``window``: overlapping ops share their common time equally; time
    with no op is ``host gaps``. The rows sum to the window's length."""
    lo, hi = window
    edges = []
    for iv in intervals:
        s, e = max(iv.start, lo), min(iv.end, hi)
        if e > s:
            edges += [(s, 1, iv.row), (e, -1, iv.row)]
    edges.sort(key=lambda x: (x[0], x[1]))
    rows = collections.Counter()
    active = collections.Counter()
    t = lo
    for when, delta, row in edges:
        n = sum(active.values())
        span = (when - t) / 1e9
        if n:
            for r, k in active.items():
                rows[r] += span * k / n
        else:
            rows["host gaps"] += span
        t = when
        active[row] += delta
        if not active[row]:
            del active[row]
    rows["host gaps"] += (hi - t) / 1e9
    return {r: rows.get(r, 0.0) for r in ROWS}


class EmptyTrace(RuntimeError):
    """A trace that holds no steps or no ops of the device (says what it holds instead)."""


def trace_steps(compiled, state, batch, warmup: int, steps: int, trace_dir,
                ops: dict, comps: dict):
    """Run ``compiled`` (a train step: ``state, batch -> state, metrics``) ``warmup`` times
    untimed, then ``steps`` times traced, each under its ``StepTraceAnnotation``: (seconds per
    row of one step, averaged over the traced steps; each traced step's wall clock; the trace
    file). ``ops``/``comps``: ``parse_hlo`` of the compiled text."""
    import pathlib
    import time

    import jax
    for _ in range(warmup):
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
    trace_dir = pathlib.Path(trace_dir)
    trace_dir.mkdir(parents=True, exist_ok=True)
    walls = []
    jax.profiler.start_trace(str(trace_dir))
    try:
        for i in range(steps):
            t0 = time.perf_counter()
            with jax.profiler.StepTraceAnnotation(STEP_EVENT, step_num=i):
                state, metrics = compiled(state, batch)
                jax.block_until_ready(metrics)
            walls.append(time.perf_counter() - t0)
        time.sleep(0.05)  # the last step's asynchronous ops record their end events after it
    finally:
        jax.profiler.stop_trace()
    newest = max(trace_dir.glob("**/*.xplane.pb"), key=lambda p: p.stat().st_mtime)
    data = jax.profiler.ProfileData.from_file(str(newest))
    intervals = device_ops(data, ops, comps, device=0)
    windows = step_windows(data)
    if not windows or not intervals:
        missing = " and ".join(w for w, got in (("steps", windows), ("ops of device 0", intervals))
                               if not got)
        raise EmptyTrace(f"the trace {newest} holds no {missing}; it holds:\n{describe(data)}")
    per_step = {r: 0.0 for r in ROWS}
    for w in windows:
        for r, s in attribute(intervals, w).items():
            per_step[r] += s / len(windows)
    return per_step, walls, newest


def row_flops(config, devices: int) -> dict[str, float]:
    """Model FLOPs of one step per device for the rows that have a count (the causal half;
    recompute not counted, as MFU): attention forward 1/3 and backward 2/3 of
    ``attention_flops_per_token``; the loss its output head, 6 x vocab x d_model; matmuls
    the other matmul parameters, 6 x each, per token."""
    from model.flops import attention_flops_per_token, matmul_params
    m = config.model
    tokens = config.data.batch_size * config.data.seq_len / devices
    attn = attention_flops_per_token(m, config.data.seq_len) * tokens
    head = 6 * m.vocab_size * m.d_model * tokens
    return {"attention forward": attn / 3, "attention backward": 2 * attn / 3, "loss": head,
            "matmuls": 6 * matmul_params(m) * tokens - head}


def table(per_step: dict[str, float], wall_s: float, flops: dict[str, float]) -> str:
    """The markdown table: per row its time per step, share of the step and TFLOP/s."""
    total = sum(per_step.values())
    lines = ["| part of the step | ms per step | share | TFLOP/s per device |",
             "|---|---:|---:|---:|"]
    for row in ROWS:
        s = per_step[row]
        rate = f"{flops[row] / s / 1e12:.3g}" if row in flops and s > 0 else ""
        lines.append(f"| {row} | {s * 1e3:.2f} | {s / total:.1%} | {rate} |")
    lines.append(f"| **rows summed** | **{total * 1e3:.2f}** | | |")
    lines.append(f"| measured step (wall clock, median) | {wall_s * 1e3:.2f} | "
                 f"{total / wall_s:.0%} of it | |")
    return "\n".join(lines)
