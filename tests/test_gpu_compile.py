"""The default fused GPU kernels compile for sm_80 and sm_90 on this CPU (scripts/gpu_compile.py:
jax.export for CUDA, then the triton package, pinned in requirements-test.txt): no lowering
error, no register spill, shared memory within the arch's limit, tensor-core instructions.
A small set: sm_80 (the smaller shared memory), head dim 128, an uneven group, with segment ids
(the bigger kernel), each compiled afresh (an empty Triton cache); the README's commands compile
sm_90's forward kernel for group 4 (with and without a window); the whole matrix is the script's
default.
"""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_compile.py")


def _run(tmp_path, *args, env=None):
    env = dict(os.environ, JAX_PLATFORMS="cpu", TRITON_CACHE_DIR=str(tmp_path / "triton"),
               **(env or {}))
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          timeout=600, env=env)


def test_default_gpu_kernels_compile_clean(tmp_path):
    out = tmp_path / "report.json"
    proc = _run(tmp_path, "--arch", "sm_80", "--head-dims", "128", "--groups", "3",
                "--dtypes", "bfloat16", "--seg", "yes", "--json", str(out))
    assert "| arch | kernel |" in proc.stdout, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["arch"], r["kernel"], r["group"]) for r in rows] == [
        ("sm_80", k, 3) for k in ("fwd", "dq", "dkv")]
    for r in rows:
        where = f"{r['arch']} {r['kernel']} group {r['group']}"
        assert not r["error"], f"{where}: {r['error']}"
        assert r["spill_bytes"] == 0, f"{where} spills {r['spill_bytes']} bytes"
        assert r["smem"] <= r["smem_limit"], f"{where}: shared memory {r['smem']} > {r['smem_limit']}"
        assert r["tensor_core_ops"] > 0, f"{where}: no tensor-core instructions"
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_tpu_kernels_lower_and_fit_vmem(tmp_path):
    out = tmp_path / "tpu.json"
    proc = _run(tmp_path, "--tpu", "--head-dims", "256", "--groups", "3", "--dtypes", "bfloat16",
                "--seg", "yes", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["kernel"] for r in rows] == ["fwd", "dq", "dkv"]
    assert all(r["fits"] == ["v5e", "v5p", "v6e"] for r in rows), rows


def test_missing_triton_is_one_line(tmp_path):
    """Without the triton package the script says so in one line (exit 2), no traceback."""
    fake = tmp_path / "fake"
    (fake / "triton").mkdir(parents=True)
    (fake / "triton" / "__init__.py").write_text("raise ImportError('no triton here')\n")
    proc = _run(tmp_path, "--arch", "sm_90", env={"PYTHONPATH": str(fake)})
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout.strip().splitlines() == [
        "gpu_compile: the triton package is not installed: pip install -r requirements-test.txt "
        "(it pins triton==3.9.0)"]
    assert "Traceback" not in proc.stderr
