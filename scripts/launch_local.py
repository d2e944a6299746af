"""Start P local processes of a JAX program as one distributed run: one CPU core each, or one
share of this host's GPUs each.

    python scripts/launch_local.py --processes 2 -- train.py --config configs/tiny.py \
        --workdir runs/two --config.mesh.fsdp=1 --config.mesh.sequence=2

Each process finds its place from ``--coordinator/--num_processes/--process_id``, or with
``--as slurm|openmpi|k8s`` from the variables that cluster's launcher would set (srun, mpirun, a
Kubernetes Indexed Job), so every path of parallel/cluster.py runs on one machine. On the CPU
each process is pinned to its core with one XLA thread and joins over gloo; with ``--platform
gpu`` each drives its share of the GPUs (NCCL). Output is prefixed [p0], [p1], ...; if one
process dies the others are stopped and the launcher exits with its code.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallel.distributed import CLUSTERS, spawn_local  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--processes", type=int, default=0,
                   help="processes (default: 2 on the CPU, one per visible GPU with --platform gpu)")
    p.add_argument("--devices-per-process", type=int, default=1, help="simulated CPU devices each")
    p.add_argument("--as", dest="as_cluster", choices=CLUSTERS, default=None,
                   help="set the variables this cluster's launcher would, instead of flags")
    p.add_argument("--platform", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("program", nargs=argparse.REMAINDER, help="-- program.py args...")
    args = p.parse_args()
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    if not program:
        p.error("give the program after --, e.g. -- train.py --config configs/tiny.py")
    if not args.processes:
        from parallel.host_devices import visible_gpus
        args.processes = len(visible_gpus()) if args.platform == "gpu" else 2
    if args.processes < 1:
        p.error(f"--processes must be >= 1, got {args.processes}"
                + (" (no GPU is visible)" if args.platform == "gpu" else ""))
    sys.exit(spawn_local(program, args.processes, args.devices_per_process,
                         as_cluster=args.as_cluster, platform=args.platform))


if __name__ == "__main__":
    main()
