"""Plan a training run for a mesh this machine does not have.

    python scripts/plan.py --config configs/llama_7b.py --mesh data=1,fsdp=8,sequence=8,tensor=1 \
        --seq-len 262144 --batch 1 --hardware h100 [--remat all] [--json plan.json]

Compiles the real train step for the mesh on simulated CPU devices (no weights allocated) and
prints parameters, FLOPs per token, per-device memory of the compiled program against the
hardware's, the program's collectives per step, and a projected step time and MFU bound per
token layout, then the same per context-parallel strategy (--impls ring,allgather,ulysses,usp;
usp at every Ulysses degree the heads allow) with the fastest named. Exit code 2 with one line on stderr for a config or mesh that cannot run.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from planning.cli import main  # noqa: E402  (imports no jax: the device count comes first)

if __name__ == "__main__":
    sys.exit(main())
