"""Several processes, one run: the local launcher and the layout comparison script."""
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time

import numpy as np
import pytest

from parallel.schedule import work

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--config.train.steps=2", "--config.train.log_every=1", "--config.train.eval_batches=1",
         "--config.data.max_docs=120", "--config.model.vocab_size=512", "--config.data.batch_size=2",
         "--config.data.seq_len=256", "--config.mesh.fsdp=1", "--config.mesh.sequence=2"]


def env():
    e = dict(os.environ, JAX_PLATFORMS="cpu")
    e.pop("XLA_FLAGS", None)  # the launcher sets each process's own
    return e


def test_two_process_launcher_trains_and_processes_agree(tmp_path):
    cmd = [sys.executable, "scripts/launch_local.py", "--processes", "2", "--",
           "train.py", "--config", "configs/tiny.py", "--workdir", str(tmp_path / "run"),
           f"--config.data.cache_dir={tmp_path / 'cache'}", *SMALL]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    finals = dict(re.findall(r"\[p(\d)\] process \d/2: final loss ([0-9.]+)", proc.stdout))
    assert set(finals) == {"0", "1"}, proc.stdout[-3000:]
    assert finals["0"] == finals["1"]
    records = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert f"{records[-1]['loss']:.6f}" == finals["0"]


def test_launcher_stops_everyone_when_one_process_fails(tmp_path):
    cmd = [sys.executable, "scripts/launch_local.py", "--processes", "2", "--",
           "train.py", "--config", "configs/tiny.py", "--workdir", str(tmp_path / "run"),
           "--config.attention.layout=spiral"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "error: process" in proc.stderr and "exited with code 2" in proc.stderr
    assert "attention.layout='spiral' is not one of" in proc.stdout


HEARTBEAT_S = 6


def start_host(workdir, cache, port=None, i=0, devices=1) -> subprocess.Popen:
    """Process i of a two-process run, started as on its own host (its own process group); or,
    without a port, the same run in one process on ``devices`` simulated devices."""
    cmd = [sys.executable, "train.py", "--config", "configs/tiny.py", "--workdir", str(workdir),
           *SMALL, "--config.train.steps=8", "--config.checkpoint.every=2",
           "--config.train.eval_every=0", "--config.data.seq_len=128",
           "--config.attention.impl=dense", f"--config.data.cache_dir={ROOT}/.cache/data",
           f"--config.distributed.heartbeat_timeout_s={HEARTBEAT_S}"]
    if port is not None:
        cmd += ["--coordinator", f"127.0.0.1:{port}", "--num_processes", "2", "--process_id", str(i)]
    host_env = dict(env(), XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
                    PYTHONUNBUFFERED="1", JAX_COMPILATION_CACHE_DIR=str(cache),
                    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    return subprocess.Popen(cmd, cwd=ROOT, env=host_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def losses(workdir) -> dict[int, float]:
    return {r["step"]: r["loss"]
            for r in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines())}


def test_a_dead_peer_ends_the_survivor_in_one_line_and_a_relaunch_resumes(tmp_path):
    """Process 1's host dies (SIGKILL of its process group) after step 5. Process 0 exits within
    distributed.heartbeat_timeout_s, code 3, with one line on stderr naming process 1 and the
    newest complete checkpoint (the native detail goes to WORKDIR/logs). The same command on
    both hosts resumes from that checkpoint, and the whole curve is that of an uninterrupted
    run (the same mesh in one process: two-device sums are the same in any order)."""
    from parallel.distributed import free_port
    workdir, cache = tmp_path / "run", tmp_path / "jax_cache"
    port = free_port()
    hosts = [start_host(workdir, cache, port, i) for i in (0, 1)]
    metrics = workdir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and '"step": 5,' in metrics.read_text()):
        assert hosts[0].poll() is None and time.monotonic() < deadline, hosts[0].poll()
        time.sleep(0.05)
    killed = time.monotonic()
    os.killpg(hosts[1].pid, signal.SIGKILL)  # the host: its process and the training it watches
    # The uninterrupted run to compare with, while the survivor waits out the heartbeats.
    reference = start_host(tmp_path / "uninterrupted", cache, devices=2)
    code = hosts[0].wait(timeout=HEARTBEAT_S + 60)
    took = time.monotonic() - killed
    err = hosts[0].communicate()[1]
    hosts[1].wait()
    ckpt = workdir / "checkpoints"
    step = max(int(p.name) for p in ckpt.iterdir()
               if p.name.isdigit() and (p / "commit_success.txt").is_file())
    assert code == 3 and took < HEARTBEAT_S + 10, (code, took, err[-3000:])
    assert err.splitlines() == [
        f"error: process 1 stopped answering (no heartbeat for distributed.heartbeat_timeout_s="
        f"{HEARTBEAT_S} s), so process 0 stopped; newest complete checkpoint: step {step} "
        f"({ckpt / str(step)}); rerun the same command on every host to resume (details: "
        f"{workdir / 'logs' / 'process0.log'})"]
    assert "stopped sending heartbeats" in (workdir / "logs" / "process0.log").read_text()

    port = free_port()
    hosts = [start_host(workdir, cache, port, i) for i in (0, 1)]
    outs = [h.communicate(timeout=300) for h in hosts]
    assert [h.returncode for h in hosts] == [0, 0], outs[0][1][-3000:] + outs[1][1][-3000:]
    assert f"resuming from step {step} ({ckpt / str(step)})" in outs[0][0]
    assert reference.wait(timeout=300) == 0, reference.communicate()[1][-3000:]
    assert losses(workdir) == losses(tmp_path / "uninterrupted")


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
