"""Start P local processes of a JAX program as one distributed run, one CPU core each.

    python scripts/launch_local.py --processes 2 -- train.py --config configs/tiny.py \
        --workdir runs/two --config.mesh.fsdp=1 --config.mesh.sequence=2

Each process is pinned to its core with one XLA thread and joins the run over gloo collectives;
output is prefixed [p0], [p1], ...; if one process dies the others are stopped and the launcher
exits with its code.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallel.distributed import spawn_local  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--processes", type=int, default=2, help="processes (one per core)")
    p.add_argument("--devices-per-process", type=int, default=1, help="simulated CPU devices each")
    p.add_argument("program", nargs=argparse.REMAINDER, help="-- program.py args...")
    args = p.parse_args()
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    if not program:
        p.error("give the program after --, e.g. -- train.py --config configs/tiny.py")
    if args.processes < 1:
        p.error(f"--processes must be >= 1, got {args.processes}")
    sys.exit(spawn_local(program, args.processes, args.devices_per_process))


if __name__ == "__main__":
    main()
