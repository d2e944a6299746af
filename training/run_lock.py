"""One run per run directory: each process of a run holds ``WORKDIR/locks/process<i>.lock``.

A second run started on a directory a live run is writing stops in one line (ClusterError, exit
2) before it writes anything, naming the holder (host, pid, start time). The lock is the
kernel's (``flock``), so it goes with the process that held it: a run killed with SIGKILL, or
a host that died, leaves a file but no lock, and a restart takes it. On a shared file system
(NFS, Lustre mounted with ``flock``) the lock holds across hosts; where the file system has no
locks the run says so in one line and goes on unguarded.
"""
from __future__ import annotations

import errno
import fcntl
import os
import pathlib
import socket
import sys
import time

from errors import ClusterError


class RunLock:
    def __init__(self, workdir: pathlib.Path, process_id: int = 0, say=None):
        self.workdir = pathlib.Path(workdir)
        self.path = self.workdir / "locks" / f"process{process_id}.lock"
        self._created = not self.workdir.exists()
        self._fd: int | None = None
        self._say = say or (lambda line: print(line, file=sys.stderr, flush=True))

    def acquire(self) -> "RunLock":
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise ClusterError(f"cannot create the run lock {self.path}: "
                               f"{e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise ClusterError(f"{self.workdir} is in use by a live run ({holder} holds "
                               f"{self.path}): wait for it to end, stop it, or give another "
                               f"--workdir") from None
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                os.close(fd)
                raise
            self._say(f"warning: {self.path.parent} has no file locks ({e.strerror}): a second "
                      f"run on {self.workdir} would not be stopped")
        os.ftruncate(fd, 0)
        os.pwrite(fd, (f"pid {os.getpid()} on {socket.gethostname()} since "
                       f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n").encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Drops the lock; a directory this run created and left holding only the locks (a
        run refused before it wrote anything) is removed."""
        if self._fd is None:
            return
        os.close(self._fd)
        self._fd = None
        if self._created and {p.name for p in self.workdir.iterdir()} == {"locks"}:
            try:
                self.path.unlink()
                self.path.parent.rmdir()
                self.workdir.rmdir()
            except OSError:
                pass  # another process of the run still holds its lock there

    def __enter__(self):
        return self if self._fd is not None else self.acquire()

    def __exit__(self, *exc):
        self.release()
        return False


def hold_or_exit(workdir: pathlib.Path, process_id: int) -> RunLock:
    """The held lock for an entry point; a directory in use is one line, exit 2."""
    try:
        return RunLock(workdir, process_id).acquire()
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
