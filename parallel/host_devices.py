"""A process's devices, decided before jax starts (imports no jax): simulated CPU devices for a
config's mesh, and the share of a host's GPUs a process drives when a host runs several.

A config names a mesh of N devices; a CPU has one device unless XLA_FLAGS carries
``--xla_force_host_platform_device_count=N``, which XLA reads once, when jax starts. So the
commands that build a mesh from a config (train.py, scripts/bench_checkpoint.py,
scripts/bench_data.py) call ``simulate_for_mesh`` first, and those that evaluate a run on its
own mesh (scripts/eval.py, scripts/eval_passkey.py) ``simulate_for_run``. It appends that flag to XLA_FLAGS
(with a longer wait at collectives: PATIENT_COLLECTIVES), and says so in one line, only when all of these hold:

- XLA_FLAGS sets no device count yet (the user's, ``make demo``'s or the launcher's wins);
- the run is one process: no ``--coordinator`` / ``--num_processes`` / ``--process_id``, no
  JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES > 1 and no SLURM step, Open MPI or Kubernetes
  launch of several processes (parallel/cluster.py; each process then brings its own devices);
- the run is on the CPU: JAX_PLATFORMS is ``cpu``, or it is unset and jax has no accelerator
  plugin installed (no ``jax_plugins`` entry point or module, e.g. jax-cuda12-plugin, and no
  libtpu). On a GPU/TPU host the real devices form the mesh;
- the mesh needs more than one device (a ``-1`` axis counts as 1: it fills what is there).
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import math
import os
import pathlib
import re

from errors import ClusterError

AXES = ("data", "fsdp", "sequence", "tensor")  # parallel.mesh.AXES; that module imports jax
FLAG = "--xla_force_host_platform_device_count"
# XLA ends a process (SIGABRT: "Termination timeout for `all reduce ...` exceeded. Exiting to
# ensure a consistent program state") when a device's thread waits at an in-process collective
# for 20 + 40 s (its defaults). Simulated devices share the host's cores, so a wait that long is
# a loaded machine or a lopsided step, not a hang: a CI run of the suite on 2 cores lost a
# worker to it. Where this module simulates devices it gives them 20 + 600 s; a user's own
# value in XLA_FLAGS wins.
COLLECTIVE_TIMEOUT_FLAG = "--xla_cpu_collective_call_terminate_timeout_seconds"
PATIENT_COLLECTIVES = f"{COLLECTIVE_TIMEOUT_FLAG}=600"


def patient_collectives(flags: str) -> str:
    """``flags`` (an XLA_FLAGS value) with PATIENT_COLLECTIVES unless they set that timeout."""
    return flags if COLLECTIVE_TIMEOUT_FLAG in flags else f"{flags} {PATIENT_COLLECTIVES}".strip()


def mesh_devices(mesh_cfg) -> int:
    """The fewest devices the mesh can be built on: the product of its fixed axis sizes."""
    return math.prod(max(int(mesh_cfg[a]), 1) for a in AXES if a in mesh_cfg)


def accelerator_plugin_installed() -> bool:
    """Whether jax would look for a GPU/TPU: a PJRT plugin or libtpu is importable."""
    if importlib.metadata.entry_points(group="jax_plugins"):
        return True
    return any(importlib.util.find_spec(m) is not None for m in ("jax_plugins", "libtpu"))


def multi_process_env(environ=os.environ) -> bool:
    """Whether the environment makes this process one of several (JAX_* variables, a SLURM
    step, Open MPI, Kubernetes: parallel/cluster.py); a launch it cannot resolve counts too
    (train.py stops it in one line)."""
    from parallel.cluster import resolve
    from errors import ClusterError
    try:
        return resolve(environ=environ).multi
    except ClusterError:
        return True


def on_cpu(environ=os.environ) -> bool:
    platforms = [p.strip().lower() for p in environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if platforms:
        return platforms == ["cpu"]
    return not accelerator_plugin_installed()


def simulate_for_mesh(mesh_cfg, *, multi_process: bool = False, environ=os.environ,
                      say=None) -> int:
    """Sets XLA_FLAGS for the mesh's device count when the rule above allows; returns the
    count it set (0 when it left XLA_FLAGS alone). Call before jax is imported."""
    n = mesh_devices(mesh_cfg)
    flags = environ.get("XLA_FLAGS", "")
    if (n <= 1 or FLAG in flags or multi_process or multi_process_env(environ)
            or not on_cpu(environ)):
        return 0
    environ["XLA_FLAGS"] = patient_collectives(f"{flags} {FLAG}={n}".strip())
    sizes = " ".join(f"{a}={mesh_cfg[a]}" for a in AXES if a in mesh_cfg)
    (say or (lambda line: print(line, flush=True)))(
        f"simulating {n} CPU devices for the config's mesh ({sizes}): "
        f"XLA_FLAGS={environ['XLA_FLAGS']}")
    return n


def simulate_for_run(run_dir, *, environ=os.environ, say=None, overrides=()) -> int:
    """``simulate_for_mesh`` for the mesh a run directory trained on (its config.json), so that
    its evaluation runs on that mesh, ring and layout here too; 0 and nothing set when the run
    cannot be read (the script's own open_run reports that). ``overrides``: the script's
    ``FIELD=VALUE`` config overrides, whose ``mesh.AXIS=N`` ones change the mesh."""
    try:
        mesh = json.loads((pathlib.Path(run_dir) / "config.json").read_text())["mesh"]
    except (OSError, ValueError, KeyError, TypeError):
        return 0
    if not isinstance(mesh, dict):
        return 0
    for item in overrides:
        dotted, _, text = item.partition("=")
        if dotted.startswith("mesh.") and text.lstrip("-").isdigit():
            mesh[dotted[len("mesh."):]] = int(text)
    return simulate_for_mesh({k: v for k, v in mesh.items() if isinstance(v, int)},
                             environ=environ, say=say)


def local_device_ids(local_rank: int, local_size: int, visible: list[str] | None,
                     bound_per_task: bool = False) -> list[int] | None:
    """Which of this host's visible GPUs (indices into ``visible``) task ``local_rank`` of the
    host's ``local_size`` drives: all of them with one task per host, or an even share with one
    per GPU (or per few GPUs). None: every visible device (one task on the host, no GPUs seen,
    or the launcher already gave each task its own: SLURM_GPUS_PER_TASK, or one visible GPU)."""
    if not visible or local_size <= 1 or bound_per_task or len(visible) == 1:
        return None
    if len(visible) < local_size:
        raise ClusterError(f"{len(visible)} GPUs visible to {local_size} tasks on this "
                           f"host: fewer GPUs than tasks; launch at most one task per GPU")
    if len(visible) % local_size:
        raise ClusterError(f"{len(visible)} GPUs visible to {local_size} tasks on this "
                           f"host: they do not split evenly; launch a number of tasks per host "
                           f"that divides the GPUs (one per GPU, or one per host)")
    share = len(visible) // local_size
    return list(range(local_rank * share, (local_rank + 1) * share))


def visible_gpus(environ=os.environ) -> list[str]:
    """The GPUs this process may see before jax starts, as CUDA_VISIBLE_DEVICES names them:
    its entries when set, else the numbers of the NVIDIA device files."""
    if "CUDA_VISIBLE_DEVICES" in environ:
        return [d.strip() for d in environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    try:
        found = (re.fullmatch(r"nvidia(\d+)", f) for f in os.listdir("/dev"))
        return [str(n) for n in sorted(int(m.group(1)) for m in found if m)]
    except OSError:
        return []
