"""What the watcher of a multi-process run says when its training process ends abnormally:
read from the native log lines jax.distributed leaves (taken from real runs). The end-to-end
run with a killed peer is in test_multiprocess.py."""
import pathlib
import signal

from training.supervisor import lost_line

HEARTBEATS = """E1130 21:42:38.166982 11361 coordination_service.cc:1549] Use error polling to propagate \
the following error to all tasks: UNAVAILABLE: The following tasks are unhealthy (stopped sending \
heartbeats):
1
The tasks have crashed. Check the task logs for an earlier error.
F1130 21:42:38.167263 11372 client.h:80] Terminating process because the JAX distributed service \
detected fatal errors.
"""
COORDINATOR_GONE = """F1130 21:44:18.236587 12595 client.h:80] Terminating process because the JAX \
distributed service detected fatal errors.
Additional GRPC error information from remote target coordination_service while calling \
/xla.coordination.CoordinationService/PollForError:
:UNKNOWN:Error received from peer  {grpc_status:14, grpc_message:"Socket closed"}
"""


def test_the_line_names_the_lost_process_and_the_newest_complete_checkpoint(tmp_path):
    for step, complete in ((2, True), (4, True), (6, False)):
        (tmp_path / "checkpoints" / str(step)).mkdir(parents=True)
        if complete:
            (tmp_path / "checkpoints" / str(step) / "commit_success.txt").touch()
    log = tmp_path / "logs" / "process0.log"
    tail = (f"newest complete checkpoint: step 4 ({tmp_path / 'checkpoints' / '4'}); rerun the "
            f"same command on every host to resume (details: {log})")
    abort = -signal.SIGABRT
    assert lost_line(HEARTBEATS, abort, 0, 30, tmp_path, log) == (
        f"process 1 stopped answering (no heartbeat for distributed.heartbeat_timeout_s=30 s), "
        f"so process 0 stopped; {tail}")
    assert lost_line(COORDINATOR_GONE, abort, 1, 30, tmp_path, log) == (
        f"process 0 stopped answering (the coordinator's connection closed), so process 1 "
        f"stopped; {tail}")
    assert lost_line("", -signal.SIGSEGV, 1, 30, tmp_path, log) == (
        f"process 1 was ended by SIGSEGV; {tail}")
    assert "no checkpoint was complete yet" in lost_line("", abort, 0, 30, pathlib.Path("/nope"), log)


def test_a_lost_peer_is_told_from_a_bug_through_the_errors_behind_it():
    from parallel.distributed import is_peer_error
    barrier = RuntimeError("INTERNAL: Barrier failed because: task is set to ERROR: UNAVAILABLE: "
                           "Task 1 heartbeat timeout")
    try:  # orbax's background save wraps the failed barrier in its own timeout
        try:
            raise barrier
        except RuntimeError as e:
            raise TimeoutError("Timed out while waiting for async_write_complete barrier.") from e
    except TimeoutError as e:
        assert is_peer_error(e)
    assert is_peer_error(ValueError("UNKNOWN: Gloo AllGather failed: [pair.cc:538] Read error "
                                    "[127.0.0.1]:12504: Connection reset by peer"))
    assert not is_peer_error(ValueError("operands could not be broadcast together"))
