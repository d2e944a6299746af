"""A user's mistake on the command line is one line on stderr and exit code 2, from train.py
and from every script that takes --config (run as a user runs them, without jax starting)."""
import os
import subprocess
import sys

import pytest

from configs.command_line import diagnose

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def one_line_error(proc, expected: str):
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.splitlines() == [expected], proc.stderr[-2000:]


# Every config file (a file with a get_config), as the message lists them.
CONFIGS = sorted(f"configs/{f}" for f in os.listdir(os.path.join(ROOT, "configs"))
                 if f.endswith(".py") and "\ndef get_config(" in open(os.path.join(ROOT, "configs", f)).read())
TRAIN = ["train.py", "--config", "configs/tiny.py", "--workdir", "runs/never"]


@pytest.mark.parametrize("args,expected", [
    (TRAIN + ["--config.train.stepz=3"],
     "error: --config.train.stepz: no such field; nearest: train.steps, train.eps, train.seed"),
    (["train.py", "--config.train.stepz=3"],  # the default config file, same message
     "error: --config.train.stepz: no such field; nearest: train.steps, train.eps, train.seed"),
    (["train.py", "--config", "configs/tiny.py", "--config.modle.num_layers", "3"],
     "error: --config.modle.num_layers: no such field; nearest: model.num_layers, "
     "model.scan_layers, model.moe.dense_layers"),
    (["train.py", "--config", "configs/tyni.py", "--config.train.steps=3"],
     "error: --config configs/tyni.py: no such file; nearest: configs/tiny.py"),
    (["train.py", "--config=configs/missing.py"],
     "error: --config configs/missing.py: no such file; configs: " + ", ".join(CONFIGS)),
    (["train.py", "--config", "configs/from_run.py:runs/nowhere"],
     "error: configs/from_run.py:runs/nowhere: not a run directory (no config.json); give an "
     "import's --out or a train.py --workdir"),
    (TRAIN + ["--config.train.steps=three"],
     "error: flag --config.train.steps=three: invalid literal for int() with base 10: 'three'"),
    (TRAIN + ["--workdirr=x"], "error: Unknown command line flag 'workdirr'. Did you mean: workdir ?"),
])
def test_train_py_mistakes_are_one_line(args, expected):
    one_line_error(run(*args), expected)
    assert not os.path.exists(os.path.join(ROOT, "runs", "never"))


def test_diagnose_passes_a_good_command_line():
    assert diagnose(["--config", "configs/tiny.py", "--config.train.steps=3",
                     "--config.mesh.sequence", "2"], "config", "configs/tiny.py") is None
    assert diagnose(["--workdir", "x"], "config", "configs/tiny.py") is None


NO_FILE = ("error: --config configs/tyni.py: no such file; nearest: configs/tiny.py")
NO_FIELD = "no such field; nearest: train.steps, train.eps, train.seed"
PLAN = ["scripts/plan.py", "--mesh", "sequence=8", "--seq-len", "1024", "--hardware", "h100"]


@pytest.mark.parametrize("args,expected", [
    (PLAN + ["--config", "configs/tyni.py"], NO_FILE),
    (PLAN + ["--config", "configs/tiny.py", "--config.train.stepz=3"],
     f"error: --config.train.stepz: {NO_FIELD}"),
    (["scripts/compare_layouts.py", "--config", "configs/tyni.py"], NO_FILE),
    (["scripts/compare_layouts.py", "--set", "train.stepz=3"], f"error: config.train.stepz: {NO_FIELD}"),
    (["scripts/bench_checkpoint.py", "--config", "configs/tyni.py"], NO_FILE),
    (["scripts/bench_data.py", "--config", "configs/tyni.py"], NO_FILE),
])
def test_scripts_taking_a_config_say_the_same_in_one_line(args, expected):
    one_line_error(run(*args), expected)
