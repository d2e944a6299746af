"""One run per run directory: each process of a run holds ``WORKDIR/locks/process<i>.lock``.

A second run started on a directory a live run is writing stops in one line (ClusterError, exit
2) before it writes anything, naming the holder (host, pid, start time). The lock is the
kernel's (``flock``), so it goes with the process that held it: a run killed with SIGKILL, or
a host that died, leaves a file but no lock, and a restart takes it. On a shared file system
(NFS, Lustre mounted with ``flock``) the lock holds across hosts; where the file system has no
locks the run says so in one line and goes on unguarded. There a dead host's lock outlives it
until its lease expires (NFSv4: about 90 s), so a lock held from another host is waited for, up
to two minutes, before the run gives up.
"""
from __future__ import annotations

import errno
import fcntl
import os
import pathlib
import socket
import sys
import time

from errors import ClusterError, StorageError, UserError

OTHER_HOST_WAIT_S = 120.0


class RunLock:
    def __init__(self, workdir: pathlib.Path, process_id: int = 0, say=None):
        self.workdir = pathlib.Path(workdir)
        self.path = self.workdir / "locks" / f"process{process_id}.lock"
        self._created = not self.workdir.exists()
        self._fd: int | None = None
        self._say = say or (lambda line: print(line, file=sys.stderr, flush=True))

    def acquire(self, wait_s: float = OTHER_HOST_WAIT_S) -> "RunLock":
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise StorageError(f"cannot create the run lock {self.path}: "
                               f"{e.strerror or e}") from None
        deadline, said = time.monotonic() + wait_s, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
                host = holder.split(" on ", 1)[1].split(" since ")[0] if " on " in holder else ""
                # On a shared file system a dead host's lock lasts until its lease expires
                # (NFSv4: about 90 s): a requeued run on another host waits that out.
                if host and host != socket.gethostname() and time.monotonic() < deadline:
                    if not said:
                        self._say(f"waiting up to {wait_s:.0f} s for {self.path} ({holder}): "
                                  f"a lock a dead host left on a shared file system expires")
                        said = True
                    time.sleep(2)
                    continue
                os.close(fd)
                raise ClusterError(f"{self.workdir} is in use by a live run "
                                   f"({holder or 'another process'} holds {self.path}): wait for "
                                   f"it to end, stop it, or give another --workdir") from None
            except OSError as e:
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    os.close(fd)
                    raise StorageError(f"cannot lock {self.path}: {e.strerror or e}") from None
                self._say(f"warning: {self.path.parent} has no file locks ({e.strerror}): a "
                          f"second run on {self.workdir} would not be stopped")
                break
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (f"pid {os.getpid()} on {socket.gethostname()} since "
                           f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n").encode(), 0)
        except OSError as e:
            os.close(fd)
            raise StorageError(f"cannot write the run lock {self.path}: "
                               f"{e.strerror or e}") from None
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
    """The held lock for an entry point; a directory in use (or unwritable) is one line, exit 2."""
    try:
        return RunLock(workdir, process_id).acquire()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
