"""Train a long-context decoder from a config.

    python train.py --config configs/tiny.py --workdir runs/demo --config.train.steps=50

Everything the run writes lands in --workdir (default runs/<config name>-<time>); running the
same command on a directory with checkpoints resumes from the newest complete one. On a CPU,
the config's mesh is simulated (XLA_FLAGS, one line says so) unless XLA_FLAGS already sets a
device count: parallel/host_devices.py has the rule.
"""
import pathlib
import sys
import time

from absl import app, flags, logging
from ml_collections import config_flags

from configs.command_line import check_argv, parse_flags
from parallel.host_devices import multi_process_env, simulate_for_mesh
from training import supervisor

check_argv(sys.argv, "config", "configs/tiny.py")  # a missing file or field: one line, exit 2
_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny.py", "config file", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "run directory (default runs/<name>-<time>)")
_COORDINATOR = flags.DEFINE_string("coordinator", None, "multi-process: HOST:PORT of process 0")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "multi-process: process count")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "multi-process: this process's index")


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # keep the backend probing chatter out of the log
    config = _CONFIG.value
    # Processes of one run must agree on the directory: name it, or let process 0's clock do.
    workdir = pathlib.Path(_WORKDIR.value or f"runs/{config.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    multi = any(f.value is not None for f in (_COORDINATOR, _NUM_PROCESSES, _PROCESS_ID))
    if (multi or multi_process_env()) and not supervisor.watched():
        # The training runs in a watched child: a lost peer ends it in one line (supervisor.py).
        sys.exit(supervisor.supervise(sys.argv, workdir, _PROCESS_ID.value,
                                      config.distributed.heartbeat_timeout_s))
    supervisor.native_stderr_to_log()
    simulate_for_mesh(config.mesh, multi_process=multi)
    from training.entry import main_with_errors  # after the device count is set: imports jax
    sys.exit(main_with_errors(config, workdir, _COORDINATOR.value, _NUM_PROCESSES.value,
                              _PROCESS_ID.value))


if __name__ == "__main__":
    app.run(main, flags_parser=lambda argv: parse_flags(argv, _CONFIG))
