"""Critical path of ring attention per layout, from the kernel's own tile predicate.

    python scripts/schedule.py --devices 2,4,8,16,64 [--seq-len 262144 --block 512 --stripe 1]
    python scripts/schedule.py --impls --devices 4 --seq-len 16384 --block 128 [--ulysses 2]
    python scripts/schedule.py --devices 2,4,8 --seq-len 16384 --block 128 --window 2048

Prints a Markdown table per layout: the critical path (sum over ring rounds of the busiest
device's tile count), its speedup over contiguous, the issue's ideal 2N/(N+1) and the limit
(2N-1)/N that tile-level skipping reaches as tiles shrink. With ``--window W`` (a sliding
window, Mistral's convention) also the ring's hops: the contiguous ring stops after the rounds
the window reaches, striped and zigzag keep all N (the ideal and limit columns are for full
causal attention and are left out).

With ``--impls``: a table per device count of each layout's total tiles (the work every
strategy does) and the critical path of each context-parallel strategy (ring, allgather,
usp with Ulysses degree ``--ulysses``, ulysses) in tiles, from the same tile pairs
(``parallel.schedule.strategy_rounds``).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallel.layouts import LAYOUTS  # noqa: E402
from parallel.schedule import ideal_speedup, tile_limit_speedup, work  # noqa: E402
from parallel.strategies import IMPLS  # noqa: E402  (no jax)


def impl_rows(layouts, seq_len: int, devices: int, block: int, stripe: int = 1,
              impls=IMPLS, ulysses: int = 2) -> tuple[list[str], list[list]]:
    """Header and rows of the ``--impls`` table: per layout, the total tiles and each
    strategy's critical path in tiles (None where usp's degree does not divide ``devices``)."""
    header = ["layout", "total tiles"] + [f"usp(U={ulysses})" if i == "usp" else i for i in impls]
    rows = []
    for lay in layouts:
        w = work(lay, seq_len, devices, block, stripe if lay == "striped" else 1)
        row = [lay, w.total]
        for impl in impls:
            ok = impl != "usp" or (ulysses >= 1 and devices % ulysses == 0)
            row.append(w.strategy_critical_path(impl, ulysses) if ok else None)
        rows.append(row)
    return header, rows


def _tiles(x) -> str:
    if x is None:
        return "-"
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.1f}"


def print_impls(args, devices, layouts, impls):
    print(f"seq_len {args.seq_len}, tile {args.block}x{args.block}"
          + (f", stripe {args.stripe}" if "striped" in layouts else "")
          + "; total tiles per layout and each strategy's critical path in tiles\n")
    for n in devices:
        header, rows = impl_rows(layouts, args.seq_len, n, args.block, args.stripe, impls,
                                 args.ulysses)
        print(f"### {n} devices\n")
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for lay, *nums in rows:
            print(f"| {lay} | " + " | ".join(_tiles(x) for x in nums) + " |")
        print()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", default="2,4,8,16,64", help="comma list of ring sizes")
    p.add_argument("--seq-len", type=int, default=262144)
    p.add_argument("--block", type=int, default=512, help="square tile size (block_q = block_kv)")
    p.add_argument("--stripe", type=int, default=1, help="striped layout: stripe width")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--impls", nargs="?", const=",".join(IMPLS), default="",
                   help="instead of the layout tables: total tiles and each strategy's critical "
                        f"path (comma list of {', '.join(IMPLS)}; all when given alone)")
    p.add_argument("--ulysses", type=int, default=2, help="--impls: usp's Ulysses degree U")
    p.add_argument("--window", type=int, default=0,
                   help="sliding window W (0: full causal attention): keys p - W < k <= p")
    args = p.parse_args(argv)
    if args.window < 0:
        p.error(f"--window {args.window}: must be >= 0 (0: full causal attention)")
    devices = [int(x) for x in args.devices.split(",") if x]
    layouts = [x for x in args.layouts.split(",") if x]
    if args.impls:
        impls = [x for x in args.impls.split(",") if x]
        bad = [i for i in impls if i not in IMPLS]
        if bad:
            p.error(f"--impls {','.join(bad)}: choose from {','.join(IMPLS)}")
        return print_impls(args, devices, layouts, impls)
    results = {(lay, n): work(lay, args.seq_len, n, args.block, args.stripe if lay == "striped" else 1,
                              window=args.window)
               for lay in set(layouts) | {"contiguous"} for n in devices}
    print(f"seq_len {args.seq_len}, tile {args.block}x{args.block}"
          + (f", stripe {args.stripe}" if "striped" in layouts else "")
          + (f", sliding window {args.window}" if args.window else "") + "; critical path in tiles\n")
    for lay in layouts:
        print(f"### {lay}\n")
        if args.window:
            print("| devices | tiles per chunk | critical path | balance | speedup vs contiguous "
                  "| ring hops |")
            print("|---|---|---|---|---|---|")
        else:
            print("| devices | tiles per chunk | critical path | balance | speedup vs contiguous "
                  "| ideal 2N/(N+1) | tile limit (2N-1)/N |")
            print("|---|---|---|---|---|---|---|")
        for n in devices:
            w, base = results[(lay, n)], results[("contiguous", n)]
            row = (f"| {n} | {w.tiles_per_chunk} | {w.critical_path} | {w.balance:.2f} "
                   f"| {base.critical_path / w.critical_path:.3f} ")
            if args.window:
                print(row + f"| {w.hops} of {n} |")
            else:
                print(row + f"| {ideal_speedup(n):.3f} | {tile_limit_speedup(n):.3f} |")
        print()


if __name__ == "__main__":
    main()
