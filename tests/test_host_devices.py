"""parallel/host_devices.py: when a command simulates the config's mesh on the CPU, decided
from the environment alone (jax not imported)."""
import subprocess
import sys

import numpy as np
import pytest

from configs import base, tiny
from parallel import host_devices
from parallel.host_devices import FLAG, PATIENT_COLLECTIVES, mesh_devices, simulate_for_mesh


def mesh(**sizes):
    m = base.get_config().mesh
    m.update(sizes)
    return m


def test_mesh_devices_is_the_product_of_fixed_axes():
    rng = np.random.default_rng()
    d, f, s, t = (int(x) for x in rng.integers(1, 5, size=4))
    assert mesh_devices(mesh(data=d, fsdp=f, sequence=s, tensor=t)) == d * f * s * t
    assert mesh_devices(mesh(data=1, fsdp=-1, sequence=s, tensor=t)) == s * t  # -1 fills
    assert mesh_devices(tiny.get_config().mesh) == 8


@pytest.fixture
def cpu_only(monkeypatch):
    monkeypatch.setattr(host_devices, "accelerator_plugin_installed", lambda: False)


def test_simulates_on_a_cpu_and_appends_to_existing_flags(cpu_only):
    said = []
    env = {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    assert simulate_for_mesh(mesh(fsdp=2, sequence=4), environ=env, say=said.append) == 8
    # one space, no stray tokens (XLA drops every flag after one it cannot parse)
    assert env["XLA_FLAGS"] == f"--xla_dump_to=/tmp/x {FLAG}=8 {PATIENT_COLLECTIVES}"
    assert said == [f"simulating 8 CPU devices for the config's mesh (data=1 fsdp=2 sequence=4 "
                    f"tensor=1): XLA_FLAGS=--xla_dump_to=/tmp/x {FLAG}=8 {PATIENT_COLLECTIVES}"]
    env = {"JAX_PLATFORMS": "cpu"}
    assert simulate_for_mesh(mesh(fsdp=-1, sequence=2), environ=env, say=said.append) == 2
    assert env["XLA_FLAGS"] == f"{FLAG}=2 {PATIENT_COLLECTIVES}"


def test_simulated_devices_wait_longer_at_collectives_unless_the_user_says(cpu_only):
    """XLA aborts a process whose device waits 20 + 40 s at a collective; simulated devices
    share the cores, so they get 20 + 600 s, once, and a user's own timeout is kept."""
    assert PATIENT_COLLECTIVES == "--xla_cpu_collective_call_terminate_timeout_seconds=600"
    env = {"XLA_FLAGS": "--xla_cpu_collective_call_terminate_timeout_seconds=5"}
    assert simulate_for_mesh(mesh(sequence=4), environ=env, say=lambda line: None) == 4
    assert env["XLA_FLAGS"] == f"--xla_cpu_collective_call_terminate_timeout_seconds=5 {FLAG}=4"
    assert host_devices.patient_collectives(PATIENT_COLLECTIVES) == PATIENT_COLLECTIVES


@pytest.mark.parametrize("env,multi_process", [
    ({"XLA_FLAGS": f"{FLAG}=4"}, False),  # the user's count wins
    ({"JAX_PLATFORMS": "cuda"}, False),  # a GPU run
    ({"JAX_PLATFORMS": "tpu,cpu"}, False),
    ({}, True),  # --coordinator / --num_processes / --process_id given
    ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"}, False),
    ({"JAX_NUM_PROCESSES": "2"}, False),
    ({"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n1", "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
      "SLURM_LOCALID": "1"}, False),  # srun -n 2: each process brings its own devices
    ({"OMPI_MCA_orte_hnp_uri": "4096.0;tcp://10.0.0.1:1", "OMPI_COMM_WORLD_SIZE": "2",
      "OMPI_COMM_WORLD_RANK": "0"}, False),
    ({"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n1"}, False),  # a broken step: never simulate
])
def test_leaves_xla_flags_alone(cpu_only, env, multi_process):
    before, said = dict(env), []
    assert simulate_for_mesh(mesh(fsdp=2, sequence=4), multi_process=multi_process, environ=env,
                             say=said.append) == 0
    assert env == before and said == []


def test_one_device_mesh_needs_nothing(cpu_only):
    env, said = {}, []
    assert simulate_for_mesh(mesh(fsdp=-1), environ=env, say=said.append) == 0
    assert env == {} and said == []


def test_an_accelerator_plugin_means_real_devices(monkeypatch):
    monkeypatch.setattr(host_devices, "accelerator_plugin_installed", lambda: True)
    env = {}
    assert simulate_for_mesh(mesh(sequence=8), environ=env, say=lambda line: None) == 0
    assert env == {}
    env = {"JAX_PLATFORMS": "cpu"}  # asked for the CPU explicitly: simulate there
    assert simulate_for_mesh(mesh(sequence=8), environ=env, say=lambda line: None) == 8


def test_deciding_imports_no_jax():
    code = ("import sys; from parallel.host_devices import on_cpu, accelerator_plugin_installed; "
            "on_cpu(); accelerator_plugin_installed(); assert 'jax' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=host_devices.__file__.rsplit(
        "/parallel/", 1)[0])


def test_a_run_directory_simulates_the_mesh_it_trained_on(cpu_only, tmp_path):
    """scripts/eval.py and eval_passkey.py evaluate a run on its own mesh: they simulate it
    from the run's config.json, and leave XLA_FLAGS alone when there is none to read."""
    rng = np.random.default_rng()
    s, t = int(rng.integers(2, 5)), int(rng.integers(1, 3))
    config = tiny.get_config()
    config.mesh.update(data=1, fsdp=2, sequence=s, tensor=t)
    (tmp_path / "config.json").write_text(config.to_json())
    env, said = {}, []
    assert host_devices.simulate_for_run(tmp_path, environ=env, say=said.append) == 2 * s * t
    assert env["XLA_FLAGS"] == f"{FLAG}={2 * s * t} {PATIENT_COLLECTIVES}" and len(said) == 1
    env = {}
    assert host_devices.simulate_for_run(tmp_path / "nowhere", environ=env) == 0 and env == {}
    (tmp_path / "config.json").write_text("{not json")
    assert host_devices.simulate_for_run(tmp_path, environ=env) == 0 and env == {}
