"""Ring (contiguous) vs striped vs zigzag on real training steps: the paper's experiment; and
context-parallel implementations against each other (--impls ring,allgather,ulysses,usp).

    python scripts/compare_layouts.py --config configs/tiny.py --layouts contiguous,striped,zigzag \
        --seq-lens 8192,16384,32768 --processes 2 --steps 20 --out runs/compare
    python scripts/compare_layouts.py --impls ring,allgather,ulysses --layouts contiguous,zigzag ...

Same model, same initial weights, same data (the pipeline permutes the same rows per layout);
compile and warm-up steps excluded; layouts interleaved in rounds so machine drift hits all
alike. Every (implementation, layout) pair is one run; speedups are against the ring with the
contiguous layout (or the first pair when that is not run). Writes OUT/results.json,
OUT/results.md and OUT/throughput.png.
Attention is causal over whole packed rows by default, as in the paper; --document-mask on keeps
it within each packed document, where the work of a step depends on its document boundaries
(the "tile model" column then shows what that batch's schedule allows each layout to gain).
--window W gives the model a sliding window (model.sliding_window): the contiguous ring then
stops after the hops the window reaches, striped and zigzag keep all N (docs/layouts.md). With
model.layer_types (Gemma 3's 5 sliding : 1 full) W is the sliding layers' window and the full
layers keep the whole row; the tile model and the FLOP share sum each layer's own.
--processes P runs one process per CPU core over gloo (a round waits for the busiest device, as
on a GPU ring); --processes 1 --devices N simulates N devices in one process (total-work view);
on a GPU/TPU host use --processes 1 and the real devices.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/tiny.py")
    p.add_argument("--layouts", default="contiguous,striped,zigzag")
    p.add_argument("--impls", default="ring",
                   help="comma list of attention.impl values: ring, allgather, ulysses, usp")
    p.add_argument("--ulysses", type=int, default=2, help="usp: Ulysses degree (attention.ulysses)")
    p.add_argument("--seq-lens", default="8192,16384")
    p.add_argument("--processes", type=int, default=2, help="one process per CPU core (gloo)")
    p.add_argument("--devices", type=int, default=0,
                   help="simulated devices with --processes 1 (0: all visible devices)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per layout")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per layout (compile)")
    p.add_argument("--batch", type=int, default=1, help="rows per step")
    p.add_argument("--block", type=int, default=0,
                   help="attention tile length (0: the largest divisor of the chunk up to 128)")
    p.add_argument("--document-mask", choices=("off", "on"), default="off",
                   help="off (the paper's setup): causal over whole packed rows, so every step "
                        "costs the same; on: attention stays within each packed document, and "
                        "the work of a step depends on where its documents start")
    p.add_argument("--window", type=int, default=0,
                   help="sliding window W (model.sliding_window: every layer's, or the sliding "
                        "layers' with model.layer_types; 0: the config's)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="config override, e.g. --set model.num_layers=4 (repeatable)")
    p.add_argument("--out", default="runs/compare")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--coordinator", help=argparse.SUPPRESS)
    p.add_argument("--num_processes", type=int, help=argparse.SUPPRESS)
    p.add_argument("--process_id", type=int, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def tile(chunk: int, block: int) -> int:
    if block:
        return block
    # 128 was fastest on XLA CPU (scripts/bench_attention.py: ahead of 64 and 256), and at 16k
    # tokens over 2 devices it gives 64 tiles per chunk, a tile-grid cap close to the ideal.
    return max(d for d in range(1, min(128, chunk) + 1) if chunk % d == 0)


def layout_config(base, layout: str, seq_len: int, devices: int, args, impl: str = "ring"):
    c = base.copy_and_resolve_references()
    c.attention.update(impl=impl, layout=layout, document_mask=args.document_mask == "on",
                       ulysses=args.ulysses)
    c.attention.block_q = c.attention.block_kv = tile(seq_len // devices, args.block)
    c.mesh.update(data=1, fsdp=1, sequence=devices, tensor=1)
    # Batches are fetched outside the timed region; a prefetch thread would only steal the
    # pinned core from the step being timed (seen: it made the layouts' medians erratic).
    c.data.update(seq_len=seq_len, batch_size=args.batch, heldout_fraction=0.01, prefetch=0)
    c.train.update(steps=args.warmup + args.steps, warmup_steps=0)
    return c


def tile_critical_path(run: dict, layout: str, row: int, args, devices: int, impl: str = "ring"):
    """The step's attention time in tile units (parallel/schedule.py), per layer (the mean over
    the layers, each with its own window: ``run["windows"]``, window -> layers): for the ring,
    per round the busiest device's tile pairs (each strategy waits differently:
    ``strategy_critical_path``), from the batch's own document boundaries when masked."""
    from parallel.schedule import work
    seq_len = run["pipe"].seq_len
    seg = run["pipe"].host_batch(row, natural=True)["segment_ids"] if args.document_mask == "on" \
        else None
    total = 0.0
    for window, layers in run["windows"].items():
        w = work(layout, seq_len, devices, run["block"], segment_ids=seg, window=window)
        total += layers * (w.critical_path if impl == "ring"
                           else w.strategy_critical_path(impl, args.ulysses))
    return total / sum(run["windows"].values())


def paired_speedup(ref: list, times: list) -> float:
    """Round r fed every layout the same batch: the median of the per-round ratios is robust
    to batches of different cost (with the document mask on, the work depends on the batch)."""
    return statistics.median(a / b for a, b in zip(ref, times))


def measure(args) -> list[dict]:
    """Runs in every process; returns rows (process 0's timings)."""
    import jax
    import numpy as np

    from configs.loading import load
    from data.pipeline import make_pipeline
    from model.flops import attention_flops_per_token, flops_per_token, window_counts
    from model.pattern import describe
    from parallel.mesh import make_mesh
    from training.state import Trainer
    from configs.validate import validate

    base = load(args.config, args.set)
    if args.window:  # the model's own window from here on: every run and the FLOP count read it
        base.model.sliding_window = args.window
    devices = jax.device_count()
    layouts = [x for x in args.layouts.split(",") if x]
    impls = [x for x in args.impls.split(",") if x]
    keys = [(impl, layout) for impl in impls for layout in layouts]
    rows = []
    for seq_len in [int(x) for x in args.seq_lens.split(",") if x]:
        runs = {}
        for impl, layout in keys:
            c = layout_config(base, layout, seq_len, devices, args, impl)
            validate(c, devices)
            mesh = make_mesh(c.mesh)
            pipe, trainer = make_pipeline(c, mesh), Trainer(c, mesh)
            runs[impl, layout] = {"pipe": pipe, "trainer": trainer, "state": trainer.init(c.train.seed),
                                  "block": c.attention.block_q, "times": [], "losses": [], "tiles": [],
                                  "window": int(c.model.get("sliding_window", 0)),
                                  "windows": window_counts(c.model), "pattern": describe(c.model)}
        for r in range(args.warmup + args.steps):
            order = keys[r % len(keys):] + keys[:r % len(keys)]
            for impl, layout in order:
                run = runs[impl, layout]
                it = run["pipe"].train.state()
                row = it["epoch"] * it["rows_per_epoch"] + it["row"]  # the batch's first row
                batch = next(run["pipe"].train)
                t0 = time.perf_counter()
                run["state"], metrics = run["trainer"].train_step(run["state"], batch)
                loss = float(jax.device_get(metrics["loss"]))
                if r >= args.warmup:
                    run["times"].append(time.perf_counter() - t0)
                    run["tiles"].append(tile_critical_path(run, layout, row, args, devices, impl))
                run["losses"].append(loss)
        m = base.model
        share = attention_flops_per_token(m, seq_len) / flops_per_token(m, seq_len)
        ref = runs[("ring", "contiguous") if ("ring", "contiguous") in runs else keys[0]]
        for impl, layout in keys:
            run = runs[impl, layout]
            run["pipe"].close()
            med = statistics.median(run["times"])
            rows.append({"layout": layout, "impl": impl, "seq_len": seq_len,
                         "processes": jax.process_count(),
                         "devices": devices, "block": run["block"], "window": run["window"],
                         "layer_pattern": run["pattern"],
                         "median_step_s": med, "tokens_per_s": args.batch * seq_len / med,
                         "speedup_vs_contiguous": paired_speedup(ref["times"], run["times"]),
                         "tile_model_speedup": paired_speedup(ref["tiles"], run["tiles"]),
                         "tile_critical_paths": run["tiles"], "step_times_s": run["times"],
                         "document_mask": args.document_mask == "on", "attention_flop_share": share,
                         "final_loss": run["losses"][-1], "losses": run["losses"]})
        losses = np.array([runs[key]["losses"][-1] for key in keys])
        if jax.process_index() == 0:
            print(f"seq_len {seq_len}: medians " + ", ".join(
                f"{_label(r)} {r['median_step_s']:.3f}s" for r in rows[-len(keys):])
                + f"; final losses agree to {np.ptp(losses) / np.abs(losses).max():.1e} (relative)",
                flush=True)
    return rows


def _label(r: dict) -> str:
    return r["layout"] if r.get("impl", "ring") == "ring" else f"{r['impl']} {r['layout']}"


def write_report(rows: list[dict], out: pathlib.Path, devices: int):
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    lines = ["| seq_len | layout | impl | median step (s) | tokens/s | speedup vs contiguous | "
             "tile model | attention FLOP share | final loss |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['seq_len']} | {r['layout']} | {r['impl']} | {r['median_step_s']:.3f} | "
                     f"{r['tokens_per_s']:.0f} | {r['speedup_vs_contiguous']:.2f}x | "
                     f"{r['tile_model_speedup']:.2f}x | "
                     f"{100 * r['attention_flop_share']:.0f}% | {r['final_loss']:.4f} |")
    ideal = 2 * devices / (devices + 1)
    mask = "within each packed document" if rows[0]["document_mask"] else "causal over whole rows"
    if rows[0].get("window"):
        pattern = rows[0].get("layer_pattern", "")
        mask += (f", layers {pattern}" if ":" in pattern
                 else f", sliding window {rows[0]['window']}")
    lines.append(f"\n{rows[0]['processes']} process(es), {devices} devices on the sequence axis, attention "
                 f"{mask}; speedup = median over steps of the ring with the contiguous layout's "
                 f"time / this row's (the first row's when that ring is not run) "
                 f"on the same batch; tile model = the same ratio of attention critical paths "
                 f"in tiles (parallel/schedule.py), what attention alone would gain; "
                 f"ideal causal speedup 2N/(N+1) = {ideal:.2f}x, with tiles skipped inside the "
                 f"diagonal block (2N-1)/N = {(2 * devices - 1) / devices:.2f}x.")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    seq_lens = sorted({r["seq_len"] for r in rows})
    for label in dict.fromkeys(_label(r) for r in rows):
        pts = sorted((r["seq_len"], r["speedup_vs_contiguous"]) for r in rows if _label(r) == label)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.axhline(ideal, linestyle="--", color="gray", label=f"ideal 2N/(N+1) = {ideal:.2f}")
    # With tiles skipped inside the diagonal block the limit is (2N-1)/N (parallel/schedule.py).
    limit = (2 * devices - 1) / devices
    ax.axhline(limit, linestyle=":", color="gray", label=f"tile limit (2N-1)/N = {limit:.2f}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(seq_lens, [str(s) for s in seq_lens])
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("training throughput vs ring, contiguous")
    impls = sorted({r.get("impl", "ring") for r in rows})
    ax.set_title(f"{'Ring attention layouts' if impls == ['ring'] else ', '.join(impls)}, {devices} devices")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=120)
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    from configs.loading import load
    from errors import ConfigFileError
    try:
        load(args.config, args.set)  # a missing file or field: one line before any process starts
    except ConfigFileError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if args.processes > 1 and not args.worker:
        from parallel.distributed import spawn_local
        argv = [os.path.abspath(__file__), *(argv if argv is not None else sys.argv[1:]), "--worker"]
        sys.exit(spawn_local(argv, args.processes, quiet_followers=True))
    from parallel.distributed import initialize, simulate_cpu_devices
    if args.processes == 1 and args.devices:
        simulate_cpu_devices(args.devices)
    from parallel.cluster import place_or_exit
    initialize(place_or_exit(args.coordinator, args.num_processes, args.process_id))
    import jax
    rows = measure(args)
    if jax.process_index() == 0:
        print(write_report(rows, pathlib.Path(args.out), jax.device_count()))
        print(f"wrote {args.out}/results.json, results.md, throughput.png")


if __name__ == "__main__":
    main()
