"""MXFP4, the format of gpt-oss's released MoE expert weights, read and written with numpy alone.

A checkpoint stores each expert matrix ``X`` (``mlp.experts.gate_up_proj``,
``mlp.experts.down_proj``) as two uint8 tensors (``config.json``: ``quantization_config``
``{"quant_method": "mxfp4", ...}``):

- ``X_blocks`` [E, R, G, 16]: row r of expert e is G blocks of 32 values, two 4-bit values per
  byte, the LOW nibble first: byte j of a block holds value 2j in bits 0-3 and value 2j + 1 in
  bits 4-7. A 4-bit value is FP4 e2m1 (1 sign, 2 exponent, 1 mantissa bit), codes 0-7 being
  +0, 0.5, 1, 1.5, 2, 3, 4, 6 and codes 8-15 the same negated (``FP4_VALUES``).
- ``X_scales`` [E, R, G]: one E8M0 byte per 32-value block, the power of two 2^(s - 127)
  that multiplies the block's 32 values (no sign, no mantissa; 255, NaN in the OCP spec, is not
  special-cased: it reads as 2^128, as transformers' ``torch.ldexp`` reads it, so 0.5 becomes
  2^127 and larger values inf).

Dequantized (``dequantize``), the row is [E, R, G * 32] = [E, R, C]: for gate_up_proj
[E, 2F, D] (R = 2F = 2 x intermediate_size, C = D = hidden_size), for down_proj [E, D, F].
transformers (``integrations/mxfp4.py``: ``_convert_moe_packed_tensors`` ends with
``transpose(1, 2)``) then swaps axes 1 and 2, so its model parameters, and gpt-oss's unquantized
bf16 checkpoints, are ``gate_up_proj`` [E, D, 2F] and ``down_proj`` [E, F, D], applied as
``x @ W[e]`` (``dequantize_param``, the orientation ``dequantize_state`` gives). gate_up_proj's
last axis interleaves gate and up (gate = [..., 0::2], up = [..., 1::2]); nothing here
reorders it.

``quantize`` is the writer the tests use for random MXFP4 checkpoints: per block of 32 the
scale is the smallest power of two 2^k with max|w| / 2^k <= 6 (FP4's largest value), and each
value w / 2^k rounds to the nearest FP4 value, a tie to the even code (IEEE round-to-nearest-
even: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4). A block whose
values are FP4 values times one power of two therefore comes back exactly; any other value is
off by at most half the FP4 step around it, times 2^k (0.25, 0.5 or 1 x 2^k below 2, 4, 6).
"""
from __future__ import annotations

import numpy as np

from errors import ConversionError

MXFP4_SUFFIXES = ("_blocks", "_scales")
BLOCK = 32  # values that share one scale
BLOCK_BYTES = BLOCK // 2  # two FP4 values per byte
SCALE_BIAS = 127  # E8M0: scale byte s means 2^(s - 127)

# Indexed by the 4-bit code, as transformers' FP4_VALUES (sign bit 3, then e2m1).
FP4_VALUES = np.array([+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
# The magnitudes codes 0-7 stand for, and the midpoints between neighbours (rounding thresholds).
_MAGNITUDES = FP4_VALUES[:8].astype(np.float64)
_MIDPOINTS = (_MAGNITUDES[:-1] + _MAGNITUDES[1:]) / 2


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks uint8 [..., G, 16] and scales uint8 [..., G] -> float32 [..., G * 32], in the
    checkpoint's row order (no transpose): value 2j of block g is the low nibble of byte j."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and "
                         f"{scales.dtype}")
    if blocks.ndim < 2 or blocks.shape[-1] != BLOCK_BYTES or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks [..., G, {BLOCK_BYTES}] need scales [..., G]: "
                         f"blocks {list(blocks.shape)}, scales {list(scales.shape)}")
    values_bgv = np.empty(blocks.shape[:-1] + (BLOCK,), np.float32)
    values_bgv[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values_bgv[..., 1::2] = FP4_VALUES[blocks >> 4]
    # ldexp, as transformers' torch.ldexp: value x 2^(s - 127) rounded once to float32, so exact
    # wherever the result is a float32 (subnormals included); past float32's range it is +-inf,
    # and a zero stays zero under any scale (byte 255 too: 0.5 x 2^128 is 2^127, finite).
    with np.errstate(over="ignore"):
        values_bgv = np.ldexp(values_bgv, (scales.astype(np.int32) - SCALE_BIAS)[..., None])
    return values_bgv.reshape(blocks.shape[:-2] + (blocks.shape[-2] * BLOCK,))


def dequantize_param(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """A checkpoint's ``X_blocks`` [E, R, G, 16] / ``X_scales`` [E, R, G] -> transformers'
    parameter ``X`` after dequantization, float32 [E, G * 32, R]: axes 1 and 2 of the
    dequantized [E, R, G * 32] swapped, as ``_convert_moe_packed_tensors``'s
    ``transpose(1, 2)``. gate_up_proj_blocks [E, 2F, D/32, 16] -> gate_up_proj [E, D, 2F];
    down_proj_blocks [E, D, F/32, 16] -> down_proj [E, F, D]."""
    blocks = np.asarray(blocks)
    if blocks.ndim < 4:
        raise ValueError(f"MXFP4 expert blocks are [E, R, G, {BLOCK_BYTES}]: "
                         f"got {list(blocks.shape)}")
    return np.ascontiguousarray(np.swapaxes(dequantize(blocks, scales), 1, 2))


def quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float [..., C] (C a multiple of 32) -> (blocks uint8 [..., C/32, 16], scales uint8
    [..., C/32]), blocking the last axis as the checkpoint stores rows: the inverse of
    ``dequantize``. The rounding is the module docstring's."""
    w = np.asarray(w, np.float64)  # exact for float32 / bf16 inputs; the scaling below is too
    if w.ndim < 1 or w.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 quantizes rows of a multiple of {BLOCK} values: "
                         f"got shape {list(w.shape)}")
    if not np.isfinite(w).all():
        raise ValueError("MXFP4 quantizes finite values only")
    w_bgv = w.reshape(w.shape[:-1] + (w.shape[-1] // BLOCK, BLOCK))
    max_abs_bg = np.abs(w_bgv).max(axis=-1)
    # The smallest k with max_abs <= 6 x 2^k = 0.75 x 2^(k + 3), from max_abs = m x 2^e
    # (m in [0.5, 1)) without a rounded log2: k = e - 3 if m <= 0.75, else e - 2.
    mantissa, exponent = np.frexp(max_abs_bg)
    k_bg = np.where(mantissa <= 0.75, exponent - 3, exponent - 2)
    # An all-zero block takes scale 2^0; E8M0 spans 2^-127 .. 2^127 (255 is NaN).
    k_bg = np.where(max_abs_bg == 0, 0, np.clip(k_bg, -SCALE_BIAS, SCALE_BIAS)).astype(np.int32)
    scaled_bgv = np.ldexp(w_bgv, -k_bg[..., None])
    magnitude = np.abs(scaled_bgv)
    # searchsorted 'left': at a midpoint the lower code; a tie between an odd code and the even
    # code above then moves up, so ties go to the even code.
    code = np.searchsorted(_MIDPOINTS, magnitude, side="left")
    at_midpoint = magnitude == _MIDPOINTS[np.minimum(code, len(_MIDPOINTS) - 1)]
    code = code + (at_midpoint & (code < len(_MIDPOINTS)) & (code % 2 == 1))
    # The sign bit from signbit, so -0.0 (and negatives rounding to 0) keep code 8.
    code = code.astype(np.uint8) | (np.signbit(scaled_bgv).astype(np.uint8) << 3)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)  # low nibble = the even value
    scales = (k_bg + SCALE_BIAS).astype(np.uint8)
    # C order: numpy keeps a transposed input's strides through these ops, and a writer that
    # takes the buffer as it lies (safetensors' save_file does) would store them scrambled.
    return np.ascontiguousarray(blocks, np.uint8), np.ascontiguousarray(scales)


def quantize_param(param: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """transformers' parameter [E, C, R] (gate_up_proj [E, D, 2F], down_proj [E, F, D]) ->
    the checkpoint's (``X_blocks`` [E, R, C/32, 16], ``X_scales`` [E, R, C/32]): the inverse
    of ``dequantize_param``."""
    param = np.asarray(param)
    if param.ndim < 3:
        raise ValueError(f"MXFP4 expert parameters are [E, C, R]: got {list(param.shape)}")
    return quantize(np.swapaxes(param, 1, 2))


def check_quantization(cfg: dict) -> str | None:
    """config.json's ``quantization_config``: None without one, "mxfp4" for gpt-oss's released
    format; any other method stops in one line (its tensors are not what this reader knows)."""
    qc = cfg.get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else qc
    if method == "mxfp4":
        return "mxfp4"
    raise ConversionError(f"config.json: quantization_config.quant_method={method!r} does not "
                          f"convert; only mxfp4 (gpt-oss's released format) or unquantized "
                          f"bf16/fp32 safetensors are read")


def _dequantized(name: str, blocks, scales) -> np.ndarray:
    """``X`` from the pair ``name`` (``X_blocks``) and its scales, checked: one line if they are
    not uint8 blocks [E, R, G, 16] with uint8 scales [E, R, G]."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if (blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.ndim != 4
            or blocks.shape[-1] != BLOCK_BYTES or blocks.shape[:-1] != scales.shape):
        scales_name = name[: -len(MXFP4_SUFFIXES[0])] + MXFP4_SUFFIXES[1]
        raise ConversionError(
            f"{name} {blocks.dtype} {list(blocks.shape)} and {scales_name} "
            f"{scales.dtype} {list(scales.shape)}: MXFP4 needs uint8 blocks "
            f"[E, R, G, {BLOCK_BYTES}] and uint8 scales [E, R, G]")
    return dequantize_param(blocks, scales)


class Dequantized:
    """A checkpoint's tensors (``names()``, ``in``, ``[name]``: hf/safetensors.Tensors) with
    every ``X_blocks`` / ``X_scales`` pair served as ``X``, dequantized when read (one expert
    matrix of a layer at a time, not the whole checkpoint) in transformers' parameter
    orientation, cast to ``dtype`` (None: float32; bfloat16 holds every MXFP4 value exactly,
    as transformers' bf16 dequantization does). A half pair stops in one line at once."""

    def __init__(self, tensors, dtype=None):
        blocks_suffix, scales_suffix = MXFP4_SUFFIXES
        self.tensors, self.dtype, self.pairs = tensors, dtype, {}
        for name in tensors.names():
            if name.endswith(scales_suffix):
                if name[: -len(scales_suffix)] + blocks_suffix not in tensors:
                    raise ConversionError(f"{name} has no {name[: -len(scales_suffix)]}"
                                          f"{blocks_suffix}: an MXFP4 tensor is a _blocks / "
                                          f"_scales pair")
            elif name.endswith(blocks_suffix):
                base = name[: -len(blocks_suffix)]
                if base + scales_suffix not in tensors:
                    raise ConversionError(f"{name} has no {base + scales_suffix}: an MXFP4 "
                                          f"tensor is a _blocks / _scales pair")
                self.pairs[base] = name
        self._names = sorted([n for n in tensors.names() if not n.endswith(MXFP4_SUFFIXES)]
                             + list(self.pairs))

    def names(self) -> list[str]:
        return self._names

    def __contains__(self, name: str) -> bool:
        return name in self.pairs or (name in self.tensors and not name.endswith(MXFP4_SUFFIXES))

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self.pairs:
            return self.tensors[name]
        blocks = self.pairs[name]
        out = _dequantized(blocks, self.tensors[blocks],
                           self.tensors[name + MXFP4_SUFFIXES[1]])
        return out if self.dtype is None else out.astype(self.dtype)


class _Dict:
    def __init__(self, tensors: dict):
        self.d = tensors

    def names(self) -> list[str]:
        return list(self.d)

    def __contains__(self, name: str) -> bool:
        return name in self.d

    def __getitem__(self, name: str) -> np.ndarray:
        return self.d[name]


def dequantize_state(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every pair ``X_blocks`` / ``X_scales`` -> ``X``, float32 in transformers' parameter
    orientation (``dequantize_param``), so an MXFP4 checkpoint reads as an unquantized one; the
    other tensors as they are (``Dequantized``, all read). A half pair, or blocks and scales
    that disagree, stop in one line."""
    view = Dequantized(_Dict(tensors))
    return {name: view[name] for name in view.names()}
