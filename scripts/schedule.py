"""Critical path of ring attention per layout, from the kernel's own tile predicate.

    python scripts/schedule.py --devices 2,4,8,16,64 [--seq-len 262144 --block 512 --stripe 1]

Prints a Markdown table per layout: the critical path (sum over ring rounds of the busiest
device's tile count), its speedup over contiguous, the issue's ideal 2N/(N+1) and the limit
(2N-1)/N that tile-level skipping reaches as tiles shrink.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallel.layouts import LAYOUTS  # noqa: E402
from parallel.schedule import ideal_speedup, tile_limit_speedup, work  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", default="2,4,8,16,64", help="comma list of ring sizes")
    p.add_argument("--seq-len", type=int, default=262144)
    p.add_argument("--block", type=int, default=512, help="square tile size (block_q = block_kv)")
    p.add_argument("--stripe", type=int, default=1, help="striped layout: stripe width")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    args = p.parse_args(argv)
    devices = [int(x) for x in args.devices.split(",") if x]
    layouts = [x for x in args.layouts.split(",") if x]
    results = {(lay, n): work(lay, args.seq_len, n, args.block, args.stripe if lay == "striped" else 1)
               for lay in set(layouts) | {"contiguous"} for n in devices}
    print(f"seq_len {args.seq_len}, tile {args.block}x{args.block}"
          + (f", stripe {args.stripe}" if "striped" in layouts else "") + "; critical path in tiles\n")
    for lay in layouts:
        print(f"### {lay}\n")
        print("| devices | tiles per chunk | critical path | balance | speedup vs contiguous "
              "| ideal 2N/(N+1) | tile limit (2N-1)/N |")
        print("|---|---|---|---|---|---|---|")
        for n in devices:
            w, base = results[(lay, n)], results[("contiguous", n)]
            print(f"| {n} | {w.tiles_per_chunk} | {w.critical_path} | {w.balance:.2f} "
                  f"| {base.critical_path / w.critical_path:.3f} | {ideal_speedup(n):.3f} "
                  f"| {tile_limit_speedup(n):.3f} |")
        print()


if __name__ == "__main__":
    main()
