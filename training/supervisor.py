"""One process of a multi-process run, watched: a peer that stops answering ends the run with
one line, not a native stack dump.

When a peer dies or hangs, jax.distributed ends the survivors from native code: the
coordination service misses the peer's heartbeats for ``distributed.heartbeat_timeout_s`` and
every process aborts (``LOG(FATAL)``, SIGABRT), and a process whose coordinator (process 0)
vanished aborts at once. No Python runs after that. So train.py, given ``--coordinator``,
runs the training in a child process whose native stderr (glog, gloo, faulthandler) goes to
``WORKDIR/logs/process<i>.log`` while Python's own lines still reach the terminal; this
parent imports nothing heavy, forwards SIGTERM/SIGINT, and turns an abnormal end of the child
into one line: which process stopped answering, the newest complete checkpoint, and that the
same command on every host resumes. Checkpoints are whole or absent (orbax renames a finished
write into place), so the newest complete one is always a step directory with its marker. A
run whose processes never all joined (``distributed.init_timeout_s``) ends the same way, its
line naming the coordinator and where its address came from. A stuck run is the child's own
to report (training/watchdog.py, exit code STUCK), as are its user errors.
"""
from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time
import traceback

from checkpoints.storage import COMMIT_MARKER  # orbax-free

LOG_ENV = "STRIPEDJAX_NATIVE_LOG"  # set for the child: where its native stderr goes
PEER_LOST = 3  # the exit code of a run ended by a lost peer


def supervise(argv: list[str], workdir: pathlib.Path, place, distributed) -> int:
    """Runs ``python argv`` (train.py's own command line) as the watched child; its exit code,
    or PEER_LOST with the one line when it ended abnormally. ``place`` is the process's place
    in the run (parallel/cluster.py), ``distributed`` the config's timeouts. The code is also
    left in ``WORKDIR/logs/process<i>.exit``: srun reports only the highest code of its tasks,
    and with --kill-on-bad-exit a task's 2 (a user error) shows as the others' 137 (killed),
    so scripts/slurm/train.sbatch reads these to decide whether to requeue."""
    process_id = place.process_id
    workdir = workdir.absolute()
    log = workdir / "logs" / f"process{process_id}.log"
    exit_file = log.with_suffix(".exit")
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")  # this launch's native output only
    exit_file.unlink(missing_ok=True)
    code = _watch(argv, workdir, place, distributed, log)
    try:
        exit_file.write_text(f"{code}\n")
    except OSError:
        pass  # the exit code itself still says it
    return code


def _watch(argv, workdir, place, distributed, log) -> int:
    process_id = place.process_id
    child = subprocess.Popen(
        [sys.executable, *argv, "--workdir", str(workdir)], env={**os.environ, LOG_ENV: str(log)},
        start_new_session=True, preexec_fn=_die_with_parent)  # its own group: we forward signals

    def forward(signum, frame):
        child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    code = child.wait()
    if code >= 0 and code != PEER_LOST:
        return code  # done, a user error, a divergence, or a stuck run (watchdog.STUCK): said
    text = log.read_text(errors="replace")
    heartbeat_s = distributed.heartbeat_timeout_s
    if never_joined(text):
        line = (f"the run did not start: process {process_id} waited distributed.init_timeout_s="
                f"{distributed.init_timeout_s} s for all {place.num_processes} processes to join at "
                f"coordinator {place.coordinator} (from {place.source('coordinator')}); check that "
                f"every process was launched and that this host reaches that address (details: "
                f"{log})")
        print(f"error: {line}", file=sys.stderr, flush=True)
        return PEER_LOST
    print(f"error: {lost_line(text, code, process_id, heartbeat_s, workdir, log)}",
          file=sys.stderr, flush=True)
    lost = code == PEER_LOST or _peer_named(text, heartbeat_s)[0] is not None
    return PEER_LOST if lost else 128 - code


def never_joined(text: str) -> bool:
    """Whether the native log shows jax.distributed giving up on gathering the run: process 0
    waiting for the others, or another one for the coordinator."""
    return "RegisterTask" in text and "DEADLINE_EXCEEDED" in text


def lost_line(text: str, code: int, process_id: int, heartbeat_timeout_s: int,
              workdir: pathlib.Path, log: pathlib.Path) -> str:
    """What ended this process, the newest complete checkpoint and how to resume, one line."""
    peer, how = _peer_named(text, heartbeat_timeout_s)
    if peer is not None:
        what = f"process {peer} stopped answering ({how}), so process {process_id} stopped"
    elif code == PEER_LOST:
        what = f"a peer of process {process_id} stopped answering, so it stopped"
    else:
        what = f"process {process_id} was ended by {signal.Signals(-code).name}"
    return f"{what}; {resume_tail(workdir)} (details: {log})"


def resume_tail(workdir: pathlib.Path) -> str:
    """The newest complete checkpoint and how to go on from it."""
    step = newest_complete(workdir / "checkpoints")
    kept = (f"newest complete checkpoint: step {step} ({workdir / 'checkpoints' / str(step)})"
            if step is not None else "no checkpoint was complete yet")
    return f"{kept}; rerun the same command on every host to resume"


def _peer_named(text: str, heartbeat_timeout_s: int) -> tuple[int | None, str]:
    """(the process the coordination service declared dead, how it showed), or process 0 when
    the coordinator itself went away; (None, "") when the log names neither."""
    m = (re.search(r"stopped sending heartbeats\):\s*\n\s*(\d+)", text)
         or re.search(r"Task (\d+) heartbeat timeout", text))
    if m:
        return int(m.group(1)), (f"no heartbeat for distributed.heartbeat_timeout_s="
                                 f"{heartbeat_timeout_s} s")
    if "CoordinationService/PollForError" in text or "Failed to send RPC to coordination service" in text:
        return 0, "the coordinator's connection closed"
    return None, ""


def newest_complete(directory: pathlib.Path) -> int | None:
    steps = [int(p.name) for p in directory.glob("*")
             if p.name.isdigit() and (p / COMMIT_MARKER).is_file()] if directory.is_dir() else []
    return max(steps, default=None)


def _die_with_parent():
    """The child gets SIGKILL when this process dies (Linux): a host that dies takes both."""
    try:
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


# -- in the child -----------------------------------------------------------------------------
def watched() -> bool:
    """Whether this process is the watched child of ``supervise``."""
    return bool(os.environ.get(LOG_ENV))


def native_stderr_to_log() -> None:
    """In the watched child: fd 2 (native code's stderr) goes to the log, and so do the traces
    of background threads (orbax's saves meeting a lost peer); Python's sys.stderr keeps the
    terminal for the run's own one-line errors."""
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    terminal = os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stderr = os.fdopen(terminal, "w", buffering=1)
    log = os.fdopen(os.dup(2), "w", buffering=1)

    def to_log(what):
        traceback.print_exception(what.exc_type, what.exc_value, what.exc_traceback, file=log)

    threading.excepthook = sys.unraisablehook = to_log


def end_for_lost_peer(e: BaseException, heartbeat_timeout_s: int) -> None:
    """A collective failed because a peer is gone: writes the trace to the native log, waits
    for the coordination service to name the peer (it aborts this process within the heartbeat
    timeout), and exits PEER_LOST should it not."""
    with os.fdopen(os.dup(2), "w") as native:
        traceback.print_exception(e, file=native)
    time.sleep(heartbeat_timeout_s + 10)
    os._exit(PEER_LOST)
