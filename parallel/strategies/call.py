"""Static description of one context-parallel attention call (hashable: a custom_vjp
nondiff argument and the key of the compiled programs)."""
from __future__ import annotations

import dataclasses

from jax.sharding import PartitionSpec as P

from parallel.kernels.spec import RoundSpec


@dataclasses.dataclass(frozen=True)
class Call:
    mesh: object
    axis: str
    batch_axes: tuple
    head_axis: str | None
    causal: bool
    block_q: int
    block_kv: int
    scale: float
    kernel: str = "xla"  # resolved: xla | pallas_gpu | pallas_tpu | cudnn
    interpret: bool = False  # Pallas interpret mode
    impl: str = "ring"  # ring | allgather | ulysses | usp
    ulysses: int = 1  # devices per all-to-all group (neighbours on the axis); N for ulysses

    tiles: tuple = ()  # (forward, dQ, dK/dV) Tiles (``parallel/kernels/tiling.py``)
    window: int = 0  # sliding window W (causal only): a query sees q_pos - W < k_pos; 0: none
    rounds: int = 0  # ring rounds that can have work (the window's reach); 0: every hop

    def round_spec(self, q_heads, kv_heads, head_dim, has_seg) -> RoundSpec:
        return RoundSpec(self.kernel, *self.tiles, q_heads // kv_heads, kv_heads, head_dim,
                         self.scale, self.causal, has_seg, self.interpret, self.window)

    @property
    def size(self):
        return self.mesh.shape[self.axis]

    @property
    def groups(self):
        """All-to-all groups along the axis: U neighbouring devices each (None: the whole axis)."""
        u = self.ulysses
        if u == self.size:
            return None
        return [list(range(g, g + u)) for g in range(0, self.size, u)]

    def spec(self, *names):
        """PartitionSpec from per-dim roles: 'b' batch, 's' sequence, 'h' heads, None."""
        role = {"b": self.batch_axes or None, "s": self.axis, "h": self.head_axis, None: None}
        return P(*(role[n] for n in names))

    def fwd_specs(self, has_seg, has_sink=False):
        """In-specs of the forward: q, k, v, positions, segment ids (and the sinks ``[Hq]``)."""
        qspec = self.spec("b", "s", "h", None)
        sink = (self.spec("h"),) if has_sink else ()
        return (qspec, qspec, qspec, self.spec("b", "s"),
                self.spec("b", "s") if has_seg else None) + sink

    def bwd_specs(self, has_seg, has_sink=False):
        """In-specs of the backward: the forward's, then out, lse, dout (and the sinks)."""
        qspec = self.spec("b", "s", "h", None)
        sink = (self.spec("h"),) if has_sink else ()
        return self.fwd_specs(has_seg) + (qspec, self.lse_spec(), qspec) + sink

    def lse_spec(self):
        return self.spec("b", "h", "s", None)
