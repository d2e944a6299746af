"""Train a long-context decoder from a config.

    python train.py --config configs/tiny.py --workdir runs/demo --config.train.steps=50

Everything the run writes lands in --workdir (default runs/<config name>-<time>); running the
same command on a directory with checkpoints resumes from the newest complete one. On a CPU,
the config's mesh is simulated (XLA_FLAGS, one line says so) unless XLA_FLAGS already sets a
device count: parallel/host_devices.py has the rule. Under srun, mpirun or a Kubernetes Indexed
Job every process finds its place from the launcher's variables, with no flags
(parallel/cluster.py, docs/clusters.md).
"""
import pathlib
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from configs.command_line import check_argv, parse_flags
from parallel.cluster import default_workdir, place_or_exit
from parallel.host_devices import simulate_for_mesh
from training import supervisor
from training.run_lock import hold_or_exit

check_argv(sys.argv, "config", "configs/tiny.py")  # a missing file or field: one line, exit 2
_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny.py", "config file", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "run directory (default runs/<name>-<time>)")
# Not needed under srun, mpirun or Kubernetes: parallel/cluster.py reads their variables.
_COORDINATOR = flags.DEFINE_string("coordinator", None, "multi-process: HOST:PORT of process 0")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "multi-process: process count")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "multi-process: this process's index")


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # keep the backend probing chatter out of the log
    config = _CONFIG.value
    # Process i of n, from the flags or what srun / mpirun / Kubernetes left in the environment.
    place = place_or_exit(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
                          config.distributed)
    workdir = pathlib.Path(_WORKDIR.value or default_workdir(config.name, place))
    if place.multi and not supervisor.watched():
        # The training runs in a watched child: a lost peer ends it in one line (supervisor.py).
        with hold_or_exit(workdir, place.process_id):
            sys.exit(supervisor.supervise(sys.argv, workdir, place, config.distributed))
    supervisor.native_stderr_to_log()
    simulate_for_mesh(config.mesh, multi_process=place.multi)
    from training.entry import main_with_errors  # after the device count is set: imports jax
    if place.multi:  # the watcher above holds this process's lock
        sys.exit(main_with_errors(config, workdir, place))
    with hold_or_exit(workdir, 0):
        sys.exit(main_with_errors(config, workdir, place))


if __name__ == "__main__":
    app.run(main, flags_parser=lambda argv: parse_flags(argv, _CONFIG))
