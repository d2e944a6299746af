"""Several processes, one mesh: jax.distributed setup and a local launcher (one process a core
or a GPU, given flags or the variables a cluster would set).

On CPU the processes talk over gloo; on GPUs over NCCL. The same train step runs either way.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

from parallel.host_devices import FLAG, patient_collectives

# XLA CPU has no intra-op thread-count flag: Eigen's pool is turned off and XLA's own runtime
# sizes its pool from the CPU affinity, which taskset pins to one core.
ONE_THREAD_FLAGS = "--xla_cpu_multi_thread_eigen=false"


def cpu_process_flags(user_flags: str, devices: int) -> str:
    """XLA_FLAGS of one process of a local CPU run: the user's, one XLA thread, ``devices``
    simulated devices, and collectives that wait for slow peers."""
    return patient_collectives(" ".join(filter(None, [user_flags, ONE_THREAD_FLAGS,
                                                      f"{FLAG}={devices}"])))


def initialize(place, heartbeat_timeout_s: int = 100, init_timeout_s: int = 300) -> str:
    """Joins the run ``place`` (parallel.cluster.resolve) describes; a no-op for one process.
    A process that sends no heartbeat for ``heartbeat_timeout_s`` is declared dead and every
    other one ends; one that cannot gather the run within ``init_timeout_s`` aborts (its
    watcher, training/supervisor.py, says so in one line). Returns the startup line."""
    if not place.multi:
        return ""
    import jax

    from parallel.host_devices import local_device_ids, on_cpu, visible_gpus
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # ignored by GPU/TPU clients
    timeouts = dict(initialization_timeout=int(init_timeout_s),
                    heartbeat_timeout_seconds=int(heartbeat_timeout_s))
    if place.environment == "TPU pod":
        jax.distributed.initialize(**timeouts)
    else:
        # Ours resolved every field, so JAX's own detection stays off: it would give a process
        # of a one-per-host launch only GPU 0 (SLURM_LOCALID), not the host's share.
        ids = None if on_cpu() else local_device_ids(
            place.local_rank, place.local_size, visible_gpus(),
            bound_per_task=bool(os.environ.get("SLURM_GPUS_PER_TASK")))
        jax.distributed.initialize(place.coordinator, num_processes=place.num_processes,
                                   process_id=place.process_id, local_device_ids=ids,
                                   cluster_detection_method="deactivate", **timeouts)
    devices = jax.local_devices()
    kinds = sorted({d.platform for d in devices})
    return (f"{place.describe()}; {len(devices)} local {'/'.join(kinds)} device"
            f"{'s' if len(devices) != 1 else ''} ({', '.join(str(d.id) for d in devices)})")


# Python-level errors of a collective or barrier whose peer is gone (gloo, NCCL, the
# coordination service), as opposed to a bug, which keeps its traceback.
_PEER_ERRORS = ("Gloo", "NCCL", "Connection reset by peer", "Connection closed by peer",
                "heartbeat", "CoordinationService", "Barrier failed")


def is_peer_error(e: BaseException) -> bool:
    """Whether ``e`` or an error behind it says another process of the run is gone (orbax
    wraps a failed barrier in its own timeout); see training/supervisor.py."""
    for _ in range(32):  # chains are short; the bound only guards against a cycle
        if e is None:
            return False
        if any(p in str(e) for p in _PEER_ERRORS):
            return True
        e = e.__cause__ or e.__context__
    return False


def simulate_cpu_devices(n: int) -> None:
    """Asks XLA for ``n`` simulated CPU devices (patient at collectives:
    parallel/host_devices.py) unless the caller already chose a count. Must run before jax is
    imported (XLA reads the flag once)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if FLAG not in flags:
        os.environ["XLA_FLAGS"] = patient_collectives(f"{flags} {FLAG}={n}".strip())


def free_port(low: int | None = None, high: int | None = None) -> int:
    """A free TCP port: any, or one in [low, high] (a cluster's port rule's range)."""
    if low is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    import random
    for port in random.sample(range(low, high + 1), min(200, high + 1 - low)):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return port
            except OSError:
                continue
    raise OSError(f"no free port in [{low}, {high}]")


CLUSTERS = ("slurm", "openmpi", "k8s")


def cluster_env(kind: str, i: int, n: int, port: int) -> dict[str, str]:
    """What ``kind``'s launcher would set for task i of n on one host, coordinator on ``port``
    (chosen so that the cluster's own port rule gives it: parallel/cluster.py)."""
    from parallel.cluster import PORT_BASE
    if kind == "slurm":  # srun -n N on one node
        return {"SLURM_JOB_ID": str(4096 * 10 + port - PORT_BASE), "SLURM_STEP_ID": "0",
                "SLURM_STEP_NODELIST": "localhost", "SLURM_STEP_NUM_NODES": "1",
                "SLURM_NTASKS": str(n), "SLURM_STEP_TASKS_PER_NODE": str(n),
                "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i), "SLURM_NODEID": "0"}
    if kind == "openmpi":  # mpirun -n N: the launcher's job id in the URI gives the port
        return {"OMPI_MCA_orte_hnp_uri": f"{4096 * (port - PORT_BASE)}.0;tcp://127.0.0.1:{free_port()}",
                "OMPI_COMM_WORLD_SIZE": str(n), "OMPI_COMM_WORLD_RANK": str(i),
                "OMPI_COMM_WORLD_LOCAL_RANK": str(i), "OMPI_COMM_WORLD_LOCAL_SIZE": str(n)}
    if kind == "k8s":  # an Indexed Job; the coordinator as XPK and our manifest give it
        return {"JOB_COMPLETION_INDEX": str(i), "HOSTNAME": f"train-{i}",
                "JAX_NUM_PROCESSES": str(n), "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}"}
    raise ValueError(f"--as {kind!r} is not one of {', '.join(CLUSTERS)}")


def _relay(stream, prefix: str, out):
    for line in iter(stream.readline, ""):
        out.write(f"{prefix}{line}")
        out.flush()


def spawn_local(argv: list[str], processes: int, devices_per_process: int = 1,
                quiet_followers: bool = False, as_cluster: str | None = None,
                platform: str = "cpu") -> int:
    """Runs ``python argv...`` P times as one distributed run, output prefixed ``[pI]``. Each
    process finds its place from ``--coordinator ... --num_processes P --process_id i``, or
    with ``as_cluster`` (slurm | openmpi | k8s) from the variables that cluster would set. On
    the CPU each is pinned to a core with one XLA thread and ``devices_per_process`` devices;
    on GPUs (``platform="gpu"``) each drives its share of the host's GPUs. When one process
    fails the others are stopped at once; returns the first non-zero exit code (0 if all
    succeed)."""
    from parallel.cluster import PORT_BASE
    port = free_port(PORT_BASE, 65535) if as_cluster else free_port()
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if platform == "cpu":
        if cores and len(cores) < processes:
            print(f"warning: {processes} processes on {len(cores)} cores: they will share cores",
                  file=sys.stderr)
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_process_flags(os.environ.get("XLA_FLAGS", ""),
                                                                  devices_per_process))
    procs, relays = [], []
    for i in range(processes):
        cmd, own = [sys.executable, *argv], dict(env)
        if as_cluster:
            own.update(cluster_env(as_cluster, i, processes, port))
        else:
            cmd += ["--coordinator", f"127.0.0.1:{port}", "--num_processes", str(processes),
                    "--process_id", str(i)]
            if platform == "gpu":
                from parallel.host_devices import local_device_ids, visible_gpus
                gpus = visible_gpus()
                ids = local_device_ids(i, processes, gpus)
                own["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[k] for k in (ids or range(len(gpus))))
        if platform == "cpu" and cores and shutil.which("taskset"):
            cmd = ["taskset", "-c", str(cores[i % len(cores)]), *cmd]
        quiet = quiet_followers and i > 0
        p = subprocess.Popen(cmd, env=own, text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(p)
        t = threading.Thread(target=_relay, daemon=True, args=(
            p.stdout, f"[p{i}] ", open(os.devnull, "w") if quiet else sys.stdout))
        t.start()
        relays.append(t)
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                i, code = failed[0]
                print(f"error: process {i} exited with code {code}; stopping the others",
                      file=sys.stderr)
                _stop(procs)
                return code
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.2)
    except KeyboardInterrupt:
        _stop(procs, signal.SIGINT)
        return 130
    finally:
        for t in relays:
            t.join(timeout=2)


def _stop(procs, sig=signal.SIGTERM):
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, sig)
    deadline = time.time() + 10
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.time(), 0.1))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
