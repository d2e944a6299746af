"""Test setup: 8 simulated CPU devices, set before jax is imported anywhere."""
import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


import numpy as np  # noqa: E402  (after the environment above: nothing here imports jax)
import pytest  # noqa: E402


@pytest.fixture
def rng():
    """Fresh random inputs on every run; the seed is printed so a failure can be replayed."""
    seed = np.random.SeedSequence().entropy
    print(f"numpy seed {seed}")  # shown by pytest when the test fails
    return np.random.default_rng(seed)
