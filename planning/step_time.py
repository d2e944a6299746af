"""Projected step time and MFU bound of a planned run, per token layout.

The model is a lower bound on the step time (an upper bound on MFU): matmuls run at the
hardware's peak bf16 FLOP/s and links at their peak bandwidth. Two phases per step:

- attention, layer by layer: ring rounds, timed once per kind of layer (``model.layer_types``:
  a sliding layer's window leaves fewer tiles, and in the contiguous layout fewer rounds, than a
  full layer's; :func:`attention_groups`) and summed over the layers of each kind. A round
  lasts as long as the busiest device's tiles (``parallel.schedule``: the kernel's own skip
  predicate) or the K/V transfer to the next device, whichever is longer, since the kernel
  issues the next block's send before computing the current one. Masked and unmasked tiles
  cost the same (the kernel computes the whole tile and then masks); skipped tiles cost
  nothing. That is where the layouts differ.
- everything else (projections, MLP, head, optimizer): matmul FLOPs split over all devices,
  overlapped with the non-ring collectives of the compiled step (FSDP gathers, gradient
  reductions), so the longer of the two counts.

Other context-parallel strategies (``attention.impl``, :func:`strategy_layer_time`), with the
same tile pairs (``parallel.schedule.strategy_rounds``) and the same links:

- allgather: gather K/V (N-1 chunks in), compute every chunk without waiting, and in the
  backward gather again and reduce-scatter fp32 dK/dV; the collectives are data dependencies
  of the compute, so they add to it.
- ulysses: all-to-alls of q, k, v in and the output back ((U-1)/U of each device's data; the
  backward moves q, k, v, dout in and dq, dk, dv back), then perfectly balanced compute on 1/U
  of the heads; the all-to-alls add to the compute.
- usp: the Ulysses all-to-alls inside groups of U neighbouring devices, then a ring of N/U
  rounds across the groups: each round sends a K/V block as big as the ring's (U chunks of
  Hkv/U heads) while it computes U x U chunk pairs on 1/U of the heads, U times the ring's
  compute per transfer.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from model.sharded import lora_counts
from model.flops import (flops_per_token, head_dim, matmul_params, mlp_matmul_params,
                         total_matmul_params, window_counts)
from parallel.experts import EXCHANGE_SCOPE
from parallel.schedule import strategy_rounds, work
from parallel.strategies import IMPLS
from parallel.window import reach
from planning import collectives as coll
from planning.hardware import Hardware, link_bandwidth

# Per (query, key) pair, per head dim: QK^T and PV are 2 matmuls of 2 FLOPs a multiply-add.
# The backward recomputes the scores and computes dV, dP, dQ and dK: 5 matmuls.
FWD_PAIR_FLOPS = 4
BWD_PAIR_FLOPS = 10
# Remat policies that recompute the attention forward / the layer's matmuls in the backward.
RECOMPUTES_ATTENTION = ("attention", "full", "offload", "offload_input")
RECOMPUTES_MATMULS = ("full", "offload_input")


@dataclasses.dataclass
class Shape:
    """Per-device sizes of one planned step."""
    rows: int  # sequences per device (global rows / (data x fsdp))
    chunk: int  # tokens per device of each sequence (seq_len / sequence)
    ring: int  # devices in the ring (mesh sequence axis)
    q_heads: int  # query heads per device (over the tensor axis)
    kv_heads: int
    head_dim: int
    block_q: int
    block_kv: int
    dtype_bytes: int  # activations' dtype (K/V travel in it; dK/dV travel in fp32)
    has_segments: bool = True  # segment ids travel with K/V (packed documents)


def shape_of(config, mesh_sizes: dict, global_rows: int, dtype_bytes: int = 2) -> Shape:
    m, a = config.model, config.attention
    n, t = mesh_sizes["sequence"], mesh_sizes["tensor"]
    chunk = config.data.seq_len // n
    return Shape(rows=global_rows // (mesh_sizes["data"] * mesh_sizes["fsdp"]), chunk=chunk, ring=n,
                 q_heads=m.num_heads // t, kv_heads=m.num_kv_heads // t, head_dim=head_dim(m),
                 block_q=min(a.block_q, chunk), block_kv=min(a.block_kv, chunk),
                 dtype_bytes=dtype_bytes)


def ring_layer_time(tiles: np.ndarray, s: Shape, hw: Hardware, ring_bw: float, remat: str,
                    rates=None, layout: str = "striped") -> dict:
    """Seconds of one layer's ring attention (forward, recomputed forward, backward); at the
    kernel's measured ``rates`` (``planning/kernel_rates.py``) per round type, else the peak."""
    return _rounds_time(tiles.max(axis=1).astype(float), s, hw, ring_bw, remat, rates=rates,
                        layout=layout)


def round_case(layout: str, r: int) -> str:
    """The bench's round type of ring round ``r``: the own block, then striped's strictly lower
    rounds or another layout's earlier blocks (zigzag's halves are counted as full)."""
    return "diagonal" if r == 0 else ("striped" if layout == "striped" else "full")


def _flops_s(rates, hw: Hardware, rounds: int, chunk: int, layout: str, backward: bool):
    if rates is None:
        return np.full(rounds, hw.peak_flops)
    rate = rates.backward_flops_s if backward else rates.forward_flops_s
    return np.array([rate(round_case(layout, r), chunk) for r in range(rounds)])


def _kv_bytes(s: Shape, u: int = 1) -> tuple[float, float]:
    """Bytes of the K/V block that travels (input dtype, with positions / segment ids of U
    chunks) and of its fp32 dK/dV, per device: U chunks of Hkv/U heads is one chunk's worth."""
    kv = 2 * s.rows * s.chunk * s.kv_heads * s.head_dim * s.dtype_bytes
    kv += (2 if s.has_segments else 1) * s.rows * s.chunk * u * 4  # positions (+ segment ids)
    dkv = 2 * s.rows * s.chunk * s.kv_heads * s.head_dim * 4
    return kv, dkv


def _rounds_time(busiest: np.ndarray, s: Shape, hw: Hardware, ring_bw: float, remat: str,
                 u: int = 1, rates=None, layout: str = "striped") -> dict:
    """Ring rounds with the busiest device's tiles ``busiest [rounds]`` (whole-head tile pairs)."""
    pair = s.block_q * s.block_kv * s.head_dim * s.q_heads * s.rows
    kv, dkv = _kv_bytes(s, u)
    last = np.arange(len(busiest)) == len(busiest) - 1
    send_fwd = np.where(last, 0.0, kv) / ring_bw  # the last round sends nothing
    n = len(busiest)
    fwd_compute = busiest * FWD_PAIR_FLOPS * pair / _flops_s(rates, hw, n, s.chunk, layout, False)
    fwd = np.maximum(fwd_compute, send_fwd).sum()
    # Backward round r: K/V prefetch for the next round and last round's dK/dV move on; the
    # final hop brings each block's dK/dV home after the last round.
    send_bwd = (np.where(last, 0.0, kv) + np.where(np.arange(len(busiest)) == 0, 0.0, dkv)) / ring_bw
    bwd_compute = busiest * BWD_PAIR_FLOPS * pair / _flops_s(rates, hw, n, s.chunk, layout, True)
    bwd = np.maximum(bwd_compute, send_bwd).sum() + (dkv / ring_bw if len(busiest) > 1 else 0.0)
    passes = 2 if remat in RECOMPUTES_ATTENTION else 1
    return {"forward_s": float(fwd), "backward_s": float(bwd), "forward_passes": passes,
            "total_s": float(passes * fwd + bwd),
            "exposed_send_s": float(passes * fwd + bwd - passes * fwd_compute.sum() - bwd_compute.sum()),
            "round_compute_s": float(fwd_compute.max()), "round_send_s": float(send_fwd.max()),
            "compute_bound_rounds": int((fwd_compute >= send_fwd).sum())}


def recomputed_matmul_params(config, remat: str) -> int:
    """Matmul parameters per token whose forward the backward runs again, as the trainer does:
    the head always (the loss runs its chunks under remat, model/loss.py), every layer's
    matmuls under full remat, else the MLP's when it runs in chunks (model.mlp_chunk). A
    mixture of experts' are its router's and a token's top k experts' (model/flops.py)."""
    m = config.model
    head = m.d_model * m.vocab_size
    if remat in RECOMPUTES_MATMULS:
        return matmul_params(m)
    return head + (m.num_layers * mlp_matmul_params(m) if m.get("mlp_chunk", 0) else 0)


def _a2a_bytes(s: Shape, u: int) -> tuple[float, float]:
    """Bytes one device moves through all-to-alls in one layer's forward and backward."""
    share = (u - 1) / u
    tok = s.rows * s.chunk * s.head_dim * s.dtype_bytes
    fwd = share * tok * (s.q_heads + 2 * s.kv_heads + s.q_heads)  # q, k, v in; out back
    delta = s.rows * s.chunk * s.q_heads * 4
    bwd = share * (tok * 2 * (s.q_heads + 2 * s.kv_heads) + delta)  # q, k, v, dout in; dq, dk, dv back
    return fwd, bwd


def strategy_layer_time(impl: str, tiles: np.ndarray, s: Shape, hw: Hardware, remat: str,
                        mesh_sizes: dict, ulysses: int = 1, rounds_run: int = 0, rates=None,
                        layout: str = "striped") -> dict:
    """Seconds of one layer's attention with ``impl`` (ring | allgather | ulysses | usp),
    from the ring's ``tiles [rounds, devices]``. Adds the collective time and the links used.
    ``rounds_run``: the ring rounds (usp: across the groups) that run, when a sliding window
    stops the ring early (``parallel/window.py``; the later ones have no tile); 0: all."""
    n = s.ring
    u = n if impl == "ulysses" else (ulysses if impl == "usp" else 1)
    busiest = strategy_rounds(tiles, impl, u)
    if rounds_run and impl in ("ring", "usp"):
        busiest = busiest[:rounds_run]
    pair = s.block_q * s.block_kv * s.head_dim * s.q_heads * s.rows
    passes = 2 if remat in RECOMPUTES_ATTENTION else 1
    seq_bw = link_bandwidth(hw, axis_crosses_nodes(mesh_sizes, "sequence", hw))
    if impl == "allgather":
        kv, dkv = _kv_bytes(s)
        fwd_comm = (n - 1) * kv / seq_bw
        bwd_comm = (n - 1) * (kv + dkv) / seq_bw
        k = len(busiest)  # every chunk pair at its round type's rate
        fwd = (busiest * FWD_PAIR_FLOPS * pair / _flops_s(rates, hw, k, s.chunk, layout, False)
               ).sum() + fwd_comm
        bwd = (busiest * BWD_PAIR_FLOPS * pair / _flops_s(rates, hw, k, s.chunk, layout, True)
               ).sum() + bwd_comm
        return {"forward_s": float(fwd), "backward_s": float(bwd), "forward_passes": passes,
                "total_s": float(passes * fwd + bwd), "collective_s": float(passes * fwd_comm + bwd_comm),
                "links": "sequence axis, " + _link_name(seq_bw, hw), "crosses_nodes": seq_bw != hw.link_bytes_s}
    if impl == "ring":
        rounds = _rounds_time(busiest, s, hw, seq_bw, remat, rates=rates, layout=layout)
        return {**rounds, "collective_s": rounds["exposed_send_s"], "links": "ring " + _link_name(seq_bw, hw),
                "crosses_nodes": seq_bw != hw.link_bytes_s}
    a2a_cross = groups_cross_nodes(mesh_sizes, "sequence", u, hw)
    a2a_bw = link_bandwidth(hw, a2a_cross)
    f_bytes, b_bytes = _a2a_bytes(s, u)
    a2a_f, a2a_b = f_bytes / a2a_bw, b_bytes / a2a_bw
    ring_cross = n // u > 1 and axis_crosses_nodes(mesh_sizes, "sequence", hw)
    ring_bw = link_bandwidth(hw, ring_cross)
    rounds = _rounds_time(busiest, s, hw, ring_bw, remat, u, rates=rates, layout=layout)
    fwd, bwd = rounds["forward_s"] + a2a_f, rounds["backward_s"] + a2a_b
    links = f"all-to-all {_link_name(a2a_bw, hw)}"
    if n // u > 1:
        links += f", ring {_link_name(ring_bw, hw)}"
    return {**rounds, "forward_s": float(fwd), "backward_s": float(bwd),
            "total_s": float(passes * fwd + bwd),
            "collective_s": float(passes * a2a_f + a2a_b + rounds["exposed_send_s"]),
            "links": links, "crosses_nodes": bool(a2a_cross or ring_cross)}


def _link_name(bw: float, hw: Hardware) -> str:
    return f"{bw / 1e9:.0f} GB/s"


def groups_cross_nodes(mesh_sizes: dict, axis: str, group: int, hw: Hardware) -> bool:
    """Whether groups of ``group`` neighbouring devices along ``axis`` span nodes (the mesh
    laid out row-major over (data, fsdp, sequence, tensor), ``node_size`` consecutive devices
    a node)."""
    if not hw.node_size or group <= 1:
        return False
    order = ("data", "fsdp", "sequence", "tensor")
    ids = np.arange(int(np.prod([mesh_sizes[a] for a in order]))).reshape(
        [mesh_sizes[a] for a in order])
    along = np.moveaxis(ids, order.index(axis), -1)
    groups = along.reshape(*along.shape[:-1], -1, group).reshape(-1, group) // hw.node_size
    return bool((groups.min(axis=1) != groups.max(axis=1)).any())


def attention_buffers(impl: str, s: Shape, ulysses: int = 1) -> float:
    """Bytes of one layer's attention working set per device that a strategy adds beyond its
    inputs: the K/V it holds at once (and their fp32 gradients in the backward)."""
    kv, dkv = _kv_bytes(s, ulysses if impl == "usp" else (s.ring if impl == "ulysses" else 1))
    if impl == "allgather":
        return s.ring * (kv + dkv)  # every chunk's K/V, then every chunk's dK/dV
    if impl == "ulysses":
        return kv + dkv  # the whole row's K/V on Hkv/N heads: one chunk's worth
    return 2 * (kv + dkv)  # the block computed on and the one in flight


def valid_ulysses(config, mesh_sizes: dict) -> list[int]:
    """Ulysses degrees U that divide the sequence axis and both local head counts."""
    import math
    m, t, n = config.model, mesh_sizes["tensor"], mesh_sizes["sequence"]
    g = math.gcd(m.num_heads // t, m.num_kv_heads // t)
    return [u for u in range(1, n + 1) if n % u == 0 and g % u == 0]


def dense_time(config, num_devices: int, global_rows: int, hw: Hardware, remat: str,
               colls: list | None, mesh_sizes: dict, rates=None) -> dict:
    """Seconds of everything but attention: matmuls (at the peak, or at ``rates``'s matmul
    efficiency of it) vs the non-ring collectives."""
    m = config.model
    tokens = global_rows * config.data.seq_len
    per_token = 6 * matmul_params(m) + 2 * recomputed_matmul_params(config, remat)
    adapters = lora_counts(config)
    if adapters is not None:  # LoRA: a frozen weight's own gradient is never computed
        per_token += 6 * adapters["adapters"] - 2 * adapters["frozen_matmul"]
    efficiency = rates.matmul_efficiency if rates is not None else 1.0
    compute = per_token * tokens / num_devices / (hw.peak_flops * efficiency)
    comm, source = 0.0, "compiled HLO"
    if colls is not None:
        for c in colls:
            if c.kind in ("collective-permute", "all-to-all") and EXCHANGE_SCOPE not in c.op_name:
                continue  # the ring's and Ulysses' (attention's), modelled above; a mixture of
                # experts' all-to-alls (parallel/experts.py's named scope) are counted here
            bw = link_bandwidth(hw, coll.crosses_nodes(c, hw.node_size))
            comm += c.count * coll.link_traffic(c) / bw
    else:
        # Without a compiled program: FSDP gathers the bf16 weights for the forward and again
        # for the backward and reduce-scatters fp32 gradients, each (n-1)/n of the weights
        # (a mixture of experts: every expert's, not only the active ones).
        f = mesh_sizes["fsdp"]
        if f > 1:
            share = (f - 1) / f / mesh_sizes["tensor"]
            # (LoRA: no gradient to reduce-scatter for the frozen weights)
            grads = 4 if adapters is None else 0
            traffic = share * (2 * 2 + grads) * total_matmul_params(m)
            comm = traffic / link_bandwidth(hw, axis_crosses_nodes(mesh_sizes, "fsdp", hw))
        source = "analytic FSDP estimate"
    return {"compute_s": compute, "collectives_s": comm, "total_s": max(compute, comm),
            "collectives_source": source}


def axis_crosses_nodes(mesh_sizes: dict, axis: str, hw: Hardware) -> bool:
    """Whether the groups along one mesh axis span nodes, with the mesh laid out row-major over
    (data, fsdp, sequence, tensor) and each node holding ``node_size`` consecutive devices
    (what ``jax.make_mesh`` does: the inner axes stay on the fast links)."""
    if not hw.node_size or mesh_sizes[axis] == 1:
        return False
    order = ("data", "fsdp", "sequence", "tensor")
    ids = np.arange(int(np.prod([mesh_sizes[a] for a in order]))).reshape(
        [mesh_sizes[a] for a in order])
    groups = np.moveaxis(ids, order.index(axis), -1).reshape(-1, mesh_sizes[axis]) // hw.node_size
    return bool((groups.min(axis=1) != groups.max(axis=1)).any())


def attention_groups(m) -> list[tuple[str, int, int]]:
    """(kind, window, layers) per distinct attention cost of model config ``m``: layers that share
    a window do the same tiles and rounds (RoPE or NoPE costs the same), so each is timed once.
    ``kind`` is ``full`` or ``sliding (W=...)``; a model whose layers are alike has one group."""
    return [("full" if w == 0 else f"sliding (W={w})", w, n) for w, n in window_counts(m).items()]


def _mean_per_layer(values: list, layers: list) -> float | int:
    """The per-layer mean of ``values`` over the stack (an int when every layer is alike)."""
    total = sum(v * n for v, n in zip(values, layers))
    count = sum(layers)
    return total // count if total % count == 0 else total / count


def project(config, mesh_sizes: dict, global_rows: int, hw: Hardware, layouts, remat: str,
            colls: list | None = None, dtype_bytes: int = 2, rates=None) -> dict:
    """Per layout: projected step seconds, tokens/s and MFU bound, with the parts; with the
    kernel's measured ``rates`` a prediction rather than a bound. Attention is summed layer by
    layer: ``kinds`` has each kind of layer's rounds, tiles and seconds (one entry for a model
    whose layers are alike), and the layout's critical path and ``ring`` are per layer (the
    mean over the layers, and the costliest kind's ring)."""
    m = config.model
    num_devices = int(np.prod([mesh_sizes[a] for a in ("data", "fsdp", "sequence", "tensor")]))
    s = shape_of(config, mesh_sizes, global_rows, dtype_bytes)
    crosses = axis_crosses_nodes(mesh_sizes, "sequence", hw)
    ring_bw = link_bandwidth(hw, crosses)
    dense = dense_time(config, num_devices, global_rows, hw, remat, colls, mesh_sizes, rates)
    tokens = global_rows * config.data.seq_len
    model_flops = flops_per_token(m, config.data.seq_len) * tokens
    groups = attention_groups(m)
    out = {}
    for layout in layouts:
        stripe = config.attention.stripe if layout == "striped" else 1
        kinds = []
        for name, window, layers in groups:
            w = work(layout, config.data.seq_len, s.ring, s.block_q, stripe, block_kv=s.block_kv,
                     window=window)
            tiles = w.tiles[:w.hops]  # a window stops the contiguous ring after the rounds it reaches
            ring = ring_layer_time(tiles, s, hw, ring_bw, remat, rates, layout)
            kinds.append({"kind": name, "window": window, "layers": layers, "rounds": int(w.hops),
                          "critical_path_tiles": int(tiles.max(axis=1).sum()),
                          "tiles_per_round_max": int(tiles.max()), "tiles": int(tiles.sum()),
                          "balance": float(tiles.sum() / s.ring / max(tiles.max(axis=1).sum(), 1)),
                          "layer_s": ring["total_s"], "attention_s": layers * ring["total_s"],
                          "ring": ring})
        counts = [k["layers"] for k in kinds]
        attention = sum(k["attention_s"] for k in kinds)
        step = attention + dense["total_s"]
        critical = sum(k["critical_path_tiles"] * k["layers"] for k in kinds)
        out[layout] = {
            "projected_step_s": step,
            "tokens_per_s": tokens / step,
            "mfu_bound": model_flops / (num_devices * hw.peak_flops * step),
            "attention_s": attention,
            "dense_s": dense["total_s"],
            "critical_path_tiles": _mean_per_layer([k["critical_path_tiles"] for k in kinds], counts),
            "tiles_per_round_max": max(k["tiles_per_round_max"] for k in kinds),
            "balance": float(sum(k["tiles"] * k["layers"] for k in kinds) / s.ring / max(critical, 1)),
            "ring": max(kinds, key=lambda k: k["layer_s"])["ring"],
            "kinds": kinds,
        }
    return {"layouts": out, "dense": dense, "ring_crosses_nodes": crosses,
            "ring_bandwidth_bytes_s": ring_bw, "model_flops_per_step": model_flops}


def project_strategies(config, mesh_sizes: dict, global_rows: int, hw: Hardware, layouts, remat: str,
                       impls=IMPLS, colls: list | None = None,
                       dtype_bytes: int = 2, rates=None) -> dict:
    """Per (strategy, layout): projected step, MFU bound, attention and collective seconds,
    links and attention buffers; usp at every valid Ulysses degree 1 < U < N. ``fastest``
    names the best. Strategies whose heads do not split are listed under ``invalid``."""
    m = config.model
    num_devices = int(np.prod([mesh_sizes[a] for a in ("data", "fsdp", "sequence", "tensor")]))
    s = shape_of(config, mesh_sizes, global_rows, dtype_bytes)
    dense = dense_time(config, num_devices, global_rows, hw, remat, colls, mesh_sizes, rates)
    tokens = global_rows * config.data.seq_len
    model_flops = flops_per_token(m, config.data.seq_len) * tokens
    groups = attention_groups(m)
    degrees = valid_ulysses(config, mesh_sizes)
    candidates, invalid = [], []
    for impl in impls:
        if impl == "ulysses":
            (candidates if s.ring in degrees else invalid).append(("ulysses", s.ring))
        elif impl == "usp":
            us = [u for u in degrees if 1 < u < s.ring]
            candidates += [("usp", u) for u in us]
            if not us:
                invalid.append(("usp", 0))
        else:
            candidates.append((impl, 1))
    out = {}
    for layout in layouts:
        stripe = config.attention.stripe if layout == "striped" else 1
        tiles = {window: work(layout, config.data.seq_len, s.ring, s.block_q, stripe,
                              block_kv=s.block_kv, window=window).tiles
                 for _, window, _ in groups}
        for impl, u in candidates:
            name = f"usp(U={u})" if impl == "usp" else impl
            attention = collective = 0.0
            kinds = {}
            for kind, window, layers in groups:  # each kind of layer once, times its layers
                run = reach(window, layout, u * s.chunk, s.ring // u)
                t = strategy_layer_time(impl, tiles[window], s, hw, remat, mesh_sizes, u, run,
                                        rates, layout)
                attention += layers * t["total_s"]
                collective += layers * t["collective_s"]
                kinds[kind] = {"layers": layers, "layer_s": t["total_s"]}
            step = attention + dense["total_s"]
            out[f"{name} {layout}"] = {
                "impl": impl, "ulysses": u, "layout": layout, "projected_step_s": step,
                "tokens_per_s": tokens / step,
                "mfu_bound": model_flops / (num_devices * hw.peak_flops * step),
                "attention_s": attention, "collective_s": collective, "dense_s": dense["total_s"],
                "links": t["links"], "attention_buffers_bytes": attention_buffers(impl, s, u),
                "kinds": kinds}
    fastest = min(out, key=lambda k: out[k]["projected_step_s"]) if out else None
    return {"strategies": out, "fastest": fastest,
            "invalid": [f"{i}" + (f" (U={u})" if u else "") for i, u in invalid]}
