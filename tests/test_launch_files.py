"""The cluster launch files: scripts/slurm/train.sbatch run through fake srun/scancel/scontrol
(what it launches, when it requeues), and scripts/k8s/train.yaml resolved pod by pod through
parallel/cluster.py (each pod finds its process id and pod 0 as the coordinator)."""
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import yaml

from parallel.cluster import K8S_PORT, resolve

ROOT = pathlib.Path(__file__).resolve().parent.parent
SBATCH = ROOT / "scripts" / "slurm" / "train.sbatch"
MANIFEST = ROOT / "scripts" / "k8s" / "train.yaml"
JOB_ID = "4242"

# Each fake appends its argv (one argument a line, then a blank line) to <name>.argv.
FAKE_SRUN = r"""#!/bin/bash
printf '%s\n' "$@" '' >> "$FAKE_DIR/srun.argv"
echo $$ > "$FAKE_DIR/srun.pid"
if [[ $FAKE_SRUN_EXIT == wait ]]; then
    trap 'echo TERM >> "$FAKE_DIR/srun.signals"; kill $sleeper; exit 0' TERM
    sleep 30 >/dev/null 2>&1 &
    sleeper=$!
    echo $sleeper > "$FAKE_DIR/sleep.pid"
    wait $sleeper
    exit 99  # no TERM came
fi
if [[ -n ${FAKE_TASK_EXIT:-} ]]; then  # one task's own code, as its watcher leaves it
    mkdir -p "$WORKDIR/logs" && echo "$FAKE_TASK_EXIT" > "$WORKDIR/logs/process1.exit"
fi
exit "$FAKE_SRUN_EXIT"
"""
# Stands in for SLURM delivering `scancel --signal=TERM JOB` to the job's steps: the tasks.
FAKE_SCANCEL = r"""#!/bin/bash
printf '%s\n' "$@" '' >> "$FAKE_DIR/scancel.argv"
kill -TERM "$(cat "$FAKE_DIR/srun.pid")"
"""
FAKE_SCONTROL = r"""#!/bin/bash
printf '%s\n' "$@" '' >> "$FAKE_DIR/scontrol.argv"
"""


def calls(tmp_path, name) -> list[list[str]]:
    """The argv of every call of fake ``name``."""
    f = tmp_path / f"{name}.argv"
    if not f.exists():
        return []
    return [c.split("\n") for c in f.read_text().split("\n\n") if c]


@pytest.fixture
def fakes(tmp_path):
    """The environment of a batch job with fake SLURM commands first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scancel", FAKE_SCANCEL),
                       ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
    env.update(PATH=f"{bin_dir}:{env.get('PATH', '/usr/bin:/bin')}", FAKE_DIR=str(tmp_path),
               SLURM_JOB_ID=JOB_ID, SLURM_JOB_NAME="llama", SLURM_RESTART_COUNT="0")
    for knob in ("CONFIG", "WORKDIR", "GPUS_PER_NODE", "MAX_REQUEUES"):
        env.pop(knob, None)
    return env


def run_sbatch(env, **more):
    return subprocess.run(["bash", str(SBATCH), "--config.train.steps=5"], cwd=ROOT,
                          env={**env, **more}, capture_output=True, text=True, timeout=20)


def test_sbatch_parses():
    r = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_sbatch_header():
    header = [line.split(None, 1)[1] for line in SBATCH.read_text().splitlines()
              if line.startswith("#SBATCH")]
    for option in ("--ntasks-per-node=8", "--gpus-per-node=8", "--requeue", "--open-mode=append"):
        assert option in header
    assert any(h.startswith(("--nodes=", "--time=", "--output=")) for h in header)
    signal_opt = next(h for h in header if h.startswith("--signal="))
    assert signal_opt.startswith("--signal=B:") and signal_opt.endswith("@180")


def test_sbatch_launches_one_task_per_gpu(fakes, tmp_path):
    r = run_sbatch(fakes, FAKE_SRUN_EXIT="0")
    assert r.returncode == 0, r.stdout + r.stderr
    [argv] = calls(tmp_path, "srun")
    assert "--kill-on-bad-exit=1" in argv and "--ntasks-per-node=8" in argv
    program = argv[argv.index("python"):]
    assert program == ["python", "train.py", "--config", "configs/llama_7b.py",
                       "--workdir", f"runs/llama-{JOB_ID}", "--config.train.steps=5"]
    assert not any(a.startswith(("--coordinator", "--process_id", "--num_processes"))
                   for a in argv)
    # The knobs.
    r = run_sbatch(fakes, FAKE_SRUN_EXIT="0", CONFIG="configs/tiny.py", WORKDIR="/shared/w",
                   GPUS_PER_NODE="4")
    argv = calls(tmp_path, "srun")[-1]
    assert "--ntasks-per-node=4" in argv
    assert argv[argv.index("--config") + 1] == "configs/tiny.py"
    assert argv[argv.index("--workdir") + 1] == "/shared/w"


@pytest.mark.parametrize("code,restarts,requeued", [
    (0, "0", False),  # done
    (1, "0", False),  # divergence or a bug
    (2, "0", False),  # a user error
    (3, "0", True),  # a peer was lost
    (4, "0", True),  # a process was stuck
    (137, "0", True),  # a task was killed (a lost peer seen through --kill-on-bad-exit)
    (3, "2", True),  # the last restart of MAX_REQUEUES=3
    (3, "3", False),  # all restarts used
])
def test_sbatch_requeues(fakes, tmp_path, code, restarts, requeued):
    r = run_sbatch(fakes, FAKE_SRUN_EXIT=str(code), SLURM_RESTART_COUNT=restarts)
    out = r.stdout + r.stderr
    assert calls(tmp_path, "scontrol") == ([["requeue", JOB_ID]] if requeued else []), out
    assert r.returncode == (0 if requeued else code), out
    decision = [line for line in r.stdout.splitlines() if line.startswith("train.sbatch: srun")]
    assert len(decision) == 1 and f"srun exited {code}" in decision[0], out
    assert ("requeueing (restart" in decision[0]) == requeued
    if requeued:
        assert f"(restart {int(restarts) + 1} of 3)" in decision[0]
    assert calls(tmp_path, "scancel") == []


@pytest.mark.parametrize("task,requeued", [("2", False), ("1", False), ("3", True)])
def test_sbatch_reads_a_failed_task_behind_the_killed_ones(fakes, tmp_path, task, requeued):
    """A task exits 2 (a user error), --kill-on-bad-exit kills the others, srun reports 137:
    the task's own code decides. A stale file from an earlier attempt is removed first."""
    workdir = tmp_path / "w"
    (workdir / "logs").mkdir(parents=True)
    (workdir / "logs" / "process0.exit").write_text("2\n")  # the previous attempt's
    r = run_sbatch(fakes, FAKE_SRUN_EXIT="137", FAKE_TASK_EXIT=task, WORKDIR=str(workdir))
    assert not (workdir / "logs" / "process0.exit").exists()
    assert calls(tmp_path, "scontrol") == ([["requeue", JOB_ID]] if requeued else []), r.stdout
    assert r.returncode == (0 if requeued else int(task)), r.stdout


def test_sbatch_max_requeues_knob(fakes, tmp_path):
    r = run_sbatch(fakes, FAKE_SRUN_EXIT="4", SLURM_RESTART_COUNT="3", MAX_REQUEUES="5")
    assert calls(tmp_path, "scontrol") == [["requeue", JOB_ID]] and r.returncode == 0
    r = run_sbatch(fakes, FAKE_SRUN_EXIT="4", MAX_REQUEUES="three")
    assert r.returncode == 2 and "MAX_REQUEUES=three" in r.stderr
    assert len(calls(tmp_path, "srun")) == 1


def start_waiting(env):
    """The script with a fake srun that runs until its tasks get SIGTERM; returns once it runs."""
    p = subprocess.Popen(["bash", str(SBATCH), "--config.train.steps=5"], cwd=ROOT,
                         env={**env, "FAKE_SRUN_EXIT": "wait"}, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    pid_file = pathlib.Path(env["FAKE_DIR"]) / "sleep.pid"  # written after the TERM trap is set
    deadline = time.monotonic() + 10
    while not (pid_file.exists() and pid_file.read_text().strip()):
        assert p.poll() is None and time.monotonic() < deadline, "the fake srun never started"
        time.sleep(0.02)
    return p


def finish(p):
    try:
        out, _ = p.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        pytest.fail(f"train.sbatch did not end after the signal:\n{out}")
    return p.returncode, out


def test_sbatch_time_limit_signal_saves_and_requeues(fakes, tmp_path):
    # --signal=B:USR1@180: the shell asks SLURM to SIGTERM the tasks (not srun, which would
    # SIGKILL them), waits for them to save and exit 0, then requeues.
    p = start_waiting(fakes)
    p.send_signal(signal.SIGUSR1)
    code, out = finish(p)
    assert calls(tmp_path, "scancel") == [["--signal=TERM", JOB_ID]], out
    assert (tmp_path / "srun.signals").read_text() == "TERM\n", out
    assert calls(tmp_path, "scontrol") == [["requeue", JOB_ID]], out
    assert code == 0 and "requeueing (restart 1 of 3)" in out, out


def test_sbatch_cancel_does_not_requeue(fakes, tmp_path):
    # `scancel JOB` (or preemption) sends SIGTERM to the shell and to the tasks; the tasks dying
    # by a signal must not make a cancelled job requeue itself.
    p = start_waiting(fakes)
    p.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    os.kill(int((tmp_path / "srun.pid").read_text()), signal.SIGKILL)
    os.kill(int((tmp_path / "sleep.pid").read_text()), signal.SIGKILL)
    code, out = finish(p)
    assert calls(tmp_path, "scontrol") == [] and calls(tmp_path, "scancel") == [], out
    assert code == 137 and "not requeueing: the job was cancelled" in out, out


# -- Kubernetes ---------------------------------------------------------------------------------
def manifest():
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    kinds = {d["kind"]: d for d in docs}
    return kinds["Service"], kinds["Job"], kinds.get("PersistentVolumeClaim")


def test_k8s_manifest_shape():
    service, job, claim = manifest()
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    template = job["spec"]["template"]
    labels = template["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    [container] = template["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    n = int(env["JAX_NUM_PROCESSES"])
    assert spec["parallelism"] == spec["completions"] == n > 1
    assert template["spec"]["subdomain"] == service["metadata"]["name"]
    assert template["spec"]["restartPolicy"] == "Never"
    command = container.get("command", []) + container.get("args", [])
    assert command[:2] == ["python", "train.py"]
    assert "--config" in command and "--workdir" in command
    assert command[command.index("--workdir") + 1].startswith("/shared/")
    assert "--coordinator" not in command and "--process_id" not in command
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    claim_name = volumes[mounts["/shared"]]["persistentVolumeClaim"]["claimName"]
    if claim is not None:
        assert claim["metadata"]["name"] == claim_name
        assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    # 1 and 2 fail the Job; 3 and 4 are retried.
    rules = spec["podFailurePolicy"]["rules"]
    fail = [r for r in rules if r["action"] == "FailJob" and "onExitCodes" in r]
    assert len(fail) == 1 and fail[0]["onExitCodes"]["operator"] == "In"
    assert sorted(fail[0]["onExitCodes"]["values"]) == [1, 2]
    assert fail[0]["onExitCodes"].get("containerName", container["name"]) == container["name"]
    assert spec["backoffLimit"] >= n
    text = MANIFEST.read_text()
    assert "kubectl apply -f scripts/k8s/train.yaml" in text
    image = container["image"]
    assert "/" not in image and "." not in image.split(":")[0]  # no registry host


def test_k8s_pods_find_their_place():
    service, job, _ = manifest()
    job_name, svc = job["metadata"]["name"], service["metadata"]["name"]
    [container] = job["spec"]["template"]["spec"]["containers"]
    assert K8S_PORT in [p["containerPort"] for p in container["ports"]]
    n = job["spec"]["parallelism"]
    for i in range(n):
        env = {e["name"]: e["value"] for e in container["env"]}
        env.update(JOB_COMPLETION_INDEX=str(i), HOSTNAME=f"{job_name}-{i}")
        place = resolve(environ=env, fqdn=f"{job_name}-{i}.{svc}.default.svc.cluster.local")
        assert (place.environment, place.process_id, place.num_processes) == (
            "Kubernetes", i, n)
        assert place.coordinator == f"{job_name}-0.{svc}:{K8S_PORT}"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
