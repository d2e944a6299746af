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

from helpers import TWO_PROCESS_TINY, launcher_env
from parallel.schedule import work

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = TWO_PROCESS_TINY
env = launcher_env


def test_launcher_stops_everyone_when_one_process_fails(tmp_path):
    cmd = [sys.executable, "scripts/launch_local.py", "--processes", "2", "--",
           "train.py", "--config", "configs/tiny.py", "--workdir", str(tmp_path / "run"),
           "--config.attention.layout=spiral"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "error: process" in proc.stderr and "exited with code 2" in proc.stderr
    assert "attention.layout='spiral' is not one of" in proc.stdout


HEARTBEAT_S = 6


def start_host(workdir, port=None, i=0, devices=1, extra=()) -> subprocess.Popen:
    """Process i of a two-process run, started as on its own host (its own process group); or,
    without a port, the same run in one process on ``devices`` simulated devices."""
    cmd = [sys.executable, "train.py", "--config", "configs/tiny.py", "--workdir", str(workdir),
           *SMALL, "--config.train.steps=8", "--config.checkpoint.every=2",
           "--config.train.eval_every=0", "--config.data.seq_len=128",
           "--config.attention.impl=dense", f"--config.data.cache_dir={ROOT}/.cache/data",
           f"--config.distributed.heartbeat_timeout_s={HEARTBEAT_S}", *extra]
    if port is not None:
        cmd += ["--coordinator", f"127.0.0.1:{port}", "--num_processes", "2", "--process_id", str(i)]
    host_env = dict(env(), XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
                    PYTHONUNBUFFERED="1")
    return subprocess.Popen(cmd, cwd=ROOT, env=host_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The losses of the run the interrupted ones must reproduce: the same mesh in one process
    (two-device sums are the same in any order). Started at once, read when first needed."""
    workdir = tmp_path_factory.mktemp("uninterrupted") / "run"
    reference = start_host(workdir, devices=2)

    def read():
        assert reference.wait(timeout=300) == 0, reference.communicate()[1][-3000:]
        return losses(workdir)
    return read


def wait_for_step(host, workdir, step):
    """Until process 0 has logged ``step``."""
    metrics = workdir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and f'"step": {step},' in metrics.read_text()):
        assert host.poll() is None and time.monotonic() < deadline, host.poll()
        time.sleep(0.05)


def newest_complete_step(ckpt) -> int:
    return max(int(p.name) for p in ckpt.iterdir()
               if p.name.isdigit() and (p / "commit_success.txt").is_file())


def losses(workdir) -> dict[int, float]:
    return {r["step"]: r["loss"]
            for r in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines())}


def test_a_dead_peer_ends_the_survivor_in_one_line_and_a_relaunch_resumes(tmp_path,
                                                                          uninterrupted):
    """Process 1's host dies (SIGKILL of its process group) after step 5. Process 0 exits within
    distributed.heartbeat_timeout_s, code 3, with one line on stderr naming process 1 and the
    newest complete checkpoint (the native detail goes to WORKDIR/logs). The same command on
    both hosts resumes from that checkpoint, and the whole curve is that of an uninterrupted
    run (the same mesh in one process: two-device sums are the same in any order)."""
    from parallel.distributed import free_port
    workdir = tmp_path / "run"
    port = free_port()
    hosts = [start_host(workdir, port, i) for i in (0, 1)]
    wait_for_step(hosts[0], workdir, 5)
    killed = time.monotonic()
    os.killpg(hosts[1].pid, signal.SIGKILL)  # the host: its process and the training it watches
    code = hosts[0].wait(timeout=HEARTBEAT_S + 60)
    took = time.monotonic() - killed
    err = hosts[0].communicate()[1]
    hosts[1].wait()
    ckpt = workdir / "checkpoints"
    step = newest_complete_step(ckpt)
    assert code == 3 and took < HEARTBEAT_S + 10, (code, took, err[-3000:])
    assert err.splitlines() == [
        f"error: process 1 stopped answering (no heartbeat for distributed.heartbeat_timeout_s="
        f"{HEARTBEAT_S} s), so process 0 stopped; newest complete checkpoint: step {step} "
        f"({ckpt / str(step)}); rerun the same command on every host to resume (details: "
        f"{workdir / 'logs' / 'process0.log'})"]
    assert "stopped sending heartbeats" in (workdir / "logs" / "process0.log").read_text()

    relaunch_and_compare(workdir, step, uninterrupted())


def relaunch_and_compare(workdir, step, want):
    """The same command on both hosts resumes from ``step`` and the whole curve is ``want``."""
    from parallel.distributed import free_port
    port = free_port()
    hosts = [start_host(workdir, port, i) for i in (0, 1)]
    outs = [h.communicate(timeout=300) for h in hosts]
    assert [h.returncode for h in hosts] == [0, 0], outs[0][1][-3000:] + outs[1][1][-3000:]
    ckpt = workdir / "checkpoints"
    assert f"resuming from step {step} ({ckpt / str(step)})" in outs[0][0]
    assert losses(workdir) == want


STEP_TIMEOUT_S = 6


def test_a_stuck_peer_ends_the_run_in_one_line_and_a_relaunch_resumes(tmp_path, uninterrupted):
    """Process 1's host freezes (SIGSTOP of its process group) after step 5, its heartbeats
    with it, but distributed.heartbeat_timeout_s is long: the step watchdog ends process 0
    within distributed.step_timeout_s (three of them in a save) plus a few polls, code 4, with one line naming process 1
    and the last step each process finished. The checkpoints stay whole; after the frozen host
    is killed (as srun --kill-on-bad-exit would), the same command resumes exactly."""
    from parallel.distributed import free_port
    workdir = tmp_path / "run"
    port = free_port()
    extra = ["--config.distributed.heartbeat_timeout_s=120",
             f"--config.distributed.step_timeout_s={STEP_TIMEOUT_S}"]
    hosts = [start_host(workdir, port, i, extra=extra) for i in (0, 1)]
    wait_for_step(hosts[0], workdir, 5)
    stopped = time.monotonic()
    # The host's training process (its watcher's child, in a process group of its own) freezes.
    child = int(pathlib.Path(f"/proc/{hosts[1].pid}/task/{hosts[1].pid}/children").read_text())
    os.killpg(child, signal.SIGSTOP)
    try:
        code = hosts[0].wait(timeout=3 * STEP_TIMEOUT_S + 60)
        took = time.monotonic() - stopped
        err = hosts[0].communicate()[1]
    finally:
        os.killpg(hosts[1].pid, signal.SIGKILL)
        hosts[1].wait()
    ckpt = workdir / "checkpoints"
    step = newest_complete_step(ckpt)
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
    # Process 1's last report may be a few steps old: it froze between two of them.
    assert m and 5 <= int(m.group(1)) <= 8 and 1 <= int(m.group(2)) <= int(m.group(1)), lines[0]
    relaunch_and_compare(workdir, step, uninterrupted())


@pytest.mark.parametrize("mask,window", [("off", 40), ("on", 0)])
def test_compare_layouts_writes_all_layouts(tmp_path, mask, window):
    """Off: whole rows with a sliding window (the contiguous ring stops after 2 of 4 hops);
    on: the document mask."""
    out = tmp_path / "cmp"
    # Short documents (a few per 256-token row), so that the document mask changes the work.
    rng = np.random.default_rng()
    words = ["def", "return", "self", "value", "import", "class", "for", "in", "if", "None"]
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": " ".join(rng.choice(words, rng.integers(20, 80)))})
                            + "\n" for _ in range(300)))
    cmd = [sys.executable, "scripts/compare_layouts.py", "--processes", "1", "--devices", "4",
           "--seq-lens", "256", "--steps", "2", "--warmup", "1", "--out", str(out),
           "--block", "16", "--document-mask", mask, "--window", str(window),
           "--set", "data.source=jsonl", "--set", f"data.path={docs}",
           "--set", "model.vocab_size=512", "--set", f"data.cache_dir={tmp_path / 'cache'}"]
    # usp: 2 groups of 2 (ulysses 2); with the window, the two layouts it is about
    impls = ["ring", "usp"] if mask == "off" else ["ring"]
    layouts = ["contiguous", "striped"] if mask == "off" else ["contiguous", "striped", "zigzag"]
    cmd += ["--impls", ",".join(impls), "--ulysses", "2", "--layouts", ",".join(layouts)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
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
    assert all(r["document_mask"] == (mask == "on") and r["block"] == 16 for r in rows)
    assert all(r["window"] == window for r in rows)
    tile_model = {(r["impl"], r["layout"]): r["tile_model_speedup"] for r in rows}
    if mask == "off":  # every step has the same schedule: exactly the closed-form ratio
        cp = {(i, lay): work(lay, 256, 4, 16, window=window).strategy_critical_path(i, 2)
              for i, lay in tile_model}
        assert tile_model == {key: cp["ring", "contiguous"] / cp[key] for key in tile_model}
    else:  # each step's own document boundaries remove tiles
        for r in rows:
            assert len(r["tile_critical_paths"]) == 2
            assert all(0 < t < work(r["layout"], 256, 4, 16).critical_path
                       for t in r["tile_critical_paths"])
            ref = next(x for x in rows if x["layout"] == "contiguous")["tile_critical_paths"]
            assert tile_model[r["impl"], r["layout"]] == statistics.median(
                a / b for a, b in zip(ref, r["tile_critical_paths"]))
    assert "| 256 | striped | ring |" in (out / "results.md").read_text()
    assert (out / "throughput.png").read_bytes()[:4] == b"\x89PNG"
