"""Static description of one per-round kernel call (hashable: it keys jit caches)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RoundSpec:
    kernel: str  # pallas_gpu | pallas_tpu
    block_q: int  # positions per q tile (a tile holds block_q * group rows)
    block_kv: int  # positions per kv tile
    group: int  # query heads per kv head, folded into the rows of a q tile
    kv_heads: int  # kv heads on this device (the leading dim is batch x kv_heads)
    head_dim: int
    scale: float  # softmax scale, applied to the fp32 scores inside the kernel
    causal: bool
    has_seg: bool
    interpret: bool  # Pallas interpret mode (a CPU, or forced)
