"""Test setup: 8 simulated CPU devices, set before jax is imported anywhere."""
import atexit
import os
import shutil
import sys
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One JAX compilation cache for the whole run, fresh each time: the pytest workers and every
# process they start inherit it, so a program compiled by one of them (the tiny model's train
# step, which dozens of `train.py` runs build) is compiled once. A cache hit is the same
# executable, so nothing a test checks changes; a cache set by the user is used as it is.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jax-cache-")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)
# One directory for the run that every pytest worker sees (they inherit this environment):
# tests/trained_run.py makes its reference training run there once, not once per worker.
if "STRIPEDJAX_TEST_SHARED" not in os.environ:
    os.environ["STRIPEDJAX_TEST_SHARED"] = tempfile.mkdtemp(prefix="stripedjax-tests-")
    atexit.register(shutil.rmtree, os.environ["STRIPEDJAX_TEST_SHARED"], True)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


import numpy as np  # noqa: E402  (after the environment above: nothing here imports jax)
import pytest  # noqa: E402


@pytest.fixture
def rng():
    """Fresh random inputs on every run; the seed is printed so a failure can be replayed
    (``STRIPEDJAX_SEED=<seed> pytest tests/x.py::test_y``)."""
    seed = int(os.environ.get("STRIPEDJAX_SEED") or np.random.SeedSequence().entropy)
    print(f"numpy seed {seed}")  # shown by pytest when the test fails
    return np.random.default_rng(seed)
