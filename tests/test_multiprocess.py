"""Several processes, one run: the local launcher, a dead or a stuck peer, and the layout
comparison script (cluster launches: test_cluster.py)."""
import json
import os
import pathlib
import re
import signal
import statistics
import subprocess
import sys
import time

import numpy as np
import pytest

from helpers import TWO_PROCESS_TINY, launcher_env, logged_step
from parallel.schedule import work
from training.supervisor import newest_complete

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = TWO_PROCESS_TINY
env = launcher_env


def test_launcher_stops_everyone_when_one_process_fails(tmp_path):
    """Process 1 fails while process 0 would run on: the launcher stops process 0 at once and
    exits with process 1's code. Each process got the launcher's flags (the ones train.py reads:
    the runs below pass the same to train.py), and its output comes through prefixed."""
    program = tmp_path / "program.py"
    program.write_text(
        "import pathlib, sys, time\n"
        "flags = sys.argv[sys.argv.index('--coordinator'):]\n"
        "print('flags', *flags, flush=True)\n"
        "up = pathlib.Path(sys.argv[1])\n"
        "if flags[-1] == '0':\n"
        "    up.touch()\n"
        "    time.sleep(300)\n"
        "while not up.exists():  # process 0 is up, with its flags printed\n"
        "    time.sleep(0.05)\n"
        "print('error: process 1 gives up', flush=True)\n"
        "sys.exit(2)\n")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "scripts/launch_local.py", "--processes", "2", "--",
                           str(program), str(tmp_path / "up")], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and time.monotonic() - start < 60, proc.stderr
    assert "error: process 1 exited with code 2; stopping the others" in proc.stderr
    assert "[p1] error: process 1 gives up" in proc.stdout
    flags = re.findall(r"\[p(\d)\] flags --coordinator 127.0.0.1:(\d+) --num_processes 2 "
                       r"--process_id (\d)\n", proc.stdout)
    assert sorted((p, i) for p, _, i in flags) == [("0", "0"), ("1", "1")], proc.stdout
    assert len({port for _, port, _ in flags}) == 1
    # train.py given those flags: both processes join one run (jax.distributed over gloo), then
    # stop at the config's mistake in one line each; the launcher exits with their code.
    cmd = [sys.executable, "scripts/launch_local.py", "--processes", "2", "--",
           "train.py", "--config", "configs/tiny.py", "--workdir", str(tmp_path / "run"),
           "--config.attention.layout=spiral"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "error: process" in proc.stderr and "exited with code 2" in proc.stderr
    for i in (0, 1):
        assert re.search(rf"\[p{i}\] flags: coordinator 127.0.0.1:\d+ \(--coordinator\), process "
                         rf"{i} of 2 .*; 1 local cpu device", proc.stdout), proc.stdout[-3000:]
    assert "attention.layout='spiral' is not one of" in proc.stdout


HEARTBEAT_S = 6
STEP_TIMEOUT_S = 6
STEPS, EVERY = 16, 4  # a save every 4 steps: an interrupted launch has logged past its newest
# One layer: its program compiles in about two thirds of the time of two (a scan of length 1);
# nothing here depends on depth.
ONE_LAYER = "--config.model.num_layers=1"


def start_host(workdir, port, i, extra=()) -> subprocess.Popen:
    """Process i of a two-process run, started as on its own host (its own process group), with
    the XLA flags scripts/launch_local.py gives its processes."""
    from parallel.distributed import cpu_process_flags
    cmd = [sys.executable, "train.py", "--config", "configs/tiny.py", "--workdir", str(workdir),
           *SMALL, f"--config.train.steps={STEPS}", f"--config.checkpoint.every={EVERY}",
           "--config.train.eval_every=0", "--config.data.seq_len=128",
           "--config.attention.impl=dense", ONE_LAYER,
           f"--config.data.cache_dir={ROOT}/.cache/data",
           f"--config.distributed.heartbeat_timeout_s={HEARTBEAT_S}", *extra,
           "--coordinator", f"127.0.0.1:{port}", "--num_processes", "2", "--process_id", str(i)]
    # spawn_local's flags on the user's (launcher_env: conftest's quick code generation)
    user = env()
    host_env = dict(user, PYTHONUNBUFFERED="1",
                    XLA_FLAGS=cpu_process_flags(user.get("XLA_FLAGS", ""), 1))
    return subprocess.Popen(cmd, cwd=ROOT, env=host_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def launch(workdir, extra=()) -> list[subprocess.Popen]:
    from parallel.distributed import free_port
    port = free_port()
    return [start_host(workdir, port, i, extra) for i in (0, 1)]


def records(workdir) -> dict[int, dict]:
    """metrics.jsonl by step (loss, grad_norm, lr; not the timings)."""
    return {r["step"]: {k: r[k] for k in ("loss", "grad_norm", "lr")}
            for r in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines())}


def run_past_a_save(host, workdir, after: int) -> int:
    """Until process 0 has logged two steps past a checkpoint newer than step ``after`` that is
    complete: the relaunch then repeats those two steps, and its records must be the same (the
    second step's loss reads the restored optimizer state). Returns that checkpoint's step."""
    metrics, ckpt = workdir / "metrics.jsonl", workdir / "checkpoints"
    deadline = time.monotonic() + 300
    while True:
        assert host.poll() is None and time.monotonic() < deadline, host.poll()
        saved = newest_complete(ckpt) or 0
        if saved > after and logged_step(metrics) >= saved + 2:
            return saved
        time.sleep(0.05)


def finish(host) -> tuple[int, str, str]:
    out, err = host.communicate(timeout=300)
    return host.returncode, out, err


@pytest.fixture(scope="module")
def dead_peer(tmp_path_factory):
    """Launch 1: process 1's host dies (SIGKILL of its process group) two steps past a save."""
    workdir = tmp_path_factory.mktemp("peers") / "run"
    hosts = launch(workdir)
    saved = run_past_a_save(hosts[0], workdir, 0)
    # launch 2 must find a save after this one with two steps to log past it, before STEPS
    assert saved + EVERY + 2 <= STEPS, f"the first launch ran to step {saved} before the kill"
    killed = time.monotonic()
    os.killpg(hosts[1].pid, signal.SIGKILL)  # the host: its process and the training it watches
    code = hosts[0].wait(timeout=HEARTBEAT_S + 60)
    took = time.monotonic() - killed
    err = hosts[0].communicate()[1]
    hosts[1].wait()
    return {"workdir": workdir, "code": code, "took": took, "err": err,
            "step": newest_complete(workdir / "checkpoints") or 0, "records": records(workdir),
            "log": (workdir / "logs" / "process0.log").read_text()}  # a relaunch starts it anew


@pytest.fixture(scope="module")
def stuck_peer(dead_peer):
    """Launch 2, the same command on the same run directory: it resumes, and two steps past its
    next save process 1's host freezes (SIGSTOP of its training process), heartbeats included,
    but distributed.heartbeat_timeout_s is long: the step watchdog must end the run."""
    workdir = dead_peer["workdir"]
    hosts = launch(workdir, ["--config.distributed.heartbeat_timeout_s=120",
                             f"--config.distributed.step_timeout_s={STEP_TIMEOUT_S}"])
    try:
        run_past_a_save(hosts[0], workdir, dead_peer["step"])
        stopped = time.monotonic()
        # The host's training process (its watcher's child, in a process group of its own).
        child = int(pathlib.Path(f"/proc/{hosts[1].pid}/task/{hosts[1].pid}/children").read_text())
        os.killpg(child, signal.SIGSTOP)
        code = hosts[0].wait(timeout=3 * STEP_TIMEOUT_S + 60)
        took = time.monotonic() - stopped
        out, err = hosts[0].communicate()
    finally:  # as srun --kill-on-bad-exit would
        os.killpg(hosts[1].pid, signal.SIGKILL)
        hosts[1].wait()
    return {"workdir": workdir, "code": code, "took": took, "out": out, "err": err,
            "step": newest_complete(workdir / "checkpoints") or 0, "records": records(workdir)}


def same_steps(got: dict, want: dict, after: int):
    """The steps a relaunch repeated (logged by the launch before it past its checkpoint at
    ``after``) have the very same records: the restore is exact, state and data position."""
    again = [s for s in want if s > after]
    assert len(again) >= 2 and {s: got[s] for s in again} == {s: want[s] for s in again}


def test_a_dead_peer_ends_the_survivor_in_one_line_and_a_relaunch_resumes(dead_peer, stuck_peer):
    """Process 0 exits within distributed.heartbeat_timeout_s, code 3, with one line on stderr
    naming process 1 and the newest complete checkpoint (the native detail goes to
    WORKDIR/logs). The same command on both hosts resumes from that checkpoint exactly."""
    workdir, step = dead_peer["workdir"], dead_peer["step"]
    ckpt = workdir / "checkpoints"
    err, code, took = dead_peer["err"], dead_peer["code"], dead_peer["took"]
    assert code == 3 and took < HEARTBEAT_S + 10, (code, took, err[-3000:])
    assert err.splitlines() == [
        f"error: process 1 stopped answering (no heartbeat for distributed.heartbeat_timeout_s="
        f"{HEARTBEAT_S} s), so process 0 stopped; newest complete checkpoint: step {step} "
        f"({ckpt / str(step)}); rerun the same command on every host to resume (details: "
        f"{workdir / 'logs' / 'process0.log'})"]
    assert "stopped sending heartbeats" in dead_peer["log"]
    assert f"resuming from step {step} ({ckpt / str(step)})" in stuck_peer["out"]
    same_steps(stuck_peer["records"], dead_peer["records"], step)


def test_a_stuck_peer_ends_the_run_in_one_line_and_a_relaunch_resumes(dead_peer, stuck_peer):
    """The step watchdog ends process 0 within distributed.step_timeout_s (three of them in a
    save) plus a few polls, code 4, with one line naming process 1 and the last step each
    process finished. The checkpoints stay whole: the same command (launch 3) resumes exactly,
    and the whole curve is that of an uninterrupted run (each relaunch repeated the last steps
    of the launch before it bit for bit)."""
    workdir, step = stuck_peer["workdir"], stuck_peer["step"]
    ckpt = workdir / "checkpoints"
    err, code, took = stuck_peer["err"], stuck_peer["code"], stuck_peer["took"]
    # Within three timeouts (it may freeze during a save, which gets three) and a few polls.
    assert code == 4 and took < 3 * STEP_TIMEOUT_S + 20, (code, took, err[-3000:])
    lines = err.splitlines()
    assert len(lines) == 1, err[-3000:]
    m = re.fullmatch(
        rf"error: no step finished for \d+ s(?: in a save or an evaluation)? \(distributed."
        rf"step_timeout_s={STEP_TIMEOUT_S}(?:; it gets three)?\): "
        rf"process 1 stopped answering \(no progress report for 2.5 s: stopped, frozen or cut "
        rf"off\); last step finished: process 0: (\d+), process 1: (\d+); newest complete "
        rf"checkpoint: step {step} \({re.escape(str(ckpt / str(step)))}\); rerun the same command "
        rf"on every host to resume", lines[0])
    # Process 1 reports once a second: its last report may be a few steps old, or from before
    # its first step of this launch (0) when it froze within a second of that step.
    assert m and step + 2 <= int(m.group(1)) <= STEPS, lines[0]
    assert 0 <= int(m.group(2)) <= int(m.group(1)), lines[0]

    hosts = launch(workdir)
    (code0, out, err0), (code1, _, err1) = finish(hosts[0]), finish(hosts[1])
    assert (code0, code1) == (0, 0), err0[-3000:] + err1[-3000:]
    assert f"resuming from step {step} ({ckpt / str(step)})" in out
    final = records(workdir)
    assert sorted(final) == list(range(1, STEPS + 1))
    assert len((workdir / "metrics.jsonl").read_text().splitlines()) == STEPS  # each step once
    same_steps(final, stuck_peer["records"], step)
    first = dead_peer["step"]
    assert {s: final[s] for s in range(1, first + 1)} == {
        s: dead_peer["records"][s] for s in range(1, first + 1)}
    assert {s: final[s] for s in range(first + 1, step + 1)} == {
        s: stuck_peer["records"][s] for s in range(first + 1, step + 1)}


BLOCK, WINDOW, ULYSSES = 16, 40, 2


def test_compare_layouts_writes_all_layouts(tmp_path):
    """Ring and usp (2 groups of 2: ulysses 2), each with the contiguous and striped layouts, in
    one run on 4 simulated devices, with a sliding window (the contiguous ring stops after 2 of
    4 hops) and the document mask (each step's own document boundaries remove tiles)."""
    out = tmp_path / "cmp"
    # Short documents (a few per 256-token row), so that the document mask changes the work.
    rng = np.random.default_rng()
    words = ["def", "return", "self", "value", "import", "class", "for", "in", "if", "None"]
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": " ".join(rng.choice(words, rng.integers(20, 80)))})
                            + "\n" for _ in range(300)))
    impls, layouts = ["ring", "usp"], ["contiguous", "striped"]
    sets = ["data.source=jsonl", f"data.path={docs}", "model.vocab_size=512",
            "model.num_layers=1", f"data.cache_dir={tmp_path / 'cache'}"]
    args = ["--processes", "1", "--devices", "4", "--seq-lens", "256", "--steps", "2",
            "--warmup", "1", "--out", str(out), "--block", str(BLOCK), "--document-mask", "on",
            "--window", str(WINDOW), *(x for kv in sets for x in ("--set", kv)),
            "--impls", ",".join(impls), "--ulysses", str(ULYSSES), "--layouts", ",".join(layouts)]
    proc = subprocess.run([sys.executable, "scripts/compare_layouts.py", *args], cwd=ROOT,
                          env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert {(r["impl"], r["layout"]) for r in rows} == {
        (i, lay) for i in impls for lay in layouts}
    for r in rows:
        assert {"layout", "seq_len", "processes", "median_step_s", "tokens_per_s",
                "speedup_vs_contiguous", "final_loss"} <= r.keys()
        assert r["seq_len"] == 256 and r["processes"] == 1 and r["median_step_s"] > 0
    # Same weights, same data, same math: every layout's and implementation's loss after 3
    # steps agrees.
    losses = [r["final_loss"] for r in rows]
    assert max(losses) - min(losses) < 1e-4 * max(losses)
    assert [r["speedup_vs_contiguous"] for r in rows
            if r["layout"] == "contiguous" and r["impl"] == "ring"] == [1.0]
    assert all(r["document_mask"] and r["block"] == BLOCK and r["window"] == WINDOW for r in rows)
    # The tile model: each timed step's critical path from that batch's own documents and the
    # window, per strategy (parallel/schedule.py), and the median of the per-step ratios.
    segments = timed_segments(args)
    want = {(i, lay): [work(lay, 256, 4, BLOCK, segment_ids=seg, window=WINDOW)
                       .strategy_critical_path(i, ULYSSES) for seg in segments]
            for i, lay in {(r["impl"], r["layout"]) for r in rows}}
    ref = want["ring", "contiguous"]
    for r in rows:
        key = r["impl"], r["layout"]
        assert r["tile_critical_paths"] == want[key], key
        assert r["tile_model_speedup"] == statistics.median(a / b for a, b in zip(ref, want[key]))
    # The documents are short enough for the mask to matter: every step computes fewer tiles
    # than the window alone leaves.
    whole = work("contiguous", 256, 4, BLOCK, window=WINDOW).total
    assert all(work("contiguous", 256, 4, BLOCK, segment_ids=seg, window=WINDOW).total < whole
               for seg in segments)
    assert "| 256 | striped | ring |" in (out / "results.md").read_text()
    assert (out / "throughput.png").read_bytes()[:4] == b"\x89PNG"


def timed_segments(argv) -> list:
    """The natural-order segment ids of each timed step's batch, as the script's pipeline gives
    them (the tokenizer and corpus from its cache): the script feeds rows in order, warm-up
    steps first, one batch of --batch rows a step."""
    import importlib.util

    import jax

    from configs.loading import load
    from data.pipeline import make_pipeline
    from parallel.mesh import make_mesh
    spec = importlib.util.spec_from_file_location(
        "compare_layouts", os.path.join(ROOT, "scripts", "compare_layouts.py"))
    compare_layouts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare_layouts)
    args = compare_layouts.parse_args(argv)
    base = load(args.config, args.set)
    base.model.sliding_window = args.window
    c = compare_layouts.layout_config(base, "contiguous", 256, args.devices, args)
    pipe = make_pipeline(c, make_mesh(c.mesh, jax.devices()[:args.devices]))
    try:
        rows = range(args.warmup * args.batch, (args.warmup + args.steps) * args.batch, args.batch)
        assert max(rows) < pipe.rows_per_epoch
        return [pipe.host_batch(row, natural=True)["segment_ids"] for row in rows]
    finally:
        pipe.close()
