"""Where the test suite's time goes: CPU seconds per test file and the costliest tests, from the
JSON lines tests/conftest.py writes when ``STRIPEDJAX_TEST_CPU`` names a file, and when each
pytest worker finished.

    STRIPEDJAX_TEST_CPU=bench_out/test_cpu.jsonl make test
    python scripts/test_times.py bench_out/test_cpu.jsonl [--top 15] [--scale 1.6]

A test's CPU seconds are those of its pytest worker (XLA's compile threads included) and of the
processes it started and waited for: unlike wall durations, they hardly depend on what else
shares the cores. ``--scale`` multiplies every figure (e.g. 11 / this machine's yardstick, for
the slower machine: scripts/yardstick.sh).
"""
from __future__ import annotations

import argparse
import collections
import json
import sys


def load(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def per_file(rows: list[dict]) -> list[tuple[str, int, float, float]]:
    """(file, tests, CPU s, wall s) per test file, costliest first."""
    acc = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for r in rows:
        a = acc[r["test"].split("::")[0]]
        a[0] += 1
        a[1] += r["self"] + r["children"]
        a[2] += r["wall"]
    return sorted(((f, n, cpu, wall) for f, (n, cpu, wall) in acc.items()), key=lambda x: -x[2])


def per_worker(rows: list[dict]) -> list[tuple[str, int, float, float]]:
    """(worker, tests, busy wall s, s from the first test's start to its own last end) per pytest
    worker, from the lines that name them: a worker that ends long before the others shows the
    suite's wall time waiting on one long file."""
    timed = [r for r in rows if "worker" in r and "end" in r]
    if not timed:
        return []
    start = min(r["end"] - r["wall"] for r in timed)
    acc = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for r in timed:
        a = acc[r["worker"]]
        a[0] += 1
        a[1] += r["wall"]
        a[2] = max(a[2], r["end"] - start)
    return sorted((w, n, busy, end) for w, (n, busy, end) in acc.items())


PHASES = ("trace", "lower", "compile")


def jax_phases(rows: list[dict]) -> dict[str, float] | None:
    """Seconds the pytest workers spent tracing, lowering and compiling (JAX's own timings, wall
    time, in-process only), the compiles that asked the compilation cache and those it answered,
    summed; None for lines written before conftest recorded them."""
    timed = [r for r in rows if all(k in r for k in PHASES)]
    if not timed:
        return None
    return {k: sum(r.get(k, 0) for r in timed) for k in (*PHASES, "hits", "requests")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("path")
    p.add_argument("--top", type=int, default=15, help="the costliest tests to list")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every figure")
    args = p.parse_args(argv)
    try:
        rows = load(args.path)
    except (OSError, json.JSONDecodeError) as e:
        print(f"error: {args.path}: {e}", file=sys.stderr)
        return 2
    k = args.scale
    total = sum(r["self"] + r["children"] for r in rows)
    print(f"{len(rows)} tests, {total * k / 60:.1f} CPU minutes"
          + (f" (x{k:g})" if k != 1 else ""))
    print("\n| file | tests | CPU min | wall min (summed over workers) |\n|---|---|---|---|")
    for f, n, cpu, wall in per_file(rows):
        print(f"| {f.split('/')[-1]} | {n} | {cpu * k / 60:.2f} | {wall * k / 60:.2f} |")
    phases = jax_phases(rows)
    if phases:  # wall minutes as measured: --scale is for CPU figures
        print(f"\nIn the pytest workers (JAX's timings, wall): tracing {phases['trace'] / 60:.2f}"
              f" min, lowering {phases['lower'] / 60:.2f}, XLA compiles "
              f"{phases['compile'] / 60:.2f}; the compilation cache answered "
              f"{phases['hits']:.0f} of the {phases['requests']:.0f} compiles that asked it")
    workers = per_worker(rows)
    if workers:
        print("\n| worker | tests | busy min | last test ends (min) |\n|---|---|---|---|")
        for w, n, busy, end in workers:
            print(f"| {w} | {n} | {busy * k / 60:.2f} | {end * k / 60:.2f} |")
    print(f"\n| the {args.top} costliest tests | CPU s |\n|---|---|")
    for r in sorted(rows, key=lambda r: -(r["self"] + r["children"]))[:args.top]:
        print(f"| {r['test'].split('tests/', 1)[-1]} | {(r['self'] + r['children']) * k:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
