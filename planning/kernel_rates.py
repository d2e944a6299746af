"""Measured attention-kernel speed, so that the planner predicts a step rather than bounding it.

A table of TFLOP/s per (kernel, round type, chunk), forward and forward+backward, over the
visible (causal) pairs, as ``scripts/bench_kernels.py`` measures them: read from its ``--json``
(``--kernel-rates PATH``) or built in for a GPU this project has measured (``--kernel-rates
h200``: docs/kernels.md's table). With it, ``planning/step_time.py`` times each ring round at the
kernel's measured rate for that round type and chunk (log-linear between measured chunks, the
nearest outside them) instead of the peak, and the matmuls at ``MATMUL_EFFICIENCY`` of the peak.

Round types: ``diagonal`` (a device's own block), ``striped`` (a strictly lower round), ``full``
(every key visible; measured as the diagonal when the table has no ``full`` row).
"""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib

# bf16 GEMMs of a 1-8B decoder's shapes on Hopper run at about 60-70% of the dense peak (cuBLAS;
# not measured by this project yet); the planner's default when rates are given.
MATMUL_EFFICIENCY = 0.6

# One H200, JAX 0.11.2, bf16, 16 heads of 128, default tiles, medians of 5 (docs/kernels.md,
# "Measured on one H200", 2026-11-30): chunk -> (forward, forward+backward) TFLOP/s.
H200 = {
    "xla": {"diagonal": {4096: (18.3, 26.8), 8192: (20.1, 30.5), 16384: (23.0, 33.2),
                         32768: (24.1, 34.0)},
            "striped": {32768: (24.2, 34.4)}},
    "pallas_gpu": {"diagonal": {4096: (87.3, 148.9), 8192: (226.2, 236.5),
                                16384: (302.3, 262.3), 32768: (348.5, 289.4)},
                   "striped": {32768: (357.9, 289.5)}},
    "cudnn_bare": {"diagonal": {4096: (211.9, 181.4), 8192: (360.1, 397.8),
                                16384: (486.4, 531.8), 32768: (577.5, 535.2)}},
    # The ring's own cudnn round (parallel/kernels/cudnn.py) per round type, 2026-12-04.
    "cudnn": {"diagonal": {8192: (302.5, 439.1), 32768: (603.3, 532.9)},
              "striped": {8192: (339.8, 366.5), 32768: (593.4, 524.3)},
              "full": {8192: (450.1, 515.3), 32768: (628.8, 547.0)}},
}
BUILT_IN = {"h200": H200}
# The xla kernel's tile (attention.block_q = block_kv) the built-in rows were measured with
# (bench_kernels' --xla-block default). Its speed is per tile (several kernels each, the scores
# in memory), so rates measured at one tile do not time another.
BUILT_IN_XLA_TILE = {"h200": 512}
FWD_BWD_FLOPS = 3.5  # forward+backward FLOPs over the forward's (bench_kernels' count)


@dataclasses.dataclass(frozen=True)
class Rates:
    """One kernel's measured rates: case -> {chunk: (forward, forward+backward) TFLOP/s}."""
    kernel: str
    source: str
    table: dict
    matmul_efficiency: float = MATMUL_EFFICIENCY
    xla_tile: int | None = None  # the xla kernel's tile the rows were measured with

    def tile_caveat(self, block_q: int, block_kv: int) -> str:
        """One line when the rows time an xla kernel with other tiles than the config's, else ''.
        (llama_1b at 32k on the H200: tiles of 1,024 ran about 1.9x faster than rates measured
        with 512 predict.)"""
        if self.kernel != "xla" or not self.xla_tile or block_q == block_kv == self.xla_tile:
            return ""
        return (f"the xla rates were measured with {self.xla_tile}-position tiles and this config "
                f"runs {block_q}x{block_kv} (attention.block_q/block_kv): its attention time is "
                f"not measured; bench it with scripts/bench_kernels.py --kernels xla "
                f"--xla-block {block_q}")

    def _at(self, case: str, chunk: int) -> tuple[float, float]:
        """(forward, forward+backward) TFLOP/s of ``case`` at ``chunk``. Outside the chunks a case
        was measured at, it follows the diagonal's curve from its nearest measured chunk (H200's
        striped round is measured at 32k only, and at 4k the kernel is 4x slower)."""
        by_chunk = self.table.get(case)
        diag = self.table.get("diagonal")
        if by_chunk is None:
            by_chunk = diag or next(iter(self.table.values()))
        elif diag and by_chunk is not diag and not min(by_chunk) <= chunk <= max(by_chunk):
            near = min(by_chunk, key=lambda c: abs(math.log(c / chunk)))
            here, there = self._interp(diag, chunk), self._interp(diag, near)
            return tuple(x * h / t for x, h, t in zip(by_chunk[near], here, there))
        return self._interp(by_chunk, chunk)

    @staticmethod
    def _interp(by_chunk: dict, chunk: int) -> tuple[float, float]:
        chunks = sorted(by_chunk)
        lo = max([c for c in chunks if c <= chunk], default=chunks[0])
        hi = min([c for c in chunks if c >= chunk], default=chunks[-1])
        if lo == hi:
            return by_chunk[lo]
        t = (math.log(chunk) - math.log(lo)) / (math.log(hi) - math.log(lo))
        return tuple(a + t * (b - a) for a, b in zip(by_chunk[lo], by_chunk[hi]))

    def forward_flops_s(self, case: str, chunk: int) -> float:
        return self._at(case, chunk)[0] * 1e12

    def backward_flops_s(self, case: str, chunk: int) -> float:
        """The backward alone (2.5x the forward's FLOPs) in the time forward+backward adds."""
        f, fb = self._at(case, chunk)
        if FWD_BWD_FLOPS / fb <= 1 / f:
            raise ValueError(f"{self.source}: {self.kernel} {case} at {chunk}: forward+backward "
                             f"at {fb:g} TFLOP/s against a forward at {f:g} leaves the backward "
                             f"no time; measure again")
        return (FWD_BWD_FLOPS - 1) / (FWD_BWD_FLOPS / fb - 1 / f) * 1e12


def xla_tile_of(rows: list) -> int | None:
    """The xla tile of bench_kernels.py's xla rows (512, its default, before rows said)."""
    xla = [r for r in rows if r["kernel"] == "xla"]
    return int(xla[0].get("xla_block", 512)) if xla else None


def from_bench_rows(rows: list, kernel: str) -> dict:
    """bench_kernels.py's ``--json`` rows of ``kernel``: case -> {chunk: (fwd, fwd+bwd)}."""
    table = {}
    for r in rows:
        if r["kernel"] == kernel:
            table.setdefault(r["case"], {})[int(r["chunk"])] = (r["fwd_tflops"],
                                                               r["fwd_bwd_tflops"])
    return table


def load(spec: str, kernel: str, matmul_efficiency: float = MATMUL_EFFICIENCY) -> Rates:
    """``spec``: a built-in name (``h200``) or a bench_kernels.py JSON file. ``cudnn`` without
    rows of its own is timed at bare cuDNN's (``cudnn_bare``). ValueError in one line when it
    has no rates for ``kernel``."""
    if spec in BUILT_IN:
        get, source, valid = BUILT_IN[spec].get, f"{spec} (docs/kernels.md)", ", ".join(BUILT_IN[spec])
        xla_tile = BUILT_IN_XLA_TILE[spec]
    else:
        try:
            bench = json.loads(pathlib.Path(spec).read_text())["rows"]
            rows = {k: from_bench_rows(bench, k) for k in (kernel, "cudnn_bare")}
            xla_tile = xla_tile_of(bench)
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"--kernel-rates {spec}: not a built-in table ({', '.join(BUILT_IN)}) "
                             f"nor a readable scripts/bench_kernels.py JSON ({e})") from None
        get, source, valid = rows.get, spec, "the kernels its rows name"
    table = get(kernel) or {}
    if not table and kernel == "cudnn" and get("cudnn_bare"):
        table, source = get("cudnn_bare"), source + ", bare cuDNN's rates"
    if not table:
        raise ValueError(f"--kernel-rates {spec} has no rates for kernel {kernel}; valid: {valid}")
    return Rates(kernel, source, table, matmul_efficiency, xla_tile)
