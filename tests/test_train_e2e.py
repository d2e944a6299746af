"""End to end: train.py on the tiny config, as a user runs it, in a temp run directory."""
import atexit
import functools
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

from conftest import user_process_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SESSION = pathlib.Path(tempfile.mkdtemp(prefix="e2e_tests_"))
atexit.register(shutil.rmtree, SESSION, ignore_errors=True)


def run_train(workdir, *overrides, devices=8):
    # the code generation of the README's tiny run (the same program: one compile between them)
    env = user_process_env(devices, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "train.py", "--config", "configs/tiny.py", "--workdir", str(workdir),
           "--config.train.steps=2", "--config.train.log_every=1", "--config.train.eval_batches=1",
           "--config.data.max_docs=120", "--config.model.vocab_size=512",
           "--config.data.batch_size=2", "--config.data.seq_len=256",
           f"--config.data.cache_dir={workdir.parent / 'cache'}", *overrides]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@functools.cache
def two_step_run() -> tuple[pathlib.Path, subprocess.CompletedProcess]:
    """(workdir, process) of run_train's two steps with the defaults (kernel auto: xla on a
    CPU; remat auto: none, the tiny config's own, on a CPU with no budget), run once per session: this file checks what it writes."""
    workdir = SESSION / "run"
    return workdir, run_train(workdir, "--config.model.remat=auto")


def losses(workdir) -> list[float]:
    return [json.loads(l)["loss"] for l in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_two_step_run_writes_metrics_config_and_checkpoint():
    workdir, proc = two_step_run()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "kernel xla;" in proc.stdout + proc.stderr  # auto resolves to the XLA kernel on a CPU
    assert "remat auto: none (no memory limit known" in proc.stdout
    records = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert {"step", "loss", "tokens_per_s", "mfu"} <= r.keys()
        assert 0 < r["loss"] < 20 and r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1
    config = json.loads((workdir / "config.json").read_text())
    assert config["attention"]["layout"] == "striped" and config["model"]["vocab_size"] == 512
    assert len((workdir / "tokenizer_fingerprint.txt").read_text().strip()) >= 16
    assert (workdir / "checkpoints" / "2").is_dir()
    assert str(workdir / "checkpoints" / "2") in proc.stdout
    assert "simulating" not in proc.stdout  # XLA_FLAGS already set a device count: left alone
