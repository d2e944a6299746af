"""One run per run directory (training/run_lock.py), in one process: flock conflicts between two
open files of one process as between two processes. The end-to-end runs (a second train.py
refused, a SIGKILLed run leaving no lock) are in test_cluster.py."""
import fcntl
import os
import threading
import time

import pytest

from errors import ClusterError
from training.run_lock import RunLock


def hold(path, text):
    """Another holder: an open file with the lock, written as its holder would."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.pwrite(fd, text.encode(), 0)
    return fd


def test_a_second_holder_is_refused_and_a_released_lock_is_free(tmp_path):
    said = []
    first = RunLock(tmp_path / "run", 1, say=said.append).acquire()
    text = (tmp_path / "run" / "locks" / "process1.lock").read_text()
    assert text.startswith(f"pid {os.getpid()} on ")
    with pytest.raises(ClusterError, match=rf"is in use by a live run \({text.strip()} holds "):
        RunLock(tmp_path / "run", 1).acquire()
    RunLock(tmp_path / "run", 0).acquire().release()  # another process of the same run
    first.release()
    with RunLock(tmp_path / "run", 1):
        pass
    assert said == []


def test_a_refused_run_leaves_no_directory_behind(tmp_path):
    with RunLock(tmp_path / "new", 0):
        assert (tmp_path / "new" / "locks").is_dir()
    assert not (tmp_path / "new").exists()
    (tmp_path / "kept").mkdir()
    with RunLock(tmp_path / "kept", 0):
        pass
    assert (tmp_path / "kept").is_dir()  # it was there before


def test_a_lock_held_from_another_host_is_waited_for(tmp_path):
    """A dead host's lock on a shared file system lasts until its lease expires."""
    path = tmp_path / "run" / "locks" / "process0.lock"
    fd = hold(path, "pid 7 on node-that-died since 2026-12-01 10:00:00\n")
    said = []
    start = time.monotonic()
    with pytest.raises(ClusterError, match=r"pid 7 on node-that-died since"):
        RunLock(tmp_path / "run", 0, say=said.append).acquire(wait_s=1.0)
    assert 1.0 <= time.monotonic() - start < 10
    assert said == [f"waiting up to 1 s for {path} (pid 7 on node-that-died since 2026-12-01 "
                    f"10:00:00): a lock a dead host left on a shared file system expires"]
    threading.Timer(0.5, os.close, [fd]).start()  # the lease expires
    lock = RunLock(tmp_path / "run", 0, say=said.append).acquire(wait_s=30.0)
    assert path.read_text().startswith(f"pid {os.getpid()} on ")
    lock.release()
