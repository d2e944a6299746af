"""Static description of one per-round kernel call (hashable: it keys jit caches)."""
from __future__ import annotations

import dataclasses
from typing import NamedTuple


class Tile(NamedTuple):
    """One kernel's tiles in positions, already fitted to the chunk, and the Triton launch
    parameters it compiles with (``parallel/kernels/tiling.py``; Mosaic and XLA ignore them)."""

    block_q: int
    block_kv: int
    num_warps: int = 4
    num_stages: int = 2


@dataclasses.dataclass(frozen=True)
class RoundSpec:
    kernel: str  # a REGISTRY name: xla | pallas_gpu | pallas_tpu | cudnn
    fwd: Tile  # the forward kernel's tiles
    dq: Tile  # the dQ kernel's
    dkv: Tile  # the dK/dV kernel's (the backward's two may differ from the forward's)
    group: int  # query heads per kv head
    kv_heads: int  # kv heads on this device (the leading dim is batch x kv_heads)
    head_dim: int
    scale: float  # softmax scale, applied to the fp32 scores inside the kernel
    causal: bool
    has_seg: bool
    interpret: bool  # Pallas interpret mode (a CPU, or forced); False for xla
    window: int = 0  # sliding window W (causal only): keys with q_pos - W < k_pos; 0: none
