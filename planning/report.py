"""A plan as Markdown tables, and as JSON for scripts."""
from __future__ import annotations

import json

from planning.collectives import KINDS

GB = 1e9
GiB = 1 << 30


def _gib(b) -> str:
    if abs(b) >= GiB / 10 or b == 0:
        return f"{b / GiB:.2f} GiB"
    return f"{b / (1 << 20):.1f} MiB"


def _bytes(b) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= size:
            return f"{b / size:.2f} {unit}"
    return f"{b:.0f} B"


def _si(x) -> str:
    for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if float(f"{abs(x) / size:.3g}") >= 1:  # 999.9M rounds to 1G, not "1e+03M"
            return f"{x / size:.3g}{unit}"
    return f"{x:.3g}"


def _tiles(n) -> str:
    """A tile count, or a per-layer mean over layers of different kinds."""
    return f"{int(n):,}" if float(n).is_integer() else f"{n:,.1f}"


def _seconds(s) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    return f"{s * 1e3:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.3g} us"


def markdown(plan: dict) -> str:
    mesh = " ".join(f"{k}={v}" for k, v in plan["mesh"].items())
    a = plan["attention"]
    moe = plan.get("moe")
    lines = [
        f"## Plan: {plan['config']} on {plan['num_devices']} x {plan['hardware']} ({mesh})",
        "",
        f"seq_len {plan['seq_len']:,}, global batch {plan['global_batch']} "
        f"({plan['rows_per_replica']} per data x fsdp group), {plan['tokens_per_step']:,} tokens "
        f"per step; compute {plan['dtype']}, params {plan['param_dtype']}; attention "
        f"{a['impl']} {a['block_q']}x{a['block_kv']} tiles; {plan.get('microbatches', 1)} "
        f"microbatch(es) per step; loss over chunks of {plan.get('loss_chunk', 0) or 'all'} and "
        f"MLP over chunks of {plan.get('mlp_chunk', 0) or 'all'} tokens per device; hardware: "
        f"{plan['hardware_note']}.",
        "",
        "| quantity | value |",
        "|---|---|",
        f"| parameters{', every expert' if moe else ''} | {plan['params']:,} ({_si(plan['params'])}) |",
        *([f"| parameters a token reads ({moe['top_k']} of {moe['num_experts']} experts of "
           f"{moe['expert_dim']:,}) | {plan['active_params']:,} ({_si(plan['active_params'])}) |"]
          if moe else []),
        *([f"| LoRA rank {lo['rank']} on {', '.join(lo['targets'])}: trained (adapters "
           f"{lo['adapters']:,} + modules_to_save) / frozen | {lo['trained']:,} "
           f"({_si(lo['trained'])}) / {lo['frozen']:,} ({_si(lo['frozen'])}) |"]
          if (lo := plan.get("lora")) else []),
        *([f"| layers | {plan['num_layers']}: {plan['layer_pattern']} |"]
          if plan.get("layer_pattern_mixed") else []),
        f"| FLOPs/token, model (6N + causal attention) | {_si(plan['flops_per_token']['model'])} |",
        f"| FLOPs/token, matmuls 6N{' (N: router and the top k experts, not all)' if moe else ''} "
        f"| {_si(plan['flops_per_token']['matmul'])} |",
        f"| FLOPs/token, attention with the causal half (without) | "
        f"{_si(plan['flops_per_token']['attention'])} "
        f"({_si(plan['flops_per_token']['attention_noncausal'])}) |",
    ]
    if "memory" in plan:
        hw_mem = plan["hardware_memory_bytes"]
        lines += ["", f"### Memory per device (compiled step; fits = total <= "
                      f"{plan['usable_fraction']:.0%} of {_gib(hw_mem)})", "",
                  "| remat | arguments (params + optimizer + batch) | temporaries "
                  "| outputs not aliased | total | of device | fits |",
                  "|---|---|---|---|---|---|---|"]
        for r, mem in plan["memory"].items():
            tag = " (est.)" if mem.get("estimated") else ""
            host = f" (+{_gib(mem['host_temporaries'])} host)" if mem.get("host_temporaries") else ""
            lines.append(
                f"| {r}{tag}{' *' if r == plan['remat'] else ''} | {_gib(mem['arguments'])} "
                f"({_gib(mem['params'])} + {_gib(mem['optimizer'])} + {_gib(mem['batch'])}) | "
                f"{_gib(mem['temporaries'])}{host} | {_gib(mem['outputs'] - mem['aliased'])} | "
                f"{_gib(mem['total'])} | {mem['total'] / hw_mem:.0%} | "
                f"{'yes' if mem['fits'] else 'NO'} |")
        if plan.get("remat_auto"):
            lines += ["", plan["remat_auto"] + " (* marks it)."]
        comp = plan.get("compile", {})
        if comp:
            lines += ["", "Compiled on simulated CPU devices: " + ", ".join(
                f"{r} {c['lower_s']:.1f} s lower + {c['compile_s']:.1f} s compile"
                for r, c in comp.items()) + "."]
    if "collectives" in plan:
        lines += ["", f"### Collectives per step, per device (remat {plan['remat']}; loops counted "
                      "by trip count)", "",
                  "| kind | HLO ops | executions | bytes (accelerator dtype) | bytes as compiled on CPU |",
                  "|---|---|---|---|---|"]
        for k in KINDS:
            c = plan["collectives"][k]
            lines.append(f"| {k} | {c['instructions']} | {c['count']:,} | {_bytes(c['bytes'])} | "
                         f"{_bytes(c['cpu_bytes'])} |")
    kr = plan.get("kernel_rates")
    how = (f"predicted: {kr['kernel']} at its measured TFLOP/s per round type ({kr['source']}), "
           f"matmuls at {kr['matmul_efficiency']:.0%} of peak" if kr else
           "lower bound: peak FLOP/s")
    lines += ["", f"### Projected step ({how}, link bandwidth; remat {plan['remat']})", "",
              "| layout | critical path (tiles) | balance | attention | rest of step | step time "
              f"| tokens/s | {'MFU' if kr else 'MFU bound'} |",
              "|---|---|---|---|---|---|---|---|"]
    mixed = any(len(p.get("kinds", ())) > 1 for p in plan["layouts"].values())
    for layout, p in plan["layouts"].items():
        lines.append(f"| {layout} | {_tiles(p['critical_path_tiles'])}"
                     f"{' per layer (mean)' if mixed else ''} | {p['balance']:.2f} | "
                     f"{_seconds(p['attention_s'])} | {_seconds(p['dense_s'])} | "
                     f"{_seconds(p['projected_step_s'])} | {_si(p['tokens_per_s'])} | "
                     f"{p['mfu_bound']:.1%} |")
    if mixed:
        lines += ["", f"### Attention per kind of layer ({plan.get('layer_pattern', 'mixed')}; "
                      "a contiguous ring stops after the rounds a window reaches)", "",
                  "| layout | layers | kind | ring rounds run | critical path (tiles) | balance "
                  "| per layer | all its layers | of the step |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for layout, p in plan["layouts"].items():
            for k in p["kinds"]:
                lines.append(f"| {layout} | {k['layers']} | {k['kind']} | {k['rounds']} | "
                             f"{k['critical_path_tiles']:,} | {k['balance']:.2f} | "
                             f"{_seconds(k['layer_s'])} | {_seconds(k['attention_s'])} | "
                             f"{k['attention_s'] / p['projected_step_s']:.0%} |")
    if kr and kr.get("caveat"):
        lines += ["", f"Not a prediction of the attention: {kr['caveat']}."]
    if "ring_bandwidth_bytes_s" in plan:
        first = next(iter(plan["layouts"].values()))["ring"]
        lines += ["", f"Ring links: {plan['ring_bandwidth_bytes_s'] / GB:.0f} GB/s one way"
                      f"{' (the ring crosses nodes)' if plan['ring_crosses_nodes'] else ''}; "
                      f"per forward round at most {_seconds(first['round_compute_s'])} of tiles "
                      f"vs {_seconds(first['round_send_s'])} to send K/V. Rest of step: "
                      f"{_seconds(plan['dense']['compute_s'])} of matmuls vs "
                      f"{_seconds(plan['dense']['collectives_s'])} of other collectives "
                      f"({plan['dense']['collectives_source']})."]
    if len(plan.get("step_time_by_remat", {})) > 1:
        lays = list(plan["layouts"])
        lines += ["", "| remat | " + " | ".join(f"step, {x}" for x in lays) + " |",
                  "|---|" + "---|" * len(lays)]
        for r, by in plan["step_time_by_remat"].items():
            lines.append(f"| {r} | " + " | ".join(_seconds(by[x]) for x in lays) + " |")
    if plan.get("strategies"):
        mem = "memory (est.) | fits | " if "memory" in plan else ""
        lines += ["", f"### Context-parallel strategies (attention.impl; remat {plan['remat']})", "",
                  f"| strategy | layout | attention | of which collectives not hidden | links | "
                  f"K/V buffers per layer | {mem}step time | tokens/s | MFU bound |",
                  "|---|---|---|---|---|---|" + "---|" * (5 if mem else 3)]
        for name, p in sorted(plan["strategies"].items(), key=lambda kv: kv[1]["projected_step_s"]):
            name = name[:-len(p["layout"])].strip()
            m = (f"{_gib(p['memory_bytes_est'])} | {'yes' if p['fits_est'] else 'NO'} | "
                 if "memory_bytes_est" in p else "")
            lines.append(f"| {name}{' **fastest**' if name + ' ' + p['layout'] == plan['fastest'] else ''} "
                         f"| {p['layout']} | {_seconds(p['attention_s'])} | {_seconds(p['collective_s'])} | "
                         f"{p['links']} | {_gib(p['attention_buffers_bytes'])} | {m}"
                         f"{_seconds(p['projected_step_s'])} | {_si(p['tokens_per_s'])} | "
                         f"{p['mfu_bound']:.1%} |")
        lines += ["", f"Fastest: {plan['fastest']}." + (
            f" Not possible here: {', '.join(plan['invalid'])} (heads do not split that way)."
            if plan["invalid"] else "") + (" Memory (est.) is the compiled step's total with the "
            "config's attention buffers swapped for the strategy's." if mem else "")]
    for note in plan.get("notes", []):
        lines += ["", f"Note: {note}."]
    return "\n".join(lines) + "\n"


def to_json(plan: dict) -> str:
    return json.dumps({k: v for k, v in plan.items() if not k.startswith("_")}, indent=2,
                      default=float) + "\n"


def sweep_table(plans: list[dict], hardware_memory: dict[str, int], usable: float) -> str:
    """One row per plan: memory per device and whether it fits on each named memory size."""
    names = list(hardware_memory)
    head = ("| model | seq_len | devices | mesh | memory / device | "
            + " | ".join(f"fits {n}" for n in names)
            + " | step, striped (contiguous) | MFU bound, striped | compile |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for p in plans:
        mesh = ",".join(f"{k}={v}" for k, v in p["mesh"].items() if v != 1) or "1 device"
        fits = " | ".join("yes" if p["memory_per_device_bytes"] <= usable * b else "no"
                          for b in hardware_memory.values())
        s, c = p["layouts"]["striped"], p["layouts"]["contiguous"]
        comp = sum(x["compile_s"] + x["lower_s"] for x in p["compile"].values())
        lines.append(f"| {p['config']} | {p['seq_len']:,} | {p['num_devices']} | {mesh} | "
                     f"{_gib(p['memory_per_device_bytes'])} | {fits} | "
                     f"{_seconds(s['projected_step_s'])} ({_seconds(c['projected_step_s'])}) | "
                     f"{s['mfu_bound']:.0%} | {comp:.0f} s |")
    return "\n".join(lines) + "\n"
