"""Several processes, one mesh: jax.distributed setup and a local launcher (one process a core).

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

# XLA CPU has no intra-op thread-count flag: Eigen's pool is turned off and XLA's own runtime
# sizes its pool from the CPU affinity, which taskset pins to one core.
ONE_THREAD_FLAGS = "--xla_cpu_multi_thread_eigen=false"


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, heartbeat_timeout_s: int = 100) -> None:
    """Joins the process group given by the arguments or JAX_COORDINATOR_ADDRESS /
    JAX_NUM_PROCESSES / JAX_PROCESS_ID; a no-op for a single process. A process that sends no
    heartbeat for ``heartbeat_timeout_s`` is declared dead and every other one ends."""
    coordinator = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
    num_processes = num_processes or int(os.environ.get("JAX_NUM_PROCESSES", "1"))
    if process_id is None and "JAX_PROCESS_ID" in os.environ:
        process_id = int(os.environ["JAX_PROCESS_ID"])
    if num_processes <= 1:
        return
    if not coordinator or process_id is None:
        raise ValueError("a multi-process run needs --coordinator HOST:PORT and --process_id "
                         "(or JAX_COORDINATOR_ADDRESS and JAX_PROCESS_ID)")
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # ignored by GPU/TPU clients
    jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id,
                               heartbeat_timeout_seconds=int(heartbeat_timeout_s))


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
    """Asks XLA for ``n`` simulated CPU devices unless the caller already chose a count. Must
    run before jax is imported (XLA reads the flag once)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _relay(stream, prefix: str, out):
    for line in iter(stream.readline, ""):
        out.write(f"{prefix}{line}")
        out.flush()


def spawn_local(argv: list[str], processes: int, devices_per_process: int = 1,
                quiet_followers: bool = False) -> int:
    """Runs ``python argv... --coordinator ... --num_processes P --process_id i`` P times, process
    i pinned to core i with one XLA thread, output prefixed ``[pI]``. When one process fails the
    others are stopped at once; returns the first non-zero exit code (0 if all succeed)."""
    port = free_port()
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if cores and len(cores) < processes:
        print(f"warning: {processes} processes on {len(cores)} cores: they will share cores",
              file=sys.stderr)
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(filter(None, [
        os.environ.get("XLA_FLAGS", ""), ONE_THREAD_FLAGS,
        f"--xla_force_host_platform_device_count={devices_per_process}"])), PYTHONUNBUFFERED="1")
    procs, relays = [], []
    for i in range(processes):
        cmd = [sys.executable, *argv, "--coordinator", f"127.0.0.1:{port}",
               "--num_processes", str(processes), "--process_id", str(i)]
        if cores and shutil.which("taskset"):
            cmd = ["taskset", "-c", str(cores[i % len(cores)]), *cmd]
        quiet = quiet_followers and i > 0
        p = subprocess.Popen(cmd, env=env, text=True, stdout=subprocess.PIPE,
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
