"""Rotary position embedding with the context-extension scalings, as Hugging Face defines them.

``Rope`` is static model metadata (hashable). Its inverse frequencies follow transformers'
``modeling_rope_utils`` step by step in float32, so an imported checkpoint gives the logits it
gave there:
- ``none``: ``1 / theta^(2i/d)``.
- ``linear`` (position interpolation): every frequency divided by ``factor``.
- ``dynamic`` (NTK-aware): once the forward pass holds a position past ``original_max_len``,
  the base grows to ``theta * (factor * n / orig - (factor - 1))^(d/(d-2))`` with ``n`` the
  largest position + 1 in the batch (transformers takes it from the position ids of the call).
- ``yarn``: per-frequency blend of interpolation and extrapolation between the ``beta_fast``
  and ``beta_slow`` rotation counts over ``original_max_len``; cos and sin are scaled by the
  attention factor (``0.1 ln(factor) + 1`` unless given).
- ``llama3``: low frequencies divided by ``factor``, high ones kept, a smooth ramp between
  (Llama 3.1).
The rotation reads the true position ids, never the array index: layouts permute tokens.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax.numpy as jnp
import numpy as np

SCALINGS = ("none", "linear", "dynamic", "yarn", "llama3")
_F32 = np.float32


@dataclasses.dataclass(frozen=True)
class Rope:
    theta: float = 10000.0
    scaling: str = "none"  # none | linear | dynamic | yarn | llama3
    factor: float = 1.0
    # The context the model was pretrained at: yarn / llama3 "original_max_position_embeddings",
    # dynamic "max_position_embeddings" (transformers' names).
    original_max_len: int = 0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float = 0.0  # yarn: cos/sin scale; 0 derives it from factor
    truncate: bool = True  # yarn: round the correction range to whole dimensions

    def inv_freq(self, dim: int) -> np.ndarray:
        """float32 ``[dim / 2]`` inverse frequencies (dynamic: those before any growth)."""
        return _inv_freq(self, dim)

    def cos_scale(self) -> float:
        if self.scaling != "yarn":
            return 1.0
        if self.attention_factor:
            return float(self.attention_factor)
        return 1.0 if self.factor <= 1 else 0.1 * math.log(self.factor) + 1.0

    def angles(self, positions_BL, dim: int):
        """fp32 ``[B, L, dim / 2]`` rotation angles of the given positions."""
        pos_BL = positions_BL.astype(jnp.float32)
        if self.scaling != "dynamic":
            return pos_BL[..., None] * jnp.asarray(self.inv_freq(dim))
        # The base depends on the batch's longest position, a traced value.
        n = jnp.maximum(positions_BL.max() + 1, self.original_max_len).astype(jnp.float32)
        grow = self.factor * n / self.original_max_len - (self.factor - 1)
        base = self.theta * grow ** (dim / (dim - 2))
        exponent = jnp.asarray(np.arange(0, dim, 2).astype(_F32) / _F32(dim))
        return pos_BL[..., None] * (1.0 / base ** exponent)

    def __call__(self, x_BLHD, positions_BL):
        d = x_BLHD.shape[-1]
        angle_BLF = self.angles(positions_BL, d)
        s = self.cos_scale()
        cos, sin = jnp.cos(angle_BLF)[:, :, None, :] * s, jnp.sin(angle_BLF)[:, :, None, :] * s
        x1, x2 = jnp.split(x_BLHD.astype(jnp.float32), 2, axis=-1)
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x_BLHD.dtype)


def check(r: Rope) -> str | None:
    """Why ``r`` is not a valid scaling (one line), or None."""
    if r.theta <= 0:
        return f"rope_theta={r.theta} must be > 0"
    if r.scaling not in SCALINGS:
        return f"rope_scaling.type={r.scaling!r} is not one of {', '.join(SCALINGS)}"
    if r.scaling == "none":
        return None
    if r.factor < 1:
        return f"rope_scaling.factor={r.factor} must be >= 1 for {r.scaling} scaling"
    if r.scaling in ("dynamic", "yarn", "llama3") and r.original_max_len < 1:
        return (f"rope_scaling.original_max_len={r.original_max_len}: {r.scaling} scaling needs "
                f"the context length the model was pretrained at")
    if r.scaling == "llama3" and not r.high_freq_factor > r.low_freq_factor > 0:
        return (f"rope_scaling.high_freq_factor={r.high_freq_factor} must exceed "
                f"low_freq_factor={r.low_freq_factor} > 0 for llama3 scaling")
    if r.scaling == "yarn" and (r.beta_fast <= 0 or r.beta_slow <= 0 or r.attention_factor < 0):
        return "rope_scaling.beta_fast, beta_slow must be > 0 and attention_factor >= 0 for yarn"
    return None


def from_config(m) -> Rope:
    """The model config's RoPE (``model.rope_theta`` and ``model.rope_scaling.*``)."""
    s = m.get("rope_scaling")
    if s is None:  # a run saved before scaling existed
        return Rope(theta=float(m.rope_theta))
    return Rope(theta=float(m.rope_theta), scaling=s.type, factor=float(s.factor),
                original_max_len=int(s.original_max_len),
                low_freq_factor=float(s.low_freq_factor), high_freq_factor=float(s.high_freq_factor),
                beta_fast=float(s.beta_fast), beta_slow=float(s.beta_slow),
                attention_factor=float(s.attention_factor), truncate=bool(s.truncate))


@functools.cache
def _inv_freq(r: Rope, dim: int) -> np.ndarray:
    base = _F32(r.theta)
    exponent = np.arange(0, dim, 2).astype(_F32) / _F32(dim)
    inv = (_F32(1.0) / base ** exponent).astype(_F32)
    if r.scaling == "linear":
        return (inv / _F32(r.factor)).astype(_F32)
    if r.scaling == "yarn":
        return _yarn(r, dim, base ** exponent)
    if r.scaling == "llama3":
        return _llama3(r, inv)
    return inv  # none; dynamic before its base grows


def _yarn(r: Rope, dim: int, pos_freqs: np.ndarray) -> np.ndarray:
    def correction_dim(rotations):
        return (dim * math.log(r.original_max_len / (rotations * 2 * math.pi))) / (2 * math.log(r.theta))

    low, high = correction_dim(r.beta_fast), correction_dim(r.beta_slow)
    if r.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=_F32) - _F32(low)) / _F32(high - low), 0, 1)
    extrapolate = (_F32(1) - ramp).astype(_F32)
    inv_extrapolation = _F32(1) / pos_freqs
    inv_interpolation = _F32(1) / (_F32(r.factor) * pos_freqs)
    return (inv_interpolation * (1 - extrapolate) + inv_extrapolation * extrapolate).astype(_F32)


def _llama3(r: Rope, inv: np.ndarray) -> np.ndarray:
    orig, lo, hi, factor = r.original_max_len, r.low_freq_factor, r.high_freq_factor, _F32(r.factor)
    low_wavelen, high_wavelen = orig / lo, orig / hi
    wavelen = (2 * math.pi / inv).astype(_F32)
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv).astype(_F32)
    smooth = ((orig / wavelen - lo) / (hi - lo)).astype(_F32)
    smoothed = ((1 - smooth) * scaled / factor + smooth * scaled).astype(_F32)
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(_F32)
