"""Our train step against transformers + torch's on the same model, tokens and cores, in one run.

    python scripts/bench_step.py [--model tiny | --run RUN_DIR] [--seq-len 2048] [--steps 3]
        [--warmup 1] [--cores 2] [--sides ours,torch] [--json bench_out/bench_step.json]
        [--config.a.b=v ...]

The model: configs/tiny.py's (``--model tiny``) or a run directory's (``--run``: an import, e.g.
``make smollm2``'s runs/smollm2, or a train.py --workdir), random weights on both sides (time does
not depend on their values). Both sides take one row of ``--seq-len`` random token ids (the same
ids) and the next-token loss over it, fp32, AdamW, no activation checkpointing (model.remat=none,
transformers' default), on 1 device; the process is pinned to ``--cores`` cores before either
library starts (torch.set_num_threads too, and XLA's CPU client sizes its pool from them). The
torch side is transformers' model class for the config our exporter writes (hf/config.py), eager,
its default attention (SDPA). Each side: ``--warmup`` untimed steps, then ``--steps`` timed ones
(the median is the figure), with each step's CPU seconds and page faults; then one traced step
of ours, cut into training/profile.py's rows (scripts/profile_step.py's table), and the rows
with matmuls (matmuls, the loss's head) against the same matmuls timed alone, at the same
shapes, in the same run (``bare_matmuls``: dense models). Prints markdown tables and writes the
JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SIDES = ("ours", "torch")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    which = p.add_mutually_exclusive_group()
    which.add_argument("--model", choices=("tiny",), default="tiny")
    which.add_argument("--run", default="", help="a run directory: its model")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=3, help="timed steps per side (median)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per side first")
    p.add_argument("--cores", type=int, default=0, help="pin to this many cores (0: all)")
    p.add_argument("--sides", default="ours,torch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trace-dir", default="bench_out/bench_step_trace")
    p.add_argument("--json", default="bench_out/bench_step.json")
    return p.parse_known_args(argv)


def load(args, rest):
    """The config both sides build: the model's, on 1 device, one row of --seq-len, fp32, no
    remat; checked as train.py checks it (a UsageError or a user error: one line)."""
    from configs.validate import validate
    from planning.cli import load_config
    path = f"configs/from_run.py:{args.run}" if args.run else "configs/tiny.py"
    one = ["--config.mesh.data=1", "--config.mesh.fsdp=1", "--config.mesh.sequence=1",
           "--config.mesh.tensor=1", "--config.data.batch_size=1",
           f"--config.data.seq_len={args.seq_len}", "--config.model.remat=none",
           "--config.model.dtype=float32"]
    config = load_config(path, one + list(rest))
    validate(config, 1)
    return config


def bad_flags(args) -> str | None:
    """What is wrong with the flags, in one line, or None."""
    sides = [s for s in args.sides.split(",") if s]
    if not sides or any(s not in SIDES for s in sides):
        return f"--sides takes some of {','.join(SIDES)} (got {args.sides!r})"
    for flag, value, least in (("--steps", args.steps, 1), ("--warmup", args.warmup, 0),
                               ("--seq-len", args.seq_len, 2), ("--cores", args.cores, 0)):
        if value < least:
            return f"{flag} must be >= {least} (got {value})"
    if args.cores > len(os.sched_getaffinity(0)):
        return f"--cores {args.cores}: this process may use {len(os.sched_getaffinity(0))}"
    return None


def timed(step, warmup: int, steps: int) -> dict:
    """``--steps`` timed steps after ``warmup``: their wall times and, per step, the process's
    CPU seconds (user and system, every thread's) and page faults (minor: memory the kernel
    mapped afresh). Both sides keep both cores busy, so CPU seconds say how much work a step is;
    the system time is mostly its faults, whose cost on a virtual machine depends on what the
    host did with the memory since (docs/benchmarks.md)."""
    for _ in range(warmup):
        step()
    walls, user, system, faults = [], [], [], []
    for _ in range(steps):
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        step()
        walls.append(time.perf_counter() - t0)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        user.append(r1.ru_utime - r0.ru_utime)
        system.append(r1.ru_stime - r0.ru_stime)
        faults.append(r1.ru_minflt - r0.ru_minflt)
    return {"walls_s": walls, "median_s": statistics.median(walls),
            "user_s": statistics.median(user), "system_s": statistics.median(system),
            "faults": int(statistics.median(faults))}


def ours(config, ids, args) -> dict:
    import jax
    import numpy as np

    from parallel.mesh import make_mesh
    from training import profile
    from training.state import Trainer
    trainer = Trainer(config, make_mesh(config.mesh, jax.devices()[:1]))
    state = trainer.init(args.seed)
    labels = np.concatenate([ids[:, 1:], ids[:, -1:]], axis=1)
    mask = np.ones(ids.shape, np.float32)
    mask[:, -1] = 0  # as torch's shifted labels: L - 1 predicted tokens
    host = {"tokens": ids, "labels": labels, "segment_ids": np.zeros_like(ids), "loss_mask": mask,
            "positions": np.arange(ids.shape[1], dtype=np.int32)[None]}
    batch = {k: jax.device_put(host[k], s) for k, s in trainer.batch_shardings.items()}
    t0 = time.perf_counter()
    compiled = trainer.train_step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    holder = {"state": state}

    def step():
        holder["state"], metrics = jax.block_until_ready(compiled(holder["state"], batch))
        holder.setdefault("first_loss", float(metrics["loss"]))

    times = timed(step, args.warmup, args.steps)
    ops, comps = profile.parse_hlo(compiled.as_text())
    rows, traced, trace = profile.trace_steps(compiled, holder["state"], batch, 0, 1,
                                              args.trace_dir, ops, comps)
    return {**times, "compile_s": compile_s,
            "first_loss": holder["first_loss"], "rows_s": rows, "traced_s": traced[0],
            "flops": profile.row_flops(config, 1),
            "bare": bare_matmuls(config.model, ids.size),
            "trace": str(trace)}


def step_matmuls(m) -> dict[str, list[tuple[int, int, bool, int]]]:
    """The matmuls of one step as (in, out, transposed, count) per profile row: every layer's
    q, k, v, o and gate, up, down weights ``[in, out]`` under "matmuls" and the output head
    under "loss" (``transposed``: a tied table ``[vocab, d_model]``, read as the model reads it).
    Each is three dots a step: the forward, the input's gradient and the weight's (the profile's
    FLOPs; a loss in chunks, seq_len over train.loss_chunk, also recomputes the head's forward,
    which its row then holds and the bare one does not). {} for a mixture of experts (its
    experts' grouped matmuls have no bare counterpart here)."""
    from model.flops import head_dim
    if m.get("moe") is not None and m.moe.num_experts:
        return {}
    q, kv = m.num_heads * head_dim(m), m.num_kv_heads * head_dim(m)
    layer = [(m.d_model, q), (m.d_model, kv), (m.d_model, kv), (q, m.d_model),
             (m.d_model, m.ffn_dim), (m.d_model, m.ffn_dim), (m.ffn_dim, m.d_model)]
    shapes: dict = {}
    for i, o in layer:
        shapes[(i, o)] = shapes.get((i, o), 0) + m.num_layers
    tied = bool(m.get("tie_embeddings", False))
    return {"matmuls": [(i, o, False, n) for (i, o), n in shapes.items()],
            "loss": [(m.d_model, m.vocab_size, tied, 1)]}


# Each shape's inputs, one set ("hot": a layer's x and dy still in the cache from the layer
# before, as a matmul timed by itself has them) or four in turn ("cold": each layer its own, as
# in the step; four of SmolLM2's MLP inputs are 68 MB, this machine's L3 32 MB).
BARE_INPUTS = {"hot": 1, "cold": 4}


def bare_matmuls(m, tokens: int, repeats: int = 3) -> dict[str, dict]:
    """Per profile row, the step's matmuls alone (``step_matmuls``) over ``tokens`` rows: for
    each shape a jitted scan over that many random weights stacked, as the step's scan over its
    layers reads them, each iteration the three dots as the step's backward writes them
    (``x @ w``, ``dy @ w.T``, ``x.T @ dy``; the weight's gradient the scan's output, the other
    two its carry, the last of them returned: nothing dropped, no pass over them added), its
    inputs ``x`` and ``dy`` as ``BARE_INPUTS`` says; a shape used once, the three dots alone.
    Every input is on the device before the clock starts. The median of ``repeats`` after one.
    One program a shape, not a call a dot: a call allocates its outputs afresh, and on this
    virtual machine faulting them in costs as much as a dot at these sizes (docs/benchmarks.md).
    {row: {"hot"|"cold": {"s": seconds, "tflops": rate, "by_shape": {"INxOUT": seconds}}}}: the
    rate a row's matmuls run at with nothing else in the step."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    def dots(x, w, dy, transposed):
        wdim = 1 if transposed else 0  # the weight's contracted (input) axis
        y = jax.lax.dot_general(x, w, (((1,), (wdim,)), ((), ())))
        dx = jax.lax.dot_general(dy, w, (((1,), (1 - wdim,)), ((), ())))
        dw = (jax.lax.dot_general(dy, x, (((0,), (0,)), ((), ()))) if transposed
              else jax.lax.dot_general(x, dy, (((0,), (0,)), ((), ()))))
        return y, dx, dw

    def scan(xs, ws, dys, y_dx, transposed):
        def body(_, w_k):
            w, k = w_k
            y, dx, dw = dots(xs[k], w, dys[k], transposed)
            return (y, dx), dw
        return jax.lax.scan(body, y_dx, (ws, jnp.arange(len(ws)) % len(xs)))

    def seconds(i, o, transposed, count, inputs):
        put = lambda *shape: jax.device_put(rng.standard_normal(shape, np.float32))  # noqa: E731
        xs, dys = put(inputs, tokens, i), put(inputs, tokens, o)
        ws = put(count, o, i) if transposed else put(count, i, o)
        if count == 1:
            args, f = (xs[0], ws[0], dys[0], transposed), jax.jit(dots, static_argnums=3)
        else:
            y_dx = (jax.device_put(np.zeros((tokens, o), np.float32)),
                    jax.device_put(np.zeros((tokens, i), np.float32)))
            args, f = (xs, ws, dys, y_dx, transposed), jax.jit(scan, static_argnums=4)
        return timed(lambda: jax.block_until_ready(f(*args)), 1, repeats)["median_s"]

    rng = np.random.default_rng(0)
    out = {}
    for row, shapes in step_matmuls(m).items():
        flops = sum(6 * tokens * i * o * count for i, o, _, count in shapes)
        out[row] = {}
        for kind, inputs in BARE_INPUTS.items():
            by_shape = {}
            for i, o, transposed, count in shapes:
                by_shape[f"{i}x{o}"] = (
                    out[row]["hot"]["by_shape"][f"{i}x{o}"]  # one input either way: hot's program
                    if min(inputs, count) == 1 and kind != "hot"
                    else seconds(i, o, transposed, count, min(inputs, count)))
            total = sum(by_shape.values())
            out[row][kind] = {"s": total, "tflops": flops / total / 1e12, "by_shape": by_shape}
    return out


def theirs(config, ids, args) -> dict:
    import torch
    import transformers
    torch.set_num_threads(len(os.sched_getaffinity(0)))

    from hf import config as hf_config
    cfg = hf_config.hf_config(config.model, seq_len=args.seq_len, dtype="float32", base=None,
                              bos=None, eos=None)
    torch.manual_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**cfg), dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=config.train.lr)
    tokens = torch.from_numpy(ids.astype("int64"))
    holder = {}

    def step():
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        holder.setdefault("first_loss", float(loss.detach()))

    times = timed(step, args.warmup, args.steps)
    return {**times, "first_loss": holder["first_loss"],
            "library": f"transformers {transformers.__version__} + torch {torch.__version__}",
            "attention": model.config._attn_implementation, "threads": torch.get_num_threads()}


def table(out: dict) -> str:
    tokens = out["seq_len"]
    lines = ["| side | step (median) | tokens/s | vs torch | CPU s a step (user + system) "
             "| page faults a step |", "|---|---:|---:|---:|---:|---:|"]
    t = out.get("torch")
    names = {"torch": f"{t['library']} eager, {t['attention']}" if t else "",
             "ours": "ours (jitted train step, remat none)"}
    for side in SIDES:
        r = out.get(side)
        if r:
            vs = f"{r['median_s'] / t['median_s']:.2f}x" if t else ""
            lines.append(f"| {names[side]} | {r['median_s']:.3g} s | {tokens / r['median_s']:.0f} "
                         f"| {vs} | {r['user_s']:.1f} + {r['system_s']:.1f} | {r['faults']:,} |")
    return "\n".join(lines)


def bare_table(o: dict) -> str:
    """Each row with matmuls against the same matmuls alone (``bare_matmuls``)."""
    lines = ["| part of the step | in the step | its matmuls alone, inputs in the cache "
             "(hot) | alone, each layer its own inputs (cold) | in the step / hot, / cold |",
             "|---|---:|---:|---:|---:|"]
    for row, bare in o["bare"].items():
        rate = o["flops"][row] / o["rows_s"][row] / 1e12 if o["rows_s"][row] > 0 else 0.0
        hot, cold = bare["hot"], bare["cold"]
        lines.append(f"| {row} | {o['rows_s'][row]:.3g} s, {rate:.3g} TFLOP/s | {hot['s']:.3g} s, "
                     f"{hot['tflops']:.3g} TFLOP/s | {cold['s']:.3g} s, {cold['tflops']:.3g} "
                     f"TFLOP/s | {rate / hot['tflops']:.0%}, {rate / cold['tflops']:.0%} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args, rest = parse_args(argv)
    problem = bad_flags(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    sides = [s for s in args.sides.split(",") if s]
    if args.cores:  # before torch or XLA size their thread pools
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:args.cores])
    # This CPU on both sides (a GPU host's JAX would take its GPU), one device.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    from planning.cli import UsageError
    from training.entry import user_errors
    try:
        config = load(args, rest)
    except (UsageError, *user_errors()) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import numpy as np

    from training import profile
    ids = np.random.default_rng(args.seed).integers(
        0, config.model.vocab_size, (1, args.seq_len)).astype(np.int32)
    out = {"model": args.run or args.model, "seq_len": args.seq_len,
           "cores": len(os.sched_getaffinity(0)), "steps": args.steps, "warmup": args.warmup}
    # Ours first, then torch, each side's steps together: torch's threads stay idle while XLA
    # compiles and runs, and neither side's steps follow the other's. Alternated one step each
    # (SmolLM2, 2026-12-07), ours after a torch step took 51-60 s against 28-35 after its own:
    # the same 1.3M page faults, 60 s of system time instead of 4-12 on this virtual machine.
    for side in SIDES:
        if side in sides:
            print(f"{side}: {args.warmup} + {args.steps} steps ...", file=sys.stderr, flush=True)
            out[side] = (ours if side == "ours" else theirs)(config, ids, args)
    print(f"{out['model']}: one row of {args.seq_len} tokens, fp32, AdamW, {out['cores']} cores; "
          f"median of {args.steps} steps after {args.warmup}")
    print(table(out))
    if "ours" in out:
        o = out["ours"]
        print(f"\nours, one traced step (training/profile.py's rows; {o['trace']}):")
        print(profile.table(o["rows_s"], o["traced_s"], o["flops"]))
        if o["bare"]:
            print("\n" + bare_table(o))
    if args.json:
        path = pathlib.Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
