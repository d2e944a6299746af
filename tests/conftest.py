"""Test setup: 8 simulated CPU devices, set before jax is imported anywhere."""
import atexit
import gc
import os
import shutil
import sys
import tempfile
from importlib.metadata import version

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from parallel.host_devices import patient_collectives  # noqa: E402  (imports no jax)

# LLVM's optimisations at level 0 for what the tests compile in their own processes (the HLO
# passes all run): most programs here run once or twice, so compiling them is most of the
# suite's time, and this takes a quarter to a third of it off (same values within fp32 noise;
# where a test compares bits, both sides are compiled alike). The processes a test starts
# inherit these flags unless it gives them XLA_FLAGS of their own: these without the device
# count, as a user's shell whose processes simulate their own devices (user_process_env:
# tests/test_readme_commands.py, the launchers of helpers.launcher_env), these with a device
# count of its own (tests/test_train_e2e.py), or these on purpose (tests/trained_run.py: the same programs as
# the test's own, bit for bit). STRIPEDJAX_DEFAULT_CODEGEN=1 leaves XLA's code generation at
# its defaults: the checks of compiled programs that tests/test_default_codegen.py runs once
# more that way (its train.py processes among them), and everything else when a user sets it.
# Every process also waits 20 + 600 s, not XLA's 20 + 40, for the simulated devices at a
# collective (parallel/host_devices.PATIENT_COLLECTIVES): three workers and their processes on
# two cores once kept one waiting over a minute, and XLA aborted the worker.
# Each option: (the tests' value, XLA's own). jaxlib 0.10's XLA still has older LLVM IR emitters
# for CPU fusions beside the MLIR fusion emitters, and they compile faster (make test's user
# time: 12 min 16 s with them, 17 min 44 s without); 0.11 removed the choice, and XLA aborts on a
# flag it does not know.
CODEGEN_OPTIONS = {"xla_backend_optimization_level": (0, 3),
                   "xla_llvm_disable_expensive_passes": (True, False)}
if tuple(int(n) for n in version("jaxlib").split(".")[:2]) < (0, 11):
    CODEGEN_OPTIONS["xla_cpu_use_fusion_emitters"] = (False, True)
QUICK_CODEGEN = " ".join(f"--{name}={str(quick).lower()}"
                         for name, (quick, _) in CODEGEN_OPTIONS.items())
# For a program a test runs hundreds of times, where running it costs more than compiling it:
# ``jitted.lower(...).compile(compiler_options=RUN_CODEGEN)`` (the passkey model of
# test_eval_passkey.py, trained about 200 steps). LLVM level 2 runs the steps as fast as XLA's
# own values (level 3, the expensive passes, the newer fusion emitters) and compiles in half the
# time: 200 steps 10 CPU s either way, against 25 at the quick level 0; the compile 3 CPU s, not
# 6.
RUN_CODEGEN = {"xla_backend_optimization_level": 2}
DEFAULT_CODEGEN = os.environ.get("STRIPEDJAX_DEFAULT_CODEGEN") == "1"
USER_XLA_FLAGS = patient_collectives("" if DEFAULT_CODEGEN else QUICK_CODEGEN)
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8 "
    + USER_XLA_FLAGS).strip()


def user_process_env(devices: int = 0, **env: str) -> dict:
    """The environment of a process a test starts as a user's shell would: no JAX_PLATFORMS,
    XLA_FLAGS holding USER_XLA_FLAGS (and a device count when ``devices`` is given, else the
    process simulates its own), then ``env``."""
    out = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    count = f"--xla_force_host_platform_device_count={devices}" if devices else ""
    flags = " ".join(filter(None, [count, USER_XLA_FLAGS]))
    return {**out, **({"XLA_FLAGS": flags} if flags else {}), **env}

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# torch, the transformers references, on one thread: its ops here are tiny, and on two threads
# OpenMP's waiting threads spin for several times the CPU of the work itself (three workers on
# two cores; 48 greedy tokens of a 4-layer model: 1.9 CPU s on two threads, 0.2 on one). Set
# before any test module imports torch; numpy's OpenBLAS reads it too (the float64 references:
# the same values on one thread). The processes tests start inherit it, and none of them
# times torch (scripts/bench_step.py sets torch's threads itself; its test puts them back).
os.environ.setdefault("OMP_NUM_THREADS", "1")
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


import numpy as np  # noqa: E402  (after the environment above: nothing here imports jax)
import pytest  # noqa: E402

from training.entry import GC_THRESHOLDS, settle_gc  # noqa: E402  (imports no jax)

# The collector as the entry points tune it (training/entry.py): fewer full collections while the
# test modules import, then what they imported frozen once collected.
gc.set_threshold(*GC_THRESHOLDS)


def pytest_collection_finish(session):
    settle_gc()


@pytest.fixture
def rng():
    """Fresh random inputs on every run; the seed is printed so a failure can be replayed
    (``STRIPEDJAX_SEED=<seed> pytest tests/x.py::test_y``)."""
    seed = int(os.environ.get("STRIPEDJAX_SEED") or np.random.SeedSequence().entropy)
    print(f"numpy seed {seed}")  # shown by pytest when the test fails
    return np.random.default_rng(seed)



# ----------------------------------------------------------------------------- tiers

def pytest_report_header(config):
    return f"XLA_FLAGS: {os.environ['XLA_FLAGS']}"


def pytest_addoption(parser):
    parser.addoption("--tier", choices=("all", "quick", "next"), default="all",
                     help="quick: all but tests/tiers.py's SLOW; next: only its NEXT")


def pytest_configure(config):
    # (in the process that runs tests: pytest-xdist's controller starts its workers in Python)
    runs_tests = hasattr(config, "workerinput") or not config.getoption("numprocesses", None)
    if config.getoption("tier") == "quick" and runs_tests:
        _refuse_python_processes()
    config.addinivalue_line("markers", "slow: left out of `make test-quick` (tests/tiers.py SLOW)")
    config.addinivalue_line("markers", "next: the JAX-version surface `make test-next` runs "
                                       "(tests/tiers.py NEXT)")


def _entry_of(nodeid: str, table) -> str | None:
    """The entry of ``table`` that covers a test id (``tests/`` left off), if any."""
    test = nodeid.split("tests/", 1)[-1]
    for entry in table:
        if test == entry or test.startswith(entry + "::") or test.startswith(entry + "["):
            return entry
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    import tiers
    used = set()
    for item in items:
        for name, table in (("slow", tiers.SLOW), ("next", tiers.NEXT)):
            entry = _entry_of(item.nodeid, table)
            if entry is not None:
                item.add_marker(name)
                used.add((name, entry))
    # A whole-directory collection sees every test of the files it collects: an entry whose
    # file is missing, or collected without the test it names, is stale.
    if all(os.path.isdir(arg.split("::")[0]) for arg in config.args):
        here = os.path.dirname(os.path.abspath(__file__))
        files = {item.nodeid.split("::")[0].split("/")[-1] for item in items}
        stale = [f"{name.upper()}: {entry}" for name, table in (("slow", tiers.SLOW),
                 ("next", tiers.NEXT)) for entry in table if (name, entry) not in used
                 and (entry.split("::")[0] in files
                      or not os.path.exists(os.path.join(here, entry.split("::")[0])))]
        stale += [f"FIRST: {f}" for f in tiers.FIRST if not os.path.exists(os.path.join(here, f))]
        if stale:
            raise pytest.UsageError("tests/tiers.py names tests that do not exist: "
                                    + "; ".join(stale))
    # The files that take minutes first: the workers take whole files in collection order, and
    # a long file handed out last would run on alone at the end.
    rank = {name: i for i, name in enumerate(tiers.FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0].split("/")[-1], len(rank)))
    tier = config.getoption("tier")
    if tier == "all":
        return
    keep = (lambda item: not item.get_closest_marker("slow")) if tier == "quick" else \
        (lambda item: item.get_closest_marker("next") is not None)
    config.hook.pytest_deselected(items=[item for item in items if not keep(item)])
    items[:] = [item for item in items if keep(item)]


def _refuse_python_processes() -> None:
    """The quick tier: starting a Python process (a fresh interpreter, mostly a fresh JAX) fails,
    in a test or in a fixture it sets up, naming the test: it belongs in tests/tiers.py SLOW.
    Shell scripts and other tools may run."""
    import subprocess
    start = subprocess.Popen.__init__

    def guarded(self, args, *a, **kw):
        first = args[0] if isinstance(args, (list, tuple)) else str(args).split()[0]
        program = os.path.basename(str(first))
        if program.startswith("python") or program == os.path.basename(sys.executable):
            test = os.environ.get("PYTEST_CURRENT_TEST", "a test").split(" ")[0]
            raise AssertionError(f"{test} starts a Python process ({args!r}) in the quick tier: "
                                 "list it in tests/tiers.py SLOW")
        return start(self, args, *a, **kw)
    subprocess.Popen.__init__ = guarded


# Per-test CPU seconds (this process's threads, XLA's compile threads included, and the
# subprocesses it waited for) as JSON lines in $STRIPEDJAX_TEST_CPU: unlike wall durations they
# do not depend on what else shares the two cores (scripts/test_times.py sums them per file).
if os.environ.get("STRIPEDJAX_TEST_CPU"):
    import json
    import resource
    import time

    # JAX's own timings of this process's tracing, lowering and XLA compiles (wall seconds,
    # cache reads inside the compile's), to tell what a test's CPU went on.
    _JAX_PHASES = {"/jax/core/compile/jaxpr_trace_duration": "trace",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
                   "/jax/core/compile/backend_compile_duration": "compile"}
    # and how many of its compiles asked the run's compilation cache, and how many it answered
    _JAX_COUNTS = {"/jax/compilation_cache/cache_hits": "hits",
                   "/jax/compilation_cache/compile_requests_use_cache": "requests"}
    _phases = dict.fromkeys([*_JAX_PHASES.values(), *_JAX_COUNTS.values()], 0.0)
    _listening = []

    def _listen() -> None:
        """Once jax is imported (the test modules import it at collection)."""
        if _listening or "jax" not in sys.modules:
            return
        from jax import monitoring

        def add(event, seconds, **_):
            if event in _JAX_PHASES:
                _phases[_JAX_PHASES[event]] += seconds

        def count(event, **_):
            if event in _JAX_COUNTS:
                _phases[_JAX_COUNTS[event]] += 1
        monitoring.register_event_duration_secs_listener(add)
        monitoring.register_event_listener(count)
        _listening.append(add)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        _listen()
        start = dict(_phases)

        def cpu():
            s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
            return s.ru_utime + s.ru_stime, c.ru_utime + c.ru_stime
        (s0, c0), w0 = cpu(), time.monotonic()
        yield
        (s1, c1), w1 = cpu(), time.monotonic()
        with open(os.environ["STRIPEDJAX_TEST_CPU"], "a") as f:
            f.write(json.dumps({"test": item.nodeid, "self": round(s1 - s0, 2),
                                "children": round(c1 - c0, 2), "wall": round(w1 - w0, 2),
                                "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
                                **{k: round(_phases[k] - start[k], 2) for k in _phases},
                                "end": round(time.time(), 1)}) + "\n")

