"""A small real training run, made once per test session and shared by the checkpoint tests.

Runs go through train.py in subprocesses (8 simulated CPU devices), with the persistent XLA
compilation cache that tests/conftest.py sets for the whole test run: the first run compiles,
the others load the same programs, so each further run costs its startup and its steps only.
The reference run is made once for all pytest workers, in the run's shared directory. ``entry``
runs the same configuration through train.py's entry in the test's own process (no Python or
JAX start; the test process has the same 8 devices and XLA flags, so it loads the same programs).
"""
from __future__ import annotations

import atexit
import fcntl
import functools
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
SESSION = pathlib.Path(tempfile.mkdtemp(prefix="ckpt_tests_"))
atexit.register(shutil.rmtree, SESSION, ignore_errors=True)
# Shared by the pytest workers of one run (tests/conftest.py sets it before they start).
SHARED = pathlib.Path(os.environ["STRIPEDJAX_TEST_SHARED"])

STEPS = 40  # the reference run; the interrupted run stops near step 10 of the same 40
EVERY = 8
# configs/tiny.py made smaller; dense attention keeps compilation short (the checkpoint code
# does not depend on the attention kernel; striped layout and sharded mesh stay as in tiny).
OVERRIDES = {
    "model.d_model": 64, "model.ffn_dim": 96, "model.num_heads": 4, "model.num_kv_heads": 2,
    "attention.impl": "dense", "data.seq_len": 128, "data.batch_size": 4, "data.max_docs": 200,
    "data.cache_dir": str(ROOT / ".cache" / "data"), "train.steps": STEPS, "train.log_every": 1,
    "train.warmup_steps": 5, "train.eval_every": 0, "train.eval_batches": 1,
    "checkpoint.every": EVERY, "checkpoint.keep": 6,
}


def env() -> dict:
    e = dict(os.environ)
    # conftest's XLA_FLAGS: 8 devices and the tests' code generation, so that a run here and
    # the same run through train.py's entry in the test's process are the same programs (bit
    # for bit); the compilation cache: conftest's, in os.environ too
    e.update(XLA_FLAGS=os.environ["XLA_FLAGS"], JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    return e


def train_cmd(workdir, **overrides) -> list[str]:
    flags = {**OVERRIDES, **overrides}
    return [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs/tiny.py"),
            "--workdir", str(workdir), *[f"--config.{k}={v}" for k, v in flags.items()]]


def train(workdir, timeout=240, **overrides) -> subprocess.CompletedProcess:
    return subprocess.run(train_cmd(workdir, **overrides), cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=timeout)


def entry(workdir, **overrides) -> subprocess.CompletedProcess:
    """What train.py does after parsing its flags into ``config(**overrides)``, in this process:
    training/entry.py's main_with_errors (the run, its one-line errors and exit codes). Returns
    its exit code and what it printed, as a finished subprocess would."""
    return entry_of(config(**overrides), workdir)


def entry_of(config, workdir) -> subprocess.CompletedProcess:
    """``entry`` for any config (e.g. ``configs.loading.load(FILE, ["a.b=v", ...])``, what
    train.py's ``--config FILE --config.a.b=v`` gives): its run in this process, whose devices
    (tests/conftest.py's 8 simulated CPUs) must hold the config's mesh."""
    import contextlib
    import io

    from parallel.cluster import Place
    from training.entry import main_with_errors
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main_with_errors(config, pathlib.Path(workdir), Place("one process"))
    return subprocess.CompletedProcess(["train.py", "--workdir", str(workdir)], code,
                                       out.getvalue(), err.getvalue())


def script(name: str, *args, timeout=180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / name), *map(str, args)],
                          cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)


def config(**overrides):
    """The same configuration, in-process."""
    from configs import tiny
    c = tiny.get_config()
    for key, value in {**OVERRIDES, **overrides}.items():
        section, field = key.split(".")
        c[section][field] = value
    return c


def metrics(workdir) -> dict[int, dict]:
    lines = (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, filter(None, lines))}


def evals(workdir) -> dict[int, dict]:
    lines = (pathlib.Path(workdir) / "eval.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, filter(None, lines))}


@functools.cache
def reference() -> pathlib.Path:
    """A finished run of STEPS steps, checkpoints every EVERY steps: made by the first worker
    that asks (the others wait on the lock), then only read. A test that runs train.py on it
    works on its own copy (test_resume)."""
    workdir, done = SHARED / "reference", SHARED / "reference.done"
    with open(SHARED / "reference.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(workdir, ignore_errors=True)  # a worker's failed attempt
            out = train(workdir)
            assert out.returncode == 0, out.stderr[-3000:]
            done.touch()
    return workdir
