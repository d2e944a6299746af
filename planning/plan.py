"""A run plan: size, FLOPs, per-device memory of the compiled step, collectives, step time.

Everything here works on the devices JAX already has (simulated CPU devices for a mesh the
machine does not have; ``planning.cli`` sets their number before JAX starts).
"""
from __future__ import annotations

import math

from model.sharded import lora_counts
from model.decoder import REMAT as REMATS
from planning import collectives as coll
from planning import hardware as hwlib
from planning import step_time


class PlanError(ValueError):
    """A plan request that cannot be made; the message says what would be valid."""


def resolve_remats(arg: str | None, config_remat: str) -> list[str]:
    """``None``: the config's policy; ``all`` or ``auto`` (also the config's ``auto``): every
    policy; else a comma list."""
    if not arg:
        return list(REMATS) if config_remat == "auto" else [config_remat]
    if arg in ("all", "auto"):
        return list(REMATS)
    names = [r.strip() for r in arg.split(",") if r.strip()]
    bad = [r for r in names if r not in REMATS]
    if bad or not names:
        raise PlanError(f"--remat {arg!r}: use all or a comma list of {', '.join(REMATS)}")
    return names


def validate(config, mesh_sizes: dict, layouts) -> None:
    """Config checks of a run, plus every layout to be projected (zigzag needs 2N | L)."""
    from errors import ConfigError, LayoutError
    from parallel.layouts import check
    from configs.validate import validate as validate_config
    num_devices = math.prod(mesh_sizes.values())
    validate_config(config, num_devices)
    for layout in layouts:
        try:
            check(layout, config.data.seq_len, mesh_sizes["sequence"],
                  config.attention.stripe if layout == "striped" else 1)
        except LayoutError as e:
            raise ConfigError(f"--layouts: {e}") from None


def make_plan(config, mesh_sizes: dict, seq_len: int, rows_per_replica: int, hardware: str,
              layouts=("contiguous", "striped", "zigzag"), remat: str | None = None,
              compile_program: bool = True, devices=None, impls=None,
              kernel_rates: str | None = None, matmul_efficiency: float | None = None) -> dict:
    """The plan of ``config`` at ``seq_len`` with ``rows_per_replica`` sequences per
    data x fsdp group on ``mesh_sizes``, projected onto ``hardware``.

    Compiles one program per remat policy asked for (offload is estimated from the attention
    and full programs: XLA CPU has no host-offload passes). ``impls``: context-parallel
    strategies to project side by side (``plan["strategies"]``, ``plan["fastest"]``).
    ``kernel_rates`` (``planning/kernel_rates.py``: ``h200`` or a bench_kernels.py JSON): time
    the layouts' attention at the config's kernel's measured speed and the matmuls at
    ``matmul_efficiency`` of the peak: a prediction instead of a bound."""
    import jax

    from model import pattern
    from model.moe import experts_of as moe_experts
    from model.flops import (active_param_count, attention_flops_per_token, expert_dim,
                             experts, flops_per_token, matmul_params, param_count)
    from planning.program import compile_step, planned_config

    if hardware not in hwlib.HARDWARE:
        raise PlanError(f"unknown hardware {hardware!r}; choose one of {', '.join(hwlib.HARDWARE)}")
    hw = hwlib.HARDWARE[hardware]
    remats = resolve_remats(remat, config.model.remat)
    auto = remat == "auto" or (not remat and config.model.remat == "auto")
    primary = config.model.remat if config.model.remat in remats else remats[0]
    layouts = list(layouts)
    num_devices = math.prod(mesh_sizes.values())
    global_rows = rows_per_replica * mesh_sizes["data"] * mesh_sizes["fsdp"]
    base = planned_config(config, seq_len, global_rows, mesh_sizes, primary)
    validate(base, mesh_sizes, layouts)
    m = base.model
    dtype_bytes = 2 if m.dtype == "bfloat16" else 4

    plan = {
        "config": config.name, "hardware": hw.name, "hardware_note": hw.note,
        "mesh": dict(mesh_sizes), "num_devices": num_devices, "seq_len": seq_len,
        "global_batch": global_rows, "rows_per_replica": rows_per_replica,
        "tokens_per_step": global_rows * seq_len, "dtype": m.dtype, "param_dtype": m.param_dtype,
        "attention": {"impl": base.attention.impl, "block_q": base.attention.block_q,
                      "block_kv": base.attention.block_kv, "stripe": base.attention.stripe},
        "remat": primary,
        "microbatches": base.train.microbatches, "loss_chunk": base.train.loss_chunk,
        "mlp_chunk": base.model.mlp_chunk,
        "params": param_count(m),  # equal to the built decoder's count (tests/test_params.py)
        # a mixture of experts: the parameters a token's forward reads (its top k experts), what
        # the FLOPs and the MFU count; every expert is in "params" and in the compiled memory
        "active_params": active_param_count(m),
        "moe": ({"num_experts": experts(m)[1], "top_k": experts(m)[0], "expert_dim": expert_dim(m)}
                if moe_experts(m) else None),
        # LoRA (model/lora.py): adapter, trained (adapters + modules_to_save) and frozen counts;
        # the compiled memory holds optimizer state for the trained ones only
        "lora": lora_counts(base),
        "num_layers": m.num_layers,
        # each layer's attention (model.layer_types): the step time and FLOPs sum them
        "layer_pattern": pattern.describe(m),
        "layer_pattern_mixed": len(set(pattern.names(m))) > 1,
        "flops_per_token": {
            "model": flops_per_token(m, seq_len),
            "matmul": 6 * matmul_params(m),
            "attention": attention_flops_per_token(m, seq_len, causal=True),
            "attention_noncausal": attention_flops_per_token(m, seq_len, causal=False),
        },
        "hardware_memory_bytes": hw.memory_bytes,
        "usable_fraction": hwlib.USABLE_FRACTION,
        "notes": [],
    }
    colls_by_remat, programs = {}, {}  # per remat: the compiled program's collectives
    if not compile_program:
        plan["notes"].append("--no-compile: no memory figures; FSDP traffic estimated analytically")
        if m.get("moe") and m.moe.num_experts and m.moe.get("dispatch") == "all_to_all":
            # the estimate gathers each layer's experts; only the compiled step has the exchange
            plan["notes"].append("--no-compile: the experts' traffic is estimated as "
                                 "dispatch=gather's; compile to count the all-to-all's")
    else:
        devices = (jax.devices() if devices is None else devices)
        if len(devices) < num_devices:
            raise PlanError(f"the mesh needs {num_devices} devices but this process has {len(devices)}; "
                            f"run scripts/plan.py in a fresh process (it simulates them)")
        devices = devices[:num_devices]

        to_compile = [r for r in remats if r not in ESTIMATED]
        if "offload" in remats:
            to_compile += [r for r in ("attention", "full") if r not in to_compile]
        if "offload_input" in remats and "full" not in to_compile:
            to_compile.append("full")
        for r in to_compile:
            programs[r] = compile_step(planned_config(config, seq_len, global_rows, mesh_sizes, r), devices)

        memory, compile_times = {}, {}
        for r in to_compile:
            p = programs[r]
            compile_times[r] = {"lower_s": p.lower_s, "compile_s": p.compile_s}
            colls_by_remat[r] = coll.collectives(p.hlo_text, num_devices)
            memory[r] = {**p.memory.as_dict(), "estimated": False}
        if "offload" in remats:
            memory["offload"] = _offload_estimate(programs["attention"].memory, programs["full"].memory,
                                                  m.num_layers)
            colls_by_remat["offload"] = colls_by_remat["attention"]
            plan["notes"].append(
                "offload is estimated: XLA CPU compiles no host offload, so device memory is the full "
                "remat program plus one layer's saved matmul outputs, and host memory the attention "
                "program's extra temporaries")
        if "offload_input" in remats:
            memory["offload_input"] = _offload_input_estimate(
                programs["full"].memory, layer_input_bytes(base, mesh_sizes, global_rows, dtype_bytes),
                m.num_layers)
            colls_by_remat["offload_input"] = colls_by_remat["full"]
            plan["notes"].append(
                "offload_input is estimated: XLA CPU compiles no host offload, so device memory is "
                "the full remat program less the stacked layer inputs but one layer's, and host "
                "memory those inputs")
        usable = hw.memory_bytes * hwlib.USABLE_FRACTION
        for r in memory:
            memory[r]["fits"] = memory[r]["total"] <= usable
        plan["memory"] = {r: memory[r] for r in remats}
        if auto:
            primary, plan["remat_auto"] = _auto_pick(config, memory, usable, hw.name)
            plan["remat"] = primary
        replicated = _state_replicated_over(mesh_sizes)
        if replicated:
            mem = memory[to_compile[0]]
            plan["notes"].append(
                f"parameters and optimizer state are replicated over {' x '.join(replicated)} "
                f"(parallel/mesh.py RULES shard them over {', '.join(_state_axes()) or 'nothing'}): every "
                f"device holds {(mem['params'] + mem['optimizer']) / 2**30:.2f} GiB of them, plus "
                f"{mem['params'] / 2**30:.2f} GiB of fp32 gradients during the step")
        plan["memory_per_device_bytes"] = memory[primary]["total"]
        plan["fits"] = memory[primary]["fits"]
        plan["compile"] = compile_times

        plan["collectives"] = coll.summarize(colls_by_remat[primary])
    rates = None
    if kernel_rates:
        from planning import kernel_rates as kr
        kernel = planned_kernel(base.attention.kernel, hw.name)
        try:
            rates = kr.load(kernel_rates, kernel, matmul_efficiency or kr.MATMUL_EFFICIENCY)
        except ValueError as e:
            raise PlanError(str(e)) from None
        plan["kernel_rates"] = {"kernel": kernel, "source": rates.source,
                                "matmul_efficiency": rates.matmul_efficiency,
                                "caveat": rates.tile_caveat(base.attention.block_q,
                                                            base.attention.block_kv)}
    step_by_remat = {}
    for r in remats:  # the projection reads remat from its argument, not from the config
        proj = step_time.project(base, mesh_sizes, global_rows, hw, layouts, r,
                                 colls_by_remat.get(r), dtype_bytes, rates)
        step_by_remat[r] = {k: v["projected_step_s"] for k, v in proj["layouts"].items()}
        if r == primary:
            plan["layouts"] = proj["layouts"]
            plan["dense"] = proj["dense"]
            plan["ring_crosses_nodes"] = proj["ring_crosses_nodes"]
            plan["ring_bandwidth_bytes_s"] = proj["ring_bandwidth_bytes_s"]
    plan["step_time_by_remat"] = step_by_remat
    if impls:
        strat = step_time.project_strategies(base, mesh_sizes, global_rows, hw, layouts, primary, impls,
                                             colls_by_remat.get(primary), dtype_bytes, rates)
        if "memory" in plan:  # the compiled program is the config's impl: swap its buffers
            s = step_time.shape_of(base, mesh_sizes, global_rows, dtype_bytes)
            own = step_time.attention_buffers(base.attention.impl, s, base.attention.ulysses)
            for p in strat["strategies"].values():
                p["memory_bytes_est"] = plan["memory_per_device_bytes"] - own + p["attention_buffers_bytes"]
                p["fits_est"] = p["memory_bytes_est"] <= hw.memory_bytes * hwlib.USABLE_FRACTION
        plan.update(strat)
    plan["_programs"] = programs  # not serialised: lets callers run what was compiled
    return plan


def planned_kernel(kernel: str, hw_name: str) -> str:
    """The per-round kernel a run on that hardware uses: ``auto`` is the platform's fused kernel
    (cudnn needs its probe on the real GPU); ``cudnn`` is timed at bare cuDNN's rates where the
    table has no ring-API row."""
    tpu = hw_name.startswith(("tpu", "v5", "v6"))
    if kernel == "auto":
        return "pallas_tpu" if tpu else "pallas_gpu"
    return kernel


def _auto_pick(config, memory: dict, usable: float, hw_name: str) -> tuple[str, str]:
    """What ``model.remat=auto`` would pick on that hardware (training/remat.py's rule: the least
    recompute that fits ``train.memory_budget_gib``, else the usable device memory)."""
    from training.remat import GIB, ORDER
    gib = float(config.train.get("memory_budget_gib", 0) or 0)
    limit, source = (gib * GIB, f"train.memory_budget_gib={gib:g}") if gib > 0 else (
        usable, f"{usable / GIB:.0f} GiB usable of the {hw_name}")
    for r in ORDER:
        if memory[r]["total"] <= limit:
            return r, (f"remat auto picks {r}: the least recompute that fits {source} "
                       f"({memory[r]['total'] / GIB:.2f} GiB per device)")
    return "full", f"remat auto: no policy fits {source}; shown with full"


def _state_axes() -> list[str]:
    """Mesh axes that the sharding rules split parameters over."""
    from parallel.mesh import AXES, RULES
    used = set()
    for logical, axes in RULES.items():
        if logical in ("batch", "length") or axes is None:
            continue
        used.update(axes if isinstance(axes, tuple) else (axes,))
    return [a for a in AXES if a in used]


def _state_replicated_over(mesh_sizes: dict) -> list[str]:
    return [f"{a}={s}" for a, s in mesh_sizes.items() if s > 1 and a not in _state_axes()]


ESTIMATED = ("offload", "offload_input")  # remat policies the CPU cannot compile as such


def layer_input_bytes(config, mesh_sizes: dict, global_rows: int, dtype_bytes: int) -> int:
    """Per device, one layer's input [rows, tokens, d_model] of one microbatch: what the layer
    scan keeps per layer under full remat (activations are not split over tensor)."""
    rows = global_rows // (mesh_sizes["data"] * mesh_sizes["fsdp"]) // config.train.microbatches
    return rows * (config.data.seq_len // mesh_sizes["sequence"]) * config.model.d_model * dtype_bytes


def _offload_input_estimate(full, per_layer: int, num_layers: int) -> dict:
    """Device: the full program less the stacked inputs but the one being recomputed."""
    on_host = per_layer * max(num_layers - 1, 0)
    out = {**full.as_dict(), "estimated": True, "host_temporaries": per_layer * num_layers}
    out["temporaries"] = max(full.temporaries - on_host, 0)
    out["total"] = out["arguments"] + out["outputs"] - out["aliased"] + out["temporaries"]
    return out


def _offload_estimate(attention, full, num_layers: int) -> dict:
    saved = max(attention.temporaries - full.temporaries, 0)
    temps = full.temporaries + saved // max(num_layers, 1)
    out = {"arguments": full.arguments, "outputs": full.outputs, "aliased": full.aliased,
           "temporaries": temps, "host_temporaries": saved, "params": full.params,
           "optimizer": full.optimizer, "batch": full.batch, "estimated": True}
    out["total"] = out["arguments"] + out["outputs"] - out["aliased"] + temps
    return out
