"""The fused GPU kernels compiled for sm_80 / sm_90 on a machine with no GPU.

``jax.export(..., platforms=["cuda"])`` lowers one ring round (``kernel_export.py``) on a CPU:
every Pallas call becomes a ``__gpu$xla.gpu.triton`` custom call whose backend config carries
the kernel's Triton IR (MLIR bytecode), name, warps and stages. The ``triton`` package compiles
that IR for the arch, and its bundled ``ptxas-blackwell -v`` reports registers and spills (the
bundled older ``ptxas`` rejects the PTX 9.4 that triton emits). Shared memory per block is
Triton's own allocation (dynamic shared memory, which ptxas does not count).

On a GPU the same IR is compiled by the Triton inside jaxlib and the CUDA toolkit's ptxas, so
the numbers here are close to, not identical with, what runs there.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile

import jax
from jax import export

from planning import kernel_export as kx
from parallel.kernels.pallas_gpu import SMEM_LIMIT

CUSTOM_CALL = "__gpu$xla.gpu.triton"
TENSOR_CORES = {"sm_80": "mma.sync.aligned", "sm_86": "mma.sync.aligned", "sm_90": "wgmma.mma_async"}


class CompileError(Exception):
    """A kernel that did not lower or compile; the message is one line."""


def triton_version() -> str:
    """The triton package's version, or CompileError saying how to get it."""
    try:
        os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton's default, unwarned
        import triton
    except ImportError:
        raise CompileError("the triton package is not installed: pip install -r "
                           "requirements-test.txt (it pins triton==3.9.0)") from None
    return triton.__version__


def _one_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


def _target_gpu(arch: str) -> None:
    """JAX >= 0.11 asks the default device for the GPU it lowers a Triton kernel for, and a CPU
    has none ("No supported GPU devices found"): name the target arch for this host's device
    kind in the registry it falls back to. JAX 0.10 does not ask."""
    try:
        from jax._src.pallas.triton import gpu_info
    except ImportError:
        return
    cc = int(arch.removeprefix("sm_"))
    info = gpu_info.GpuInfo(gpu_version=None, arch_name=f"{cc // 10}.{cc % 10}",
                            compute_capability=cc)
    gpu_info.registry[jax.devices()[0].device_kind] = lambda: info
    gpu_info.get_gpu_info.cache_clear()


def triton_kernels(case: kx.Case, chunk: int, arch: str = "sm_90") -> dict[str, dict]:
    """``{fwd|dq|dkv: {ttir, num_warps, num_stages}}`` from the exported round."""
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir
    from jax._src.pallas.triton import lowering
    _target_gpu(arch)
    try:
        exported = export.export(
            jax.jit(kx.round_fn(case)), platforms=["cuda"],
            disabled_checks=[export.DisabledSafetyCheck.custom_call(CUSTOM_CALL)],
        )(*kx.arg_shapes(case, chunk))
    except Exception as e:  # a lowering rule Triton lacks, a shape it refuses, ...
        raise CompileError(f"lowering failed: {_one_line(e)}") from None
    configs = []
    with mlir.make_ir_context():
        module = ir.Module.parse(exported.mlir_module())

        def walk(op):
            for region in op.regions:
                for block in region.blocks:
                    for inner in block.operations:
                        attrs = inner.operation.attributes
                        if "call_target_name" in attrs and \
                                ir.StringAttr(attrs["call_target_name"]).value == CUSTOM_CALL:
                            configs.append(ir.DictAttr(attrs["mhlo.backend_config"]))
                        walk(inner.operation)
        walk(module.operation)
        found = {}
        for cfg in configs:
            name = ir.StringAttr(cfg["name"]).value
            with lowering._new_ir_context():  # the Triton dialect's context
                ttir = ir.Module.parse(ir.StringAttr(cfg["ir"]).value_bytes).operation.get_asm()
            found[kx.KERNELS.get(name, name)] = {
                "ttir": ttir, "num_warps": ir.IntegerAttr(cfg["num_warps"]).value,
                "num_stages": ir.IntegerAttr(cfg["num_stages"]).value}
    return found


def _ptxas_stats(ptx: str, arch_flag: str, ptxas: str) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        res = subprocess.run([ptxas, "-v", "-lineinfo", "--regAllocOptLevel=2",
                              f"--gpu-name={arch_flag}", f.name, "-o", os.devnull],
                             capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    if res.returncode:
        raise CompileError(f"ptxas failed: {res.stderr.strip().splitlines()[-1:]}")
    num = lambda pattern: sum(int(x) for x in re.findall(pattern, res.stderr))
    return {"registers": num(r"Used (\d+) registers"),
            "spill_bytes": num(r"(\d+) bytes spill stores") + num(r"(\d+) bytes spill loads"),
            "static_smem": num(r"(\d+) bytes smem")}


def compile_kernel(kernel: dict, arch: str) -> dict:
    """Registers per thread, spill bytes, shared memory per block and tensor-core instruction
    count of one kernel (``triton_kernels``' entry) compiled for ``arch`` (sm_80 | sm_90)."""
    triton_version()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import sm_arch_from_capability
    cc = int(arch.removeprefix("sm_"))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ttir")
        with open(path, "w") as f:
            f.write(kernel["ttir"])
        try:
            compiled = triton.compile(path, target=GPUTarget("cuda", cc, 32), options={
                "num_warps": kernel["num_warps"], "num_stages": kernel["num_stages"]})
        except Exception as e:
            raise CompileError(f"triton compile failed: {_one_line(e)}") from None
    ptx = compiled.asm["ptx"]
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                         "ptxas-blackwell")
    stats = _ptxas_stats(ptx, sm_arch_from_capability(cc), ptxas)
    smem = compiled.metadata.shared + stats.pop("static_smem")
    return {**stats, "smem": smem, "smem_limit": SMEM_LIMIT[arch],
            "tensor_core_ops": ptx.count(TENSOR_CORES[arch])}


def problems(row: dict) -> list[str]:
    """What keeps a compiled kernel from being a good default (empty: none)."""
    if row.get("error"):
        return [row["error"]]
    out = []
    if row["spill_bytes"]:
        out.append(f"spills {row['spill_bytes']} B")
    if row["smem"] > row["smem_limit"]:
        out.append(f"shared memory {row['smem']} > {row['smem_limit']}")
    if not row["tensor_core_ops"]:
        out.append("no tensor-core instructions")
    return out
