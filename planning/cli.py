"""Command line of scripts/plan.py: parse, simulate the mesh's devices, plan, print.

JAX reads the simulated device count once, when it starts, so the mesh is parsed and
XLA_FLAGS set before anything imports jax.
"""
from __future__ import annotations

import argparse
import math
import os
import pathlib
import re
import sys

from parallel.layouts import LAYOUTS  # numpy only
from parallel.strategies import IMPLS  # no jax
from planning.hardware import HARDWARE

AXES = ("data", "fsdp", "sequence", "tensor")  # parallel.mesh.AXES; that module imports jax


class UsageError(ValueError):
    """A command-line value that cannot be used; one line says what would be valid."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="scripts/plan.py",
        description="Plan a training run for a mesh this machine does not have: parameters, "
                    "FLOPs per token, per-device memory of the compiled step, its collectives, "
                    "and a projected step time per token layout.",
        epilog="Extra --config.a.b=value arguments override config fields, as in train.py.")
    p.add_argument("--config", required=True, help="config file, e.g. configs/llama_7b.py")
    p.add_argument("--mesh", required=True,
                   help="axis sizes, e.g. data=1,fsdp=8,sequence=8,tensor=1 (missing axes are 1; "
                        "one may be -1 with --devices)")
    p.add_argument("--devices", type=int, default=0, help="total devices when an axis is -1")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=1,
                   help="sequences per data x fsdp group (each ring's batch); the global batch "
                        "is this times data x fsdp")
    p.add_argument("--hardware", required=True, choices=list(HARDWARE))
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="comma list to project")
    p.add_argument("--remat", default=None,
                   help="none | attention | full | offload | offload_input, a comma list, all, "
                        "or auto (all, and which one model.remat=auto picks on --hardware; "
                        "default: the config's model.remat)")
    p.add_argument("--impls", default="ring,allgather,ulysses,usp",
                   help="context-parallel strategies to project beside each other (usp at every "
                        "Ulysses degree that divides the sequence axis and the heads); the "
                        "compiled program is the config's attention.impl")
    p.add_argument("--kernel-rates", default="",
                   help="predict instead of bound: time attention at the config kernel's measured "
                        "TFLOP/s per round type (h200, or a scripts/bench_kernels.py --json file) "
                        "and matmuls at --matmul-efficiency of the peak")
    p.add_argument("--matmul-efficiency", type=float, default=0.0,
                   help="with --kernel-rates: matmul FLOP/s as a fraction of the peak "
                        "(0: planning/kernel_rates.py's MATMUL_EFFICIENCY)")
    p.add_argument("--json", default="", help="also write the plan here as JSON")
    p.add_argument("--no-compile", action="store_true",
                   help="skip compiling: sizes, FLOPs and step time only (no memory)")
    return p.parse_known_args(argv)


def parse_mesh(text: str, devices: int = 0) -> dict[str, int]:
    sizes = {a: 1 for a in AXES}
    for part in filter(None, (x.strip() for x in text.split(","))):
        m = re.fullmatch(r"(\w+)=(-?\d+)", part)
        if not m or m.group(1) not in AXES:
            raise UsageError(f"--mesh {text!r}: expected axis=size pairs over {', '.join(AXES)}, "
                             f"e.g. data=1,fsdp=8,sequence=8,tensor=1")
        sizes[m.group(1)] = int(m.group(2))
    bad = [a for a, s in sizes.items() if s == 0 or s < -1]
    fill = [a for a, s in sizes.items() if s == -1]
    if bad:
        raise UsageError(f"--mesh: {bad[0]}={sizes[bad[0]]} is invalid; use a positive size")
    if fill:
        known = math.prod(s for s in sizes.values() if s > 0)
        if len(fill) > 1 or not devices or devices % known:
            raise UsageError(f"--mesh: -1 needs exactly one such axis and --devices divisible by "
                             f"the other axes' product ({known})")
        sizes[fill[0]] = devices // known
    elif devices and math.prod(sizes.values()) != devices:
        raise UsageError(f"--mesh has {math.prod(sizes.values())} devices but --devices={devices}")
    return sizes


def load_config(path: str, overrides: list[str]):
    """The config with ``--config.a.b=value`` overrides, as train.py takes them."""
    from configs.loading import load
    from errors import ConfigFileError
    pairs = []
    for arg in overrides:
        m = re.fullmatch(r"--config\.([\w.]+=.*)", arg, flags=re.S)
        if not m:
            raise UsageError(f"unrecognized argument {arg!r} (config overrides look like "
                             f"--config.model.remat=full)")
        pairs.append(m.group(1))
    try:
        return load(path, pairs)
    except ConfigFileError as e:  # name an override as it was typed: --config.a.b
        raise UsageError(("--" if str(e).startswith("config.") else "") + str(e)) from None


def simulate_devices(n: int) -> None:
    """Asks JAX (not yet imported) for ``n`` CPU devices: the planner compiles, never runs."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    os.environ["JAX_PLATFORMS"] = "cpu"


def main(argv=None) -> int:
    return run(argv)[0]


def run(argv=None) -> tuple[int, dict | None]:
    """Exit code and the plan (None after a user error, reported as one line on stderr)."""
    try:
        args, rest = parse_args(argv)
        mesh = parse_mesh(args.mesh, args.devices)
        layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
        bad = [x for x in layouts if x not in LAYOUTS]
        if bad or not layouts:
            raise UsageError(f"--layouts {args.layouts!r}: use a comma list of {', '.join(LAYOUTS)}")
        impls = [x.strip() for x in args.impls.split(",") if x.strip()]
        if not impls or [x for x in impls if x not in IMPLS]:
            raise UsageError(f"--impls {args.impls!r}: use a comma list of {', '.join(IMPLS)}")
        if args.seq_len < 1 or args.batch < 1:
            raise UsageError("--seq-len and --batch must be >= 1")
        if "jax" not in sys.modules:
            simulate_devices(math.prod(mesh.values()))
        config = load_config(args.config, rest)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2, None

    from planning.plan import PlanError, make_plan
    from planning.report import markdown, to_json
    from training.entry import user_errors
    try:
        plan = make_plan(config, mesh, args.seq_len, args.batch, args.hardware, layouts,
                         args.remat, compile_program=not args.no_compile, impls=impls,
                         kernel_rates=args.kernel_rates or None,
                         matmul_efficiency=args.matmul_efficiency or None)
    except (PlanError, *user_errors()) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2, None
    print(markdown(plan), end="")
    if args.json:
        pathlib.Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.json).write_text(to_json(plan))
    return 0, plan
