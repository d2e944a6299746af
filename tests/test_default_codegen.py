"""The checks whose subject is a compiled program, once more as XLA compiles by default.

conftest.py compiles what the suite runs with LLVM's optimisations off (QUICK_CODEGEN, a third
of the suite's time); the HLO passes run either way, but what a check reads from the program
(its copies, its temporary memory, a resumed run's bits) should not hold only for that
setting. A fresh pytest, its conftest told to leave XLA's code generation at its defaults
(STRIPEDJAX_DEFAULT_CODEGEN=1), runs the decode step's no-copy checks and the bit-for-bit
resume after SIGTERM (the train step's no-copy check, 50 s more under the defaults, stays with the
suite's flags: what it reads, the stack's slices and joins, comes from XLA's HLO passes, which run
either way). A process rather than compiler options on a compile here:
the resume check's runs are train.py processes, which take XLA_FLAGS as they find them, and
nothing needs to know the defaults to restore them. Its compilation cache and its reference
run are its own: this session's were made with the quick flags, other programs."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The decode step's checks in a covering set of its cases (the code generation changes neither
# the layout nor the split of the cache): the cache over 4 sequence devices, and the layer
# pattern whose depth is not a whole number of periods on one device, both bf16 (fp32 on one
# device, the plainest case, runs with the suite's flags).
DECODE = "tests/test_kv_cache.py::test_a_decode_step_copies_no_more_than_a_layer_of_the_cache"
CHECKS = [
    f"{DECODE}[striped-4--bfloat16]", f"{DECODE}[striped-1-sliding,sliding,full-bfloat16]",
    "tests/test_resume.py::test_sigterm_finishes_the_step_saves_and_exits_zero",
    "tests/test_resume.py::test_resume_after_sigterm_continues_bit_for_bit",
]
EXPECTED = len(CHECKS)
OWN = ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
       "STRIPEDJAX_TEST_SHARED", "STRIPEDJAX_TEST_CPU", "PYTEST_CURRENT_TEST",
       "PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_ADDOPTS")


def test_compiled_program_checks_hold_under_xla_default_flags():
    env = {k: v for k, v in os.environ.items() if k not in OWN}
    env["STRIPEDJAX_DEFAULT_CODEGEN"] = "1"
    # The checks need none of the installed pytest plugins, and hypothesis's alone imports
    # hypothesis at startup (about 1 CPU s of this test's 35).
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *CHECKS],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    flags = re.search(r"^XLA_FLAGS: (.*)$", out, re.M)
    assert flags and "--xla_force_host_platform_device_count=8" in flags.group(1), out[:2000]
    assert "optimization_level" not in flags.group(1) and "llvm" not in flags.group(1)
    summary = out.strip().splitlines()[-1]
    assert re.search(rf"\b{EXPECTED} passed\b", summary) and not re.search(
        r"failed|error|skipped|deselected|xfail", summary), summary
