"""``model.remat=auto`` (training/remat.py): the least recompute whose compiled step fits.

The budgets come from the tiny config's own compiled steps (``train.memory_budget_gib``), so
each test forces one choice: every policy's step is compiled once per session for the mesh.
The tiny config's attention is dense here: its steps compile in about half the CPU time of the
ring's, and the choice reads only their compiled sizes (the ring under the remat policies:
tests/test_attention.py's residuals under remat, the planner's and the profiler's steps).
"""
import functools

import pytest

from configs import tiny
from errors import ConfigError
from parallel.mesh import make_mesh
from training import remat
from training.state import step_bytes
from configs.validate import validate

GIB = 2 ** 30


def config(budget_bytes=0.0):
    c = tiny.get_config()
    c.data.seq_len = 256
    c.attention.impl = "dense"
    c.model.remat = "auto"
    c.train.memory_budget_gib = budget_bytes / GIB
    return c


@functools.cache
def compiled_total(policy):
    """Bytes per device of the tiny step under ``policy`` (compiled once per session)."""
    c = remat.with_remat(config(), policy)
    return step_bytes(c, make_mesh(c.mesh))


def counting_compile(calls):
    """remat.choose's measure, memoised, recording which policies it was asked for."""
    def measure(c, mesh):
        calls.append(c.model.remat)
        return compiled_total(c.model.remat)
    return measure

def test_less_recompute_needs_more_memory():
    assert compiled_total("none") > compiled_total("attention") > compiled_total("full")


@pytest.mark.parametrize("policy", ["none", "attention", "full"])
def test_each_budget_picks_the_least_recompute_that_fits(policy):
    """A budget just above a policy's step picks it: every policy of less recompute was tried
    first and needs more than the budget; the one picked fits."""
    budget = compiled_total(policy) + 1024
    c = config(budget)
    calls = []
    got, why = remat.choose(c, make_mesh(c.mesh), measure=counting_compile(calls))
    assert got == policy
    assert calls == list(remat.ORDER_ON_CPU[:remat.ORDER_ON_CPU.index(policy) + 1])
    assert compiled_total(got) <= budget
    assert all(compiled_total(p) > budget for p in calls[:-1])
    assert why.startswith(f"remat auto: {policy}, the least recompute that fits")
    assert f"train.memory_budget_gib={budget / GIB:g}" in why


def test_nothing_fits_is_one_line():
    c = config(compiled_total("full") - 1024)
    with pytest.raises(ConfigError, match=r"model.remat=auto: no policy fits train.memory_budget"
                                          r".* \(none .* GiB, attention .* GiB, full .* GiB\)"):
        remat.choose(c, make_mesh(c.mesh), measure=counting_compile([]))


def test_no_budget_on_a_cpu_compiles_nothing():
    c = config()
    calls = []
    policy, why = remat.choose(c, make_mesh(c.mesh), measure=counting_compile(calls))
    assert (policy, calls) == ("none", [])
    assert why == "remat auto: none (no memory limit known: the least recompute)"


def test_the_run_keeps_auto_and_the_trainer_gets_the_policy():
    """remat.resolve as the trainer calls it, its measure the trainer's step_bytes memoised
    (compiled_total: the same programs, not traced and compiled again)."""
    c = config(compiled_total("attention") + 1024)
    mesh = make_mesh(c.mesh)
    resolved, line = remat.resolve(c, mesh, counting_compile([]))
    assert resolved.model.remat == "attention" and c.model.remat == "auto" and line
    fixed, line = remat.resolve(remat.with_remat(c, "full"), mesh, counting_compile([]))
    assert fixed.model.remat == "full" and line is None


def test_validation():
    c = config()
    validate(c, 8)
    c.train.memory_budget_gib = -1.0
    with pytest.raises(ConfigError, match=r"train.memory_budget_gib=-1 must be >= 0"):
        validate(c, 8)
    c = config()
    c.model.remat = "most"
    with pytest.raises(ConfigError, match="model.remat='most' is not one of none, attention, "
                                          "full, offload, offload_input, auto"):
        validate(c, 8)
