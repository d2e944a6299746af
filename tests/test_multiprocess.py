"""Several processes, one run: the local launcher and the layout comparison script."""
import json
import os
import re
import statistics
import subprocess
import sys

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


@pytest.mark.parametrize("mask", ["off", "on"])
def test_compare_layouts_writes_all_layouts(tmp_path, mask):
    out = tmp_path / "cmp"
    # Short documents (a few per 256-token row), so that the document mask changes the work.
    rng = np.random.default_rng()
    words = ["def", "return", "self", "value", "import", "class", "for", "in", "if", "None"]
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": " ".join(rng.choice(words, rng.integers(20, 80)))})
                            + "\n" for _ in range(300)))
    cmd = [sys.executable, "scripts/compare_layouts.py", "--processes", "1", "--devices", "4",
           "--seq-lens", "256", "--steps", "2", "--warmup", "1", "--out", str(out),
           "--block", "16", "--document-mask", mask,
           "--set", "data.source=jsonl", "--set", f"data.path={docs}",
           "--set", "model.vocab_size=512", "--set", f"data.cache_dir={tmp_path / 'cache'}"]
    impls = ["ring", "usp"] if mask == "off" else ["ring"]  # usp: 2 groups of 2 (ulysses 2)
    cmd += ["--impls", ",".join(impls), "--ulysses", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert {(r["impl"], r["layout"]) for r in rows} == {
        (i, lay) for i in impls for lay in ("contiguous", "striped", "zigzag")}
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
    tile_model = {(r["impl"], r["layout"]): r["tile_model_speedup"] for r in rows}
    if mask == "off":  # every step has the same schedule: exactly the closed-form ratio
        cp = {(i, lay): work(lay, 256, 4, 16).strategy_critical_path(i, 2) for i, lay in tile_model}
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
