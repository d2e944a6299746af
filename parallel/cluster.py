"""Where this process stands in a run: process i of n, the coordinator, its task on this host,
found from flags or from what a cluster's launcher leaves in the environment. Imports no jax:
train.py's watcher and parallel/host_devices.py read it before jax starts.

Precedence, field by field: the flags (``--coordinator``, ``--num_processes``,
``--process_id``), then JAX's own variables (``JAX_COORDINATOR_ADDRESS``,
``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``), then the first cluster whose variables are present:

- a SLURM step (``srun``): ``SLURM_JOB_ID``, ``SLURM_STEP_NODELIST``, ``SLURM_NTASKS``,
  ``SLURM_PROCID``, ``SLURM_LOCALID``; the coordinator is the step's first host on port
  ``SLURM_JOB_ID % 4096 + 61440``. A batch script or ``salloc`` shell (no
  ``SLURM_STEP_NODELIST``) is not a step: it runs as one process;
- Open MPI (``mpirun``): ``OMPI_COMM_WORLD_SIZE/RANK/LOCAL_RANK/LOCAL_SIZE``; the coordinator
  is the launcher's address in ``OMPI_MCA_orte_hnp_uri``, port ``jobid / 4096 % 4096 + 61440``;
- Kubernetes (an Indexed Job, or a JobSet of one child Job, from the environment alone):
  ``JOB_COMPLETION_INDEX`` is the process; the count comes from ``JAX_NUM_PROCESSES`` (the
  manifest sets it); the coordinator is pod 0 of the job, ``<job>-0.<subdomain>:55527``, found
  from ``HOSTNAME`` (``<job>-<index>``) and the pod's DNS name, unless
  ``JAX_COORDINATOR_ADDRESS`` says it (a JobSet of several child Jobs needs it, and
  ``JAX_PROCESS_ID``: each child Job counts its pods from 0).

``JAX_COORDINATOR_PORT`` overrides a cluster's port, as in JAX. The coordinator rules are JAX's
own (``jax/_src/clusters``); tests/test_cluster.py checks them against it, so a JAX change
shows. A TPU pod (``TPU_WORKER_HOSTNAMES`` with several hosts) is left to JAX's detection. A
launch that looks like a cluster step but cannot be resolved raises ClusterError: it never
becomes n one-process runs writing the same directory.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import socket
import sys
import time

from errors import ClusterError, ConfigError

PORT_BASE = 65535 - 2**12 + 1  # JAX's coordinator ports: [61440, 65535]
K8S_PORT = 55527  # jax/_src/clusters/k8s_cluster.py


@dataclasses.dataclass(frozen=True)
class Place:
    """This process's place in a run. ``origin`` maps each field to what it was read from."""
    environment: str  # "one process" | "flags" | "JAX_* variables" | "SLURM" | "Open MPI" | ...
    num_processes: int = 1
    process_id: int = 0
    coordinator: str | None = None
    origin: dict = dataclasses.field(default_factory=dict)
    local_rank: int = 0  # this process's task among those on its host
    local_size: int = 1  # tasks on its host
    hosts: int | None = None  # hosts the run spans, where the environment says
    job_id: str | None = None  # the cluster's job id (SLURM, Open MPI), for a default workdir

    @property
    def multi(self) -> bool:
        return self.num_processes > 1

    def source(self, field: str) -> str:
        return self.origin.get(field, "")

    def describe(self) -> str:
        """``SLURM: coordinator node001:61442 (SLURM_STEP_NODELIST, SLURM_JOB_ID), process 1 of
        4 (SLURM_PROCID, SLURM_NTASKS), task 1 of 2 on this host``."""
        if not self.multi:
            return f"{self.environment}: one process"
        where = f" ({self.source('coordinator')})" if self.source("coordinator") else ""
        ids = ", ".join(filter(None, (self.source("process_id"), self.source("num_processes"))))
        task = (f", task {self.local_rank} of {self.local_size} on this host"
                if self.local_size > 1 else "")
        coordinator = self.coordinator or "found by JAX"
        return (f"{self.environment}: coordinator {coordinator}{where}, process "
                f"{self.process_id} of {self.num_processes}{f' ({ids})' if ids else ''}{task}")


def resolve(coordinator: str | None = None, num_processes: int | None = None,
            process_id: int | None = None, environ=os.environ, fqdn=None) -> Place:
    """This process's place from the flags (None when not given) and ``environ``; ``fqdn``
    (tests) stands in for this host's DNS name, read only for a Kubernetes coordinator."""
    got: dict[str, tuple[object, str]] = {}
    flags = {"coordinator": (coordinator, "--coordinator"),
             "num_processes": (num_processes, "--num_processes"),
             "process_id": (process_id, "--process_id")}
    for field, (value, name) in flags.items():
        if value is not None:
            got[field] = (value, name)
    jax_vars = {"coordinator": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_NUM_PROCESSES",
                "process_id": "JAX_PROCESS_ID"}
    for field, name in jax_vars.items():
        if field not in got and environ.get(name, "").strip():
            value = environ[name].strip()
            got[field] = (value if field == "coordinator" else _int(name, value), name)
    environment = ("flags" if any(v[1].startswith("--") for v in got.values())
                   else "JAX_* variables" if got else None)
    # A TPU pod first: GKE's TPU JobSets also set JOB_COMPLETION_INDEX (JAX checks it first too).
    found = next((f for c in (_tpu_pod, _slurm, _openmpi, _kubernetes)
                  if (f := c(environ)) is not None), None)
    extra = {}
    if found is not None:
        name = found.pop("environment")
        if "process_id" not in got and "process_id" in found:
            environment = name
        elif environment is None:
            environment = name
        for field in ("num_processes", "process_id"):
            if field not in got and field in found:
                got[field] = found[field]
        if "coordinator" not in got and "coordinator" in found:
            extra["coordinator"] = found["coordinator"]  # resolved below, only if needed
        extra.update({k: found[k] for k in ("local_rank", "local_size", "hosts", "job_id")
                      if k in found})
    if environment is None:
        return Place("one process")
    n = got.get("num_processes", (None, ""))[0]
    if n is None:
        raise ClusterError(f"{environment}: the number of processes is unknown (process id from "
                           f"{got['process_id'][1] if 'process_id' in got else 'nowhere'}): "
                           f"give --num_processes or JAX_NUM_PROCESSES")
    n = int(n)
    if n < 1:
        raise ClusterError(f"{got['num_processes'][1]}={n}: the number of processes must be >= 1")
    if n == 1:
        return Place(environment, origin={"num_processes": got["num_processes"][1]},
                     job_id=extra.get("job_id"))
    if "process_id" not in got:
        raise ClusterError(f"{environment}: a run of {n} processes ({got['num_processes'][1]}) "
                           f"but this process's index is unknown: give --process_id or "
                           f"JAX_PROCESS_ID, or launch with srun, mpirun or a Kubernetes "
                           f"Indexed Job")
    i = int(got["process_id"][0])
    if not 0 <= i < n:
        raise ClusterError(f"{got['process_id'][1]}={i} is not a process of a run of {n} "
                           f"({got['num_processes'][1]}): valid ids are 0..{n - 1}")
    if "coordinator" not in got:
        if "coordinator" not in extra:
            raise ClusterError(f"{environment}: a run of {n} processes needs a coordinator: give "
                               f"--coordinator HOST:PORT or JAX_COORDINATOR_ADDRESS")
        got["coordinator"] = extra.pop("coordinator")(fqdn)
    address = str(got["coordinator"][0])
    if address:  # a TPU pod's is JAX's to find
        _split_address(address, got["coordinator"][1])
    origin = {field: got[field][1] for field in ("coordinator", "num_processes", "process_id")}
    return Place(environment, n, i, address, origin, extra.get("local_rank", 0),
                 extra.get("local_size", 1), extra.get("hosts"), extra.get("job_id"))


# -- the clusters: each returns None when its variables are absent ----------------------------
def _slurm(env) -> dict | None:
    if "SLURM_JOB_ID" not in env or "SLURM_STEP_NODELIST" not in env:
        return None  # not SLURM, or its batch script / salloc shell: not a step of tasks
    missing = [v for v in ("SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID") if v not in env]
    if missing:
        raise ClusterError(f"a SLURM step (SLURM_STEP_NODELIST={env['SLURM_STEP_NODELIST']}) "
                           f"without {', '.join(missing)}: launch the tasks with srun")
    nodes = expand_nodelist(env["SLURM_STEP_NODELIST"])
    node_id = _int("SLURM_NODEID", env.get("SLURM_NODEID", "0"))
    per_node = tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE", ""))
    job = env["SLURM_JOB_ID"]
    port, port_from = _port(env, lambda: _int("SLURM_JOB_ID", job) % 2**12 + PORT_BASE,
                            "port SLURM_JOB_ID % 4096 + 61440")

    def coordinator(fqdn):
        return f"{nodes[0]}:{port}", ", ".join(["SLURM_STEP_NODELIST", port_from])

    return {"environment": "SLURM",
            "num_processes": (_int("SLURM_NTASKS", env["SLURM_NTASKS"]), "SLURM_NTASKS"),
            "process_id": (_int("SLURM_PROCID", env["SLURM_PROCID"]), "SLURM_PROCID"),
            "coordinator": coordinator, "job_id": job,
            "local_rank": _int("SLURM_LOCALID", env["SLURM_LOCALID"]),
            "local_size": per_node[node_id] if node_id < len(per_node) else 1,
            "hosts": _int("SLURM_STEP_NUM_NODES", env["SLURM_STEP_NUM_NODES"])
            if "SLURM_STEP_NUM_NODES" in env else len(nodes)}


def _openmpi(env) -> dict | None:
    uri = env.get("OMPI_MCA_orte_hnp_uri")
    if uri is None and "OMPI_COMM_WORLD_SIZE" not in env:
        return None
    missing = [v for v in ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK") if v not in env]
    if missing:
        raise ClusterError(f"an Open MPI launch without {', '.join(missing)}: start the "
                           f"processes with mpirun")
    size = _int("OMPI_COMM_WORLD_SIZE", env["OMPI_COMM_WORLD_SIZE"])
    local_size = _int("OMPI_COMM_WORLD_LOCAL_SIZE", env.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1"))

    def coordinator(fqdn):
        if uri is None:
            raise ClusterError("Open MPI without OMPI_MCA_orte_hnp_uri (Open MPI 5 no longer "
                               "sets it): give the coordinator as JAX_COORDINATOR_ADDRESS="
                               "HOST:PORT (mpirun -x JAX_COORDINATOR_ADDRESS=...), HOST being "
                               "rank 0's host")
        m = re.search(r"tcp://(.+?)[,:]|tcp6://\[(.+?)[,\]]", uri)
        if m is None:
            raise ClusterError(f"OMPI_MCA_orte_hnp_uri={uri!r}: no tcp:// address in it; give "
                               f"JAX_COORDINATOR_ADDRESS=HOST:PORT")
        host = next(g for g in m.groups() if g is not None)
        port, port_from = _port(env, lambda: _int("OMPI_MCA_orte_hnp_uri's job id", uri.split(
            ".", 1)[0]) // 2**12 % 2**12 + PORT_BASE, "port jobid / 4096 % 4096 + 61440")
        host = f"[{host}]" if ":" in host else host
        return f"{host}:{port}", ", ".join(["OMPI_MCA_orte_hnp_uri", port_from])

    return {"environment": "Open MPI",
            "num_processes": (size, "OMPI_COMM_WORLD_SIZE"),
            "process_id": (_int("OMPI_COMM_WORLD_RANK", env["OMPI_COMM_WORLD_RANK"]),
                           "OMPI_COMM_WORLD_RANK"),
            "coordinator": coordinator,
            "job_id": uri.split(".", 1)[0] if uri else None,
            "local_rank": _int("OMPI_COMM_WORLD_LOCAL_RANK",
                               env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")),
            "local_size": local_size,
            "hosts": None if local_size >= size else -(-size // max(local_size, 1))}


def _kubernetes(env) -> dict | None:
    if "JOB_COMPLETION_INDEX" not in env:
        return None
    index = _int("JOB_COMPLETION_INDEX", env["JOB_COMPLETION_INDEX"])

    def coordinator(fqdn):
        host = env.get("HOSTNAME", "") or socket.gethostname()
        suffix = f"-{index}"
        if not host.endswith(suffix):
            raise ClusterError(f"Kubernetes: HOSTNAME={host!r} is not <job>-{index} (an Indexed "
                               f"Job's pod name): give JAX_COORDINATOR_ADDRESS=HOST:PORT")
        name = fqdn if fqdn is not None else socket.getfqdn()
        labels = name.split(".")
        if len(labels) < 2 or labels[0] != host:
            raise ClusterError(f"Kubernetes: this pod ({host}) has no subdomain (its DNS name is "
                               f"{name!r}), so pod 0 cannot be found: set the Job's "
                               f"spec.template.spec.subdomain to a headless Service "
                               f"(scripts/k8s/train.yaml), or give JAX_COORDINATOR_ADDRESS")
        port, port_from = _port(env, lambda: K8S_PORT, f"port {K8S_PORT}")
        return (f"{host[:-len(suffix)]}-0.{labels[1]}:{port}",
                ", ".join(["HOSTNAME", "the pod's subdomain", port_from]))

    return {"environment": "Kubernetes", "process_id": (index, "JOB_COMPLETION_INDEX"),
            "coordinator": coordinator}


def _tpu_pod(env) -> dict | None:
    hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    if len(hosts) <= 1:
        return None
    return {"environment": "TPU pod", "num_processes": (len(hosts), "TPU_WORKER_HOSTNAMES"),
            "process_id": (_int("TPU_WORKER_ID", env.get("TPU_WORKER_ID", "0")), "TPU_WORKER_ID"),
            "coordinator": lambda fqdn: ("", "JAX's TPU detection"),
            "hosts": len(hosts)}


# -- parsing --------------------------------------------------------------------------------------
def expand_nodelist(text: str) -> list[str]:
    """SLURM's compressed host list: ``node[001-003,007],gpu-a`` -> node001, node002, node003,
    node007, gpu-a (ranges keep their zero padding; several bracket groups in one name multiply)."""
    names, depth, start = [], 0, 0
    for i, ch in enumerate(text + ","):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            if text[start:i].strip():
                names.extend(_expand_one(text[start:i].strip()))
            start = i + 1
        if depth < 0:
            break
    if depth != 0 or not names:
        raise ClusterError(f"SLURM_STEP_NODELIST={text!r} is not a SLURM host list "
                           f"(e.g. node[001-004,007],gpu-a)")
    return names


def _expand_one(name: str) -> list[str]:
    m = re.match(r"([^\[]*)\[([^\]]*)\](.*)$", name)
    if m is None:
        return [name]
    prefix, ranges, rest = m.groups()
    out = []
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ClusterError(f"SLURM host list: [{ranges}] in {name!r} is not a list of "
                               f"numbers and ranges")
        for k in range(int(lo), int(hi or lo) + 1):
            out.append(f"{prefix}{k:0{len(lo)}d}")
    return [head + tail for head in out for tail in _expand_one(rest)]


def tasks_per_node(text: str) -> list[int]:
    """SLURM's ``2(x3),1`` -> [2, 2, 2, 1]."""
    counts = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if m is None:
            raise ClusterError(f"SLURM_STEP_TASKS_PER_NODE={text!r} is not like 2(x3),1")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def _int(name: str, value: str) -> int:
    try:
        return int(str(value).strip())
    except ValueError:
        raise ClusterError(f"{name}={value!r} is not a whole number") from None


def _port(env, default, rule: str) -> tuple[int, str]:
    if env.get("JAX_COORDINATOR_PORT", "").strip():
        port = _int("JAX_COORDINATOR_PORT", env["JAX_COORDINATOR_PORT"])
        if not 0 < port < 65536:
            raise ClusterError(f"JAX_COORDINATOR_PORT={port} is not a port (1..65535)")
        return port, "JAX_COORDINATOR_PORT"
    return default(), rule


def _split_address(address: str, source: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ClusterError(f"{source}={address!r} is not HOST:PORT (e.g. node001:61442)")
    return host.strip("[]"), int(port)


# -- checks before joining --------------------------------------------------------------------
def check_reachable(place: Place, resolve_host=socket.gethostbyname,
                    this_host: str | None = None) -> None:
    """Refuses a loopback coordinator for a run that spans hosts: the other hosts would each
    reach themselves (``localhost``, or a name that /etc/hosts maps to 127.0.1.1). The
    coordinator's own host may resolve its name to loopback: process 0 listens on every
    address."""
    if not place.multi or not place.hosts or place.hosts <= 1 or place.environment == "TPU pod":
        return
    host, _ = _split_address(place.coordinator, place.source("coordinator"))
    this_host = this_host if this_host is not None else socket.gethostname()
    if host.split(".")[0] == this_host.split(".")[0]:
        return
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        try:
            ip = ipaddress.ip_address(resolve_host(host))
        except (OSError, ValueError):
            return  # not resolvable here yet (DNS catching up): the join's timeout says so
    if ip.is_loopback:
        raise ClusterError(
            f"the coordinator {place.coordinator} (from {place.source('coordinator')}) is "
            f"{'' if str(ip) == host else f'{ip}, '}a loopback address on {this_host}, but the "
            f"run spans {place.hosts} hosts: they cannot reach it there; give an address the "
            f"other hosts reach (JAX_COORDINATOR_ADDRESS), or fix /etc/hosts")


def check_timeouts(d) -> None:
    """The ``distributed`` config fields, checked before jax starts (they are used then)."""
    for name, low in (("heartbeat_timeout_s", 1), ("init_timeout_s", 1), ("step_timeout_s", 0)):
        value = d[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < low:
            raise ConfigError(f"distributed.{name}={value!r} must be >= {low} (seconds"
                              f"{'; 0: automatic' if low == 0 else ''})")


def place_or_exit(coordinator=None, num_processes=None, process_id=None,
                  distributed=None) -> Place:
    """``resolve`` for an entry point: a launch that cannot be resolved is one line, exit 2."""
    try:
        if distributed is not None:
            check_timeouts(distributed)
        place = resolve(coordinator, num_processes, process_id)
        check_reachable(place)
        return place
    except (ClusterError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


def default_workdir(name: str, place: Place) -> str:
    """runs/<name>-<time>; the processes of a run must agree on it: runs/<name>-<job id> under
    SLURM or Open MPI (a requeued job keeps its id, so it resumes), else --workdir (one line)."""
    if not place.multi:
        return f"runs/{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    if place.job_id:
        return f"runs/{name}-{place.job_id}"
    print(f"error: a run of {place.num_processes} processes ({place.environment}) needs "
          f"--workdir: every process must write the same directory", file=sys.stderr, flush=True)
    sys.exit(2)


def one_process_or_exit(script: str) -> None:
    """For a script that runs as one process (evaluation, generation): launched as one of
    several (srun -n 4, mpirun -n 4), it would run n times over the same files; one line."""
    try:
        place = resolve()
    except ClusterError as e:
        place = None
        problem = str(e)
    if place is not None and not place.multi:
        return
    if place is None:
        print(f"error: {script} runs as one process, and this launch looks like one of several "
              f"but cannot be read ({problem}); launch it once (srun -n 1, no mpirun)",
              file=sys.stderr, flush=True)
    else:
        print(f"error: {script} runs as one process, but this launch is one of several "
              f"({place.describe()}); launch it once (srun -n 1, no mpirun)",
              file=sys.stderr, flush=True)
    sys.exit(2)
