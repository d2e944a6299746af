"""Where a process stands in a run (parallel/cluster.py): flags, JAX_* variables, SLURM, Open MPI
and Kubernetes, their precedence and their coordinator rules checked against JAX's own; then
launches simulated by those variables training as one run, a host that never arrives, and one
run per run directory."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from unittest import mock

import pytest

from errors import ClusterError
from helpers import TWO_PROCESS_TINY, launcher_env
from parallel.cluster import (K8S_PORT, Place, check_reachable, expand_nodelist, resolve,
                              tasks_per_node)
from parallel.host_devices import local_device_ids

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def slurm(i=0, n=2, nodes="node[001-002]", job="70000", **more):
    per = n // 2 if n % 2 == 0 else n  # tasks per node: the step spans two nodes when it can
    env = {"SLURM_JOB_ID": job, "SLURM_STEP_NODELIST": nodes, "SLURM_NTASKS": str(n),
           "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i % per), "SLURM_NODEID": str(i // per),
           "SLURM_STEP_TASKS_PER_NODE": f"{per}(x{n // per})"}
    return {**env, **more}


def ompi(i=0, n=4, uri="1531576320.0;tcp://10.96.0.1,10.148.0.1:34911", **more):
    env = {"OMPI_MCA_orte_hnp_uri": uri, "OMPI_COMM_WORLD_SIZE": str(n),
           "OMPI_COMM_WORLD_RANK": str(i), "OMPI_COMM_WORLD_LOCAL_RANK": str(i % 2),
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    return {**env, **more}


def k8s(i=0, n=4, **more):
    return {"JOB_COMPLETION_INDEX": str(i), "HOSTNAME": f"train-{i}", "JAX_NUM_PROCESSES": str(n),
            **more}


@pytest.mark.parametrize("text,hosts", [
    ("node001", ["node001"]),
    ("a,b", ["a", "b"]),
    ("node[001-004,007]", ["node001", "node002", "node003", "node004", "node007"]),
    ("node[001-0015],host2", [f"node{k:03d}" for k in range(1, 16)] + ["host2"]),
    ("node[007,001-002],x", ["node007", "node001", "node002", "x"]),
    ("gpu[3-4]-ib", ["gpu3-ib", "gpu4-ib"]),  # JAX's rule gives gpu3: it drops the suffix
    ("r[1-2]n[08-09]", ["r1n08", "r1n09", "r2n08", "r2n09"]),
])
def test_slurm_host_lists(text, hosts):
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize("text", ["node[001-004", "node[a-b]", "", "n[1-2]]"])
def test_a_malformed_host_list_is_one_line(text):
    with pytest.raises(ClusterError, match="is not a SLURM host list|not a list of numbers"):
        expand_nodelist(text)


def test_tasks_per_node():
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert tasks_per_node("8") == [8]
    with pytest.raises(ClusterError, match="SLURM_STEP_TASKS_PER_NODE='2x3' is not like 2"):
        tasks_per_node("2x3")


@pytest.mark.parametrize("nodes", ["node001", "node001,host2", "node[001-0015],host2",
                                   "node[001,007-015],host2", "a,b", "node[007,001-003]"])
@pytest.mark.parametrize("port", [None, "4321"])
def test_slurm_coordinator_is_jax_own(nodes, port):
    """Our rule against jax._src.clusters' SlurmCluster, so that a change in JAX shows."""
    from jax._src.clusters.slurm_cluster import SlurmCluster
    env = slurm(nodes=nodes, job=str(70000 + len(nodes)))
    if port:
        env["JAX_COORDINATOR_PORT"] = port
    with mock.patch.dict(os.environ, env, clear=True):
        assert resolve(environ=env).coordinator == SlurmCluster.get_coordinator_address(None, port)
        assert resolve(environ=env).num_processes == SlurmCluster.get_process_count()


@pytest.mark.parametrize("uri", ["1531576320.0;tcp://10.96.0.1,10.148.0.1,10.108.0.1:34911",
                                 "1314521088.0;tcp6://[fe80::b9b:ac5d:9cf0:b858,2620::2]:43370",
                                 "3000000000.0;tcp://node7:1234"])
def test_openmpi_coordinator_is_jax_own(uri):
    from jax._src.clusters.ompi_cluster import OmpiCluster
    env = ompi(uri=uri)
    with mock.patch.dict(os.environ, env, clear=True):
        want = OmpiCluster.get_coordinator_address(None, None)
    got = resolve(environ=env).coordinator
    assert got.replace("[", "").replace("]", "") == want  # ours brackets an IPv6 host


def test_places_and_precedence():
    p = resolve(environ=slurm(i=3, n=4, nodes="node[001-002]"))
    assert (p.environment, p.process_id, p.num_processes, p.coordinator) == (
        "SLURM", 3, 4, f"node001:{70000 % 4096 + 61440}")
    assert (p.local_rank, p.local_size, p.hosts, p.job_id) == (1, 2, 2, "70000")
    assert p.describe() == (
        "SLURM: coordinator node001:61808 (SLURM_STEP_NODELIST, port SLURM_JOB_ID % 4096 + 61440), "
        "process 3 of 4 (SLURM_PROCID, SLURM_NTASKS), task 1 of 2 on this host")
    # JAX_* beat SLURM field by field; flags beat both.
    p = resolve(environ=slurm(i=1, JAX_COORDINATOR_ADDRESS="10.0.0.5:1234"))
    assert (p.environment, p.coordinator, p.process_id) == ("SLURM", "10.0.0.5:1234", 1)
    assert p.source("coordinator") == "JAX_COORDINATOR_ADDRESS"
    p = resolve("h:1", 3, 2, environ=slurm(i=1, JAX_PROCESS_ID="0"))
    assert (p.environment, p.coordinator, p.num_processes, p.process_id) == ("flags", "h:1", 3, 2)
    p = resolve(environ={"JAX_COORDINATOR_ADDRESS": "h:2", "JAX_NUM_PROCESSES": "2",
                         "JAX_PROCESS_ID": "1", **ompi(i=3)})
    assert (p.environment, p.num_processes, p.process_id) == ("JAX_* variables", 2, 1)
    # SLURM before Open MPI before Kubernetes.
    assert resolve(environ={**k8s(i=2), **ompi(i=1), **slurm(i=0)}).environment == "SLURM"
    assert resolve(environ={**k8s(i=2), **ompi(i=1)}).process_id == 1
    p = resolve(environ=ompi(i=2))
    assert (p.environment, p.coordinator, p.hosts, p.job_id) == (
        "Open MPI", "10.96.0.1:62624", 2, "1531576320")
    # Kubernetes: pod 0 of this pod's job, through its headless service.
    p = resolve(environ=k8s(i=2), fqdn="train-2.trainers.default.svc.cluster.local")
    assert (p.environment, p.process_id, p.num_processes, p.coordinator) == (
        "Kubernetes", 2, 4, "train-0.trainers:55527")
    p = resolve(environ=k8s(i=2, JAX_COORDINATOR_ADDRESS="js-w-0-0.js:8476"), fqdn="nothing")
    assert p.coordinator == "js-w-0-0.js:8476"  # XPK's form wins
    from jax._src.clusters.k8s_cluster import K8sCluster
    assert K8S_PORT == int(K8sCluster._coordinator_port)
    # GKE's TPU JobSets set JOB_COMPLETION_INDEX too: a TPU pod is JAX's to detect.
    p = resolve(environ={**k8s(i=1, n=2), "TPU_WORKER_HOSTNAMES": "t0,t1", "TPU_WORKER_ID": "1"})
    assert (p.environment, p.process_id, p.num_processes) == ("TPU pod", 1, 2)


def test_one_process_places():
    assert resolve(environ={}) == Place("one process")
    # A batch script or salloc shell is not a step: one process, even with SLURM_NTASKS=8.
    env = slurm(n=8)
    del env["SLURM_STEP_NODELIST"]
    assert not resolve(environ=env).multi
    assert not resolve(environ=slurm(i=0, n=1, nodes="n1")).multi  # srun -n 1
    assert not resolve(None, 1, None, environ={}).multi


@pytest.mark.parametrize("env,flags,message", [
    ({**slurm(), "SLURM_PROCID": "x"}, {}, "SLURM_PROCID='x' is not a whole number"),
    ({k: v for k, v in slurm().items() if k != "SLURM_LOCALID"}, {},
     "a SLURM step (SLURM_STEP_NODELIST=node[001-002]) without SLURM_LOCALID: launch the tasks "
     "with srun"),
    (slurm(i=2), {}, "SLURM_PROCID=2 is not a process of a run of 2 (SLURM_NTASKS): valid ids are 0..1"),
    (slurm(nodes="node[1-2"), {}, "SLURM_STEP_NODELIST='node[1-2' is not a SLURM host list"),
    ({**slurm(), "JAX_COORDINATOR_PORT": "70000"}, {}, "JAX_COORDINATOR_PORT=70000 is not a port"),
    ({k: v for k, v in ompi().items() if k != "OMPI_MCA_orte_hnp_uri"}, {},
     "Open MPI without OMPI_MCA_orte_hnp_uri (Open MPI 5 no longer sets it): give the "
     "coordinator as JAX_COORDINATOR_ADDRESS"),
    ({k: v for k, v in k8s().items() if k != "JAX_NUM_PROCESSES"}, {},
     "Kubernetes: the number of processes is unknown (process id from JOB_COMPLETION_INDEX): "
     "give --num_processes or JAX_NUM_PROCESSES"),
    (k8s(i=1), {"fqdn": "train-1"}, "Kubernetes: this pod (train-1) has no subdomain"),
    ({**k8s(i=1), "HOSTNAME": "worker"}, {}, "HOSTNAME='worker' is not <job>-1"),
    ({}, {"num_processes": 2}, "flags: a run of 2 processes (--num_processes) but this "
     "process's index is unknown: give --process_id or JAX_PROCESS_ID, or launch with srun"),
    ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}, {},
     "JAX_* variables: a run of 2 processes needs a coordinator: give --coordinator HOST:PORT "
     "or JAX_COORDINATOR_ADDRESS"),
    ({}, {"coordinator": "nohost", "num_processes": 2, "process_id": 0},
     "--coordinator='nohost' is not HOST:PORT"),
])
def test_a_launch_that_cannot_be_resolved_is_one_line(env, flags, message):
    fqdn = flags.pop("fqdn", None)
    with pytest.raises(ClusterError) as e:
        resolve(**flags, environ=env, fqdn=fqdn)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_loopback_coordinator_is_refused_for_a_run_across_hosts():
    across = resolve(environ=slurm(i=1, JAX_COORDINATOR_ADDRESS="localhost:1234"))
    with pytest.raises(ClusterError, match=r"the coordinator localhost:1234 \(from "
                       r"JAX_COORDINATOR_ADDRESS\) is 127.0.0.1, a loopback address on node002, "
                       r"but the run spans 2 hosts"):
        check_reachable(across, resolve_host=lambda h: "127.0.0.1", this_host="node002")
    # /etc/hosts mapping the coordinator's name to 127.0.1.1: wrong on another host, fine on its own.
    named = resolve(environ=slurm(i=1))
    with pytest.raises(ClusterError, match="is 127.0.1.1, a loopback address"):
        check_reachable(named, resolve_host=lambda h: "127.0.1.1", this_host="node002")
    check_reachable(named, resolve_host=lambda h: "127.0.1.1", this_host="node001")
    check_reachable(named, resolve_host=lambda h: "10.1.2.3", this_host="node002")
    one_host = resolve(environ=slurm(i=1, nodes="localhost"))
    check_reachable(one_host, resolve_host=lambda h: "127.0.0.1", this_host="vm")


@pytest.mark.parametrize("rank,size,visible,bound,ids", [
    (0, 1, list("01234567"), False, None),  # one process per host: every GPU
    (3, 8, list("01234567"), False, [3]),  # one per GPU
    (1, 2, list("01234567"), False, [4, 5, 6, 7]),  # two per host, four GPUs each
    (5, 8, ["5"], False, None),  # the launcher bound one GPU per task already
    (1, 2, list("0123"), True, None),  # SLURM_GPUS_PER_TASK: bound already
    (0, 4, [], False, None),  # no GPU seen: the CPU
])
def test_one_process_per_gpu_or_per_host(rank, size, visible, bound, ids):
    assert local_device_ids(rank, size, visible, bound) == ids


@pytest.mark.parametrize("visible,message", [
    ("012345", "6 GPUs visible to 4 tasks on this host: they do not split evenly"),
    ("01", "2 GPUs visible to 4 tasks on this host: fewer GPUs than tasks"),
])
def test_gpus_that_do_not_split_over_the_tasks_are_one_line(visible, message):
    with pytest.raises(ClusterError, match=message):
        local_device_ids(0, 4, list(visible))


def test_launch_local_gives_each_gpu_process_its_share(tmp_path):
    """--platform gpu without a cluster: each process sees its share as CUDA_VISIBLE_DEVICES."""
    show = tmp_path / "show.py"
    show.write_text("import os, sys\nprint('visible', os.environ['CUDA_VISIBLE_DEVICES'], "
                    "sys.argv[sys.argv.index('--process_id') + 1])\n")
    proc = subprocess.run(
        [sys.executable, "scripts/launch_local.py", "--platform", "gpu", "--processes", "2", "--",
         str(show)], cwd=ROOT, env={**env(), "CUDA_VISIBLE_DEVICES": "3,5,6,7"},
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == ["[p0] visible 3,5 0", "[p1] visible 6,7 1"]


# -- launches on this machine -----------------------------------------------------------------
SMALL = TWO_PROCESS_TINY
env = launcher_env


def launch(tmp, as_cluster):
    """Two processes of train.py; one layer: its program compiles in about two thirds of the
    time of two (a scan of length 1), and nothing here depends on depth."""
    cmd = [sys.executable, "scripts/launch_local.py", "--processes", "2", "--as", as_cluster,
           "--", "train.py", "--config", "configs/tiny.py", "--workdir", str(tmp / "run"),
           f"--config.data.cache_dir={ROOT}/.cache/data", *SMALL, "--config.model.num_layers=1"]
    return subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The 2-process run (a ring of 2 over gloo) launched with only the variables srun sets:
    scripts/launch_local.py --as slurm."""
    tmp = tmp_path_factory.mktemp("slurm")
    return tmp, launch(tmp, "slurm")


def records(workdir):
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_two_process_launcher_trains_and_processes_agree(launched):
    tmp, proc = launched
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    finals = dict(re.findall(r"\[p(\d)\] process \d/2: final loss ([0-9.]+)", proc.stdout))
    assert set(finals) == {"0", "1"}, proc.stdout[-3000:]
    assert finals["0"] == finals["1"]
    assert [r["step"] for r in records(tmp / "run")] == [1, 2]
    assert f"{records(tmp / 'run')[-1]['loss']:.6f}" == finals["0"]


STARTUP = {
    "slurm": r"SLURM: coordinator localhost:{port} \(SLURM_STEP_NODELIST, port SLURM_JOB_ID % 4096 "
             r"\+ 61440\), process {i} of 2 \(SLURM_PROCID, SLURM_NTASKS\), task {i} of 2 on this "
             r"host",
    "openmpi": r"Open MPI: coordinator 127.0.0.1:{port} \(OMPI_MCA_orte_hnp_uri, port jobid / 4096 "
               r"% 4096 \+ 61440\), process {i} of 2 \(OMPI_COMM_WORLD_RANK, "
               r"OMPI_COMM_WORLD_SIZE\), task {i} of 2 on this host",
    "k8s": r"Kubernetes: coordinator 127.0.0.1:{port} \(JAX_COORDINATOR_ADDRESS\), process {i} "
           r"of 2 \(JOB_COMPLETION_INDEX, JAX_NUM_PROCESSES\)",
}


@pytest.mark.parametrize("as_cluster", ["slurm", "openmpi", "k8s"])
def test_a_cluster_launch_needs_no_flags_and_trains_as_one_run(as_cluster, monkeypatch, request):
    """Only the variables srun / mpirun / an Indexed Job set (scripts/launch_local.py --as):
    train.py's entry (place_or_exit) gives each process the place the flags the launcher gives
    otherwise would (--coordinator 127.0.0.1:PORT --num_processes 2 --process_id i), so
    jax.distributed starts the same run (the same initialize call; test_multiprocess.py trains
    it with those flags), and the startup line says where each place came from. The SLURM launch
    runs end to end: one metrics.jsonl (test_two_process_launcher_*), both processes' startup
    lines, logs and exit codes."""
    import socket

    import jax

    from configs import tiny
    from parallel.cluster import PORT_BASE, place_or_exit
    from parallel.distributed import cluster_env, free_port, initialize
    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **kw: calls.append((a, kw)))
    monkeypatch.setattr(jax.config, "update", lambda *a, **kw: None)  # the gloo setting
    port = free_port(PORT_BASE, 65535)
    clean = {k: v for k, v in os.environ.items() if k not in ("JOB_COMPLETION_INDEX", "HOSTNAME")
             and not k.startswith(("SLURM_", "OMPI_", "JAX_", "TPU_"))}
    for i in (0, 1):
        with mock.patch.dict(os.environ, {**clean, "JAX_PLATFORMS": "cpu",
                                          **cluster_env(as_cluster, i, 2, port)}, clear=True):
            place = place_or_exit(distributed=tiny.get_config().distributed)
        flagged = resolve(f"127.0.0.1:{port}", 2, i, environ={})
        assert re.fullmatch(STARTUP[as_cluster].format(i=i, port=port), place.describe())
        line = initialize(place)
        assert line.startswith(place.describe() + f"; {len(jax.local_devices())} local cpu")
        initialize(flagged)
        (got, got_kw), (want, want_kw) = calls[-2:]
        host, _, got_port = got[0].rpartition(":")
        assert (socket.gethostbyname(host), got_port) == ("127.0.0.1", str(port))
        assert got[1:] == () and want == (f"127.0.0.1:{port}",) and got_kw == want_kw, calls
        assert (got_kw["num_processes"], got_kw["process_id"]) == (2, i)
    if as_cluster != "slurm":
        return
    tmp, proc = request.getfixturevalue("launched")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for i in (0, 1):
        startup = STARTUP["slurm"].format(i=i, port=r"\d+")
        assert re.search(rf"\[p{i}\] {startup}; 1 local cpu device", proc.stdout), \
            proc.stdout[-3000:]
    logs = tmp / "run" / "logs"
    assert sorted(p.name for p in logs.iterdir()) == [
        "process0.exit", "process0.log", "process1.exit", "process1.log"]
    assert [(logs / f"process{i}.exit").read_text() for i in (0, 1)] == ["0\n", "0\n"]


def test_a_host_that_never_arrives_ends_the_run_in_one_line(tmp_path):
    """Process 0 of a SLURM step of 2, alone: after distributed.init_timeout_s, one line naming
    the coordinator and the variables it came from."""
    from parallel.cluster import PORT_BASE
    from parallel.distributed import cluster_env, free_port
    port = free_port(PORT_BASE, 65535)
    cmd = [sys.executable, "train.py", "--config", "configs/tiny.py", "--workdir",
           str(tmp_path / "run"), "--config.distributed.init_timeout_s=5", *SMALL]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env={**env(), **cluster_env("slurm", 0, 2, port)},
                          capture_output=True, text=True, timeout=120)
    took = time.monotonic() - start
    assert proc.returncode == 3 and took < 60, (proc.returncode, took, proc.stderr[-3000:])
    assert proc.stderr.splitlines() == [
        f"error: the run did not start: process 0 waited distributed.init_timeout_s=5 s for all 2 "
        f"processes to join at coordinator localhost:{port} (from SLURM_STEP_NODELIST, port "
        f"SLURM_JOB_ID % 4096 + 61440); check that every process was launched and that this host "
        f"reaches that address (details: {tmp_path / 'run' / 'logs' / 'process0.log'})"]


def test_one_run_per_run_directory_and_a_dead_run_leaves_no_lock(tmp_path):
    workdir = tmp_path / "run"
    base = [sys.executable, "train.py", "--config", "configs/tiny.py", "--workdir", str(workdir),
            f"--config.data.cache_dir={ROOT}/.cache/data", *SMALL, "--config.mesh.sequence=1"]
    first = subprocess.Popen([*base, "--config.train.steps=100000"], cwd=ROOT, env=env(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lock = workdir / "locks" / "process0.lock"
    deadline = time.monotonic() + 60
    while not (lock.exists() and lock.read_text().startswith(f"pid {first.pid} ")):
        assert first.poll() is None and time.monotonic() < deadline, first.stderr.read()
        time.sleep(0.05)
    second = subprocess.run(base, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=60)
    assert second.returncode == 2
    assert re.fullmatch(
        rf"error: {re.escape(str(workdir))} is in use by a live run \(pid {first.pid} on \S+ "
        rf"since [-0-9: ]+ holds {re.escape(str(lock))}\): wait for it to end, stop it, or give "
        rf"another --workdir\n", second.stderr), second.stderr
    first.send_signal(signal.SIGKILL)
    first.wait()
    # The killed run's lock went with it: a restart takes it (train.py's own hold_or_exit).
    from training.run_lock import hold_or_exit
    with hold_or_exit(workdir, 0):
        assert lock.read_text().startswith(f"pid {os.getpid()} ")


def test_an_evaluation_script_launched_as_several_processes_stops_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "scripts/generate.py", "--run", str(tmp_path),
                           "--prompt", "x"], cwd=ROOT, env={**env(), **slurm(i=1, nodes="h")},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "error: scripts/generate.py runs as one process, but this launch is one of several "
        "(SLURM: coordinator h:61808 (SLURM_STEP_NODELIST, port SLURM_JOB_ID % 4096 + 61440), "
        "process 1 of 2 (SLURM_PROCID, SLURM_NTASKS)); launch it once (srun -n 1, no mpirun)"]
