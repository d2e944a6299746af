"""Accelerators a run can be planned for: memory, peak bf16 FLOP/s and link bandwidths.

Figures are per device, from the vendors' data sheets; the peaks come from the one table the
trainer's MFU reads too (accelerators.py); bandwidths are per direction, because a
ring sends to one neighbour while it receives from the other.
"""
from __future__ import annotations

import dataclasses

from accelerators import peak_tflops

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    memory_bytes: int  # device memory (HBM)
    peak_flops: float  # dense bf16 FLOP/s, no sparsity (accelerators.PEAK_TFLOPS)
    link_bytes_s: float  # one direction of the fast link between neighbours in a node / slice
    node_size: int  # devices that share the fast link; 0: the whole slice does (TPU ICI)
    network_bytes_s: float  # one direction, per device, between nodes (0 when node_size is 0)
    note: str


HARDWARE = {
    # H100 SXM5 80GB: NVLink 4 is 900 GB/s bidirectional = 450 GB/s
    # each way; DGX/HGX H100 nodes have 8 GPUs and one 400 Gb/s NDR NIC per GPU = 50 GB/s.
    "h100": Hardware("h100", 80 * GiB, peak_tflops("h100") * 1e12, 450e9, 8, 50e9,
                     "H100 SXM 80GB, NVLink4 450 GB/s/dir, 8 per node, 400 Gb/s IB per GPU"),
    # A100 SXM4 80GB: NVLink 3 is 600 GB/s bidirectional = 300 GB/s each way;
    # DGX A100 has 8 GPUs and one 200 Gb/s HDR NIC per GPU = 25 GB/s.
    "a100": Hardware("a100", 80 * GiB, peak_tflops("a100") * 1e12, 300e9, 8, 25e9,
                     "A100 SXM 80GB, NVLink3 300 GB/s/dir, 8 per node, 200 Gb/s IB per GPU"),
    # H200 SXM: the H100 die (its peak, NVLink 4) with 141 GB of HBM3e; nvidia-smi shows
    # 143771 MiB, i.e. 140 GiB.
    "h200": Hardware("h200", 140 * GiB, peak_tflops("h200") * 1e12, 450e9, 8, 50e9,
                     "H200 SXM 141GB, NVLink4 450 GB/s/dir, 8 per node, 400 Gb/s IB per GPU"),
    # TPU v4: 32 GiB HBM2 (Cloud TPU v4 docs); 6 ICI links in a 3D torus at
    # roughly 50 GB/s each way per link (TPU v4 paper, ISCA 2023): a ring along one torus
    # dimension uses one link each way, and the whole slice is on ICI.
    "tpu-v4": Hardware("tpu-v4", 32 * GiB, peak_tflops("tpu v4") * 1e12, 50e9, 0, 0.0,
                       "TPU v4, 3D torus ICI ~50 GB/s/dir per link"),
    # TPU v5e: 16 GB HBM2e (Cloud TPU v5e docs); ICI 1600 Gbps per chip over
    # 4 links of a 2D torus = 50 GB/s per link, taken as 50 GB/s one way (the docs' newer
    # "400 GB/s bidirectional per chip" reading gives the same per-link figure).
    "v5e": Hardware("v5e", 16 * GiB, peak_tflops("tpu v5e") * 1e12, 50e9, 0, 0.0,
                    "TPU v5e, 2D torus ICI ~50 GB/s/dir per link"),
}

# Memory a run cannot give to the program: the runtime, NCCL/ICI buffers, allocator
# fragmentation. A plan "fits" when its per-device total stays under this fraction.
USABLE_FRACTION = 0.9


def link_bandwidth(hw: Hardware, crosses_nodes: bool) -> float:
    """Bandwidth one way for a collective whose groups stay in a node or cross nodes."""
    if crosses_nodes and hw.node_size:
        return hw.network_bytes_s
    return hw.link_bytes_s
