"""The checkpoint pieces on their own: what counts as a usable checkpoint, what is a user error
and what is damage, where restore_from points, and the stop-on-signal guard."""
import os
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ml_collections import ConfigDict

from checkpoints.compat import checker, model_mismatch
from checkpoints.manager import Checkpoints, locate
from checkpoints.preemption import StopOnSignal
from errors import CheckpointError
from training.state import TrainState

CFG = ConfigDict({"keep": 5, "keep_every": 0, "async_save": False})


def state(width=4, value=1.0, bad_step=-1):
    return TrainState(step=jnp.int32(3), params={"w": jnp.full((width,), value)},
                      opt_state={"mu": jnp.zeros((width,))}, bad_step=jnp.int32(bad_step))


def abstract(width=4):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                       sharding=a.sharding), state(width))


def saved(tmp_path, steps=(1, 2), meta=None):
    ckpts = Checkpoints(tmp_path / "checkpoints", CFG, log=lambda m: None)
    for s in steps:
        ckpts.save(s, state(value=float(s)), {"row": s}, meta or {})
    ckpts.wait()
    ckpts.close()
    return tmp_path / "checkpoints"


def truncate_arrays(step_dir):
    for f in (step_dir / "state" / "d").iterdir():
        os.truncate(f, 8)


def test_restore_newest_and_its_data_state(tmp_path):
    d = saved(tmp_path)
    got = Checkpoints(d, log=print).restore(abstract())
    assert got.step == 2 and got.data == {"row": 2}
    assert np.array_equal(got.state.params["w"], np.full(4, 2.0))
    only = Checkpoints(d, log=print).restore_params(abstract().params, step=1)
    assert np.array_equal(only.params["w"], np.ones(4)) and only.state is None


@pytest.mark.parametrize("background", [False, True])
def test_host_arrays_are_copied_only_for_a_background_save(tmp_path, monkeypatch, background):
    """An import's parameters are numpy arrays: a save that returns once written writes them as
    they are (no copy: SmolLM2's 333 MB import peaked 0.5 GB lower); one that writes in the
    background still copies them first, so that the caller may change them meanwhile. Either
    way what is read back is what was saved."""
    import copy
    copied, deepcopy = [], copy.deepcopy

    def spy(x, *a, **k):
        if isinstance(x, np.ndarray):
            copied.append(x.shape)
        return deepcopy(x, *a, **k)
    monkeypatch.setattr(copy, "deepcopy", spy)
    w = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    cfg = ConfigDict({"keep": 1, "keep_every": 0, "async_save": background})
    ckpts = Checkpoints(tmp_path, cfg, log=lambda m: None)
    ckpts.save(0, {"params": {"w": w}}, {}, {}, force=True)
    ckpts.wait()
    ckpts.close()
    assert copied == ([(3, 5)] if background else [])
    got = Checkpoints(tmp_path, log=print).restore_params(
        {"w": jax.ShapeDtypeStruct((3, 5), jnp.float32)}).params["w"]
    assert np.array_equal(np.asarray(got), w)


def test_keeps_the_newest_and_the_milestones(tmp_path):
    cfg = ConfigDict({"keep": 2, "keep_every": 4, "async_save": True})
    ckpts = Checkpoints(tmp_path, cfg, log=print)
    for s in range(1, 11):
        ckpts.save(s, state(value=float(s)), {"row": s}, {})
    ckpts.wait()
    assert ckpts.steps() == [4, 8, 9, 10]
    ckpts.close()
    assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [4, 8, 9, 10]


def test_every_checkpoint_unreadable_is_one_error_and_nothing_moves(tmp_path):
    d = saved(tmp_path)
    truncate_arrays(d / "1")
    truncate_arrays(d / "2")
    said = []
    with pytest.raises(CheckpointError, match=r"could be restored: step 2: .*; step 1: ") as e:
        Checkpoints(d, CFG, log=said.append).restore(abstract())
    assert "\n" not in str(e.value)
    assert len(said) == 2 and all(m.startswith("checkpoint: skipping step") for m in said)
    assert (d / "1").is_dir() and (d / "2").is_dir() and not (d / "skipped").exists()


def test_a_shape_mismatch_is_a_user_error_not_damage(tmp_path):
    d = saved(tmp_path)
    with pytest.raises(CheckpointError, match=r"parameter \['w'\] of shape \(4,\) but this "
                                              r"model's is \(6,\)"):
        Checkpoints(d, CFG, log=print).restore(abstract(width=6))
    assert (d / "2").is_dir() and not (d / "skipped").exists()  # not mistaken for damage


def test_model_and_tokenizer_check_from_run_metadata(tmp_path):
    model = {"vocab_size": 512, "d_model": 64, "num_layers": 2, "num_heads": 4,
             "num_kv_heads": 2, "head_dim": 0, "ffn_dim": 96}
    d = saved(tmp_path, meta={"config": {"model": model}, "tokenizer": "abc"})
    config = ConfigDict({"model": dict(model, head_dim=16)})  # the same head dim, explicit
    assert model_mismatch(model, config.model) is None
    got = Checkpoints(d, log=print).restore(abstract(), check=checker(config, "abc"))
    assert got.meta["tokenizer"] == "abc" and got.meta["step"] == 2
    config.model.num_layers = 3
    with pytest.raises(CheckpointError, match="model.num_layers=2 in the checkpoint but 3 now"):
        Checkpoints(d, log=print).restore(abstract(), check=checker(config, "abc"))
    config.model.num_layers = 2
    with pytest.raises(CheckpointError, match="trained with tokenizer abc, but this config "
                                              "gives xyz"):
        Checkpoints(d, log=print).restore(abstract(), check=checker(config, "xyz"))


def test_a_non_finite_checkpoint_is_skipped_in_one_line_and_set_aside(tmp_path):
    """Runs from before the check saved diverged states; a restore never continues from one."""
    ckpts = Checkpoints(tmp_path, CFG, log=lambda m: None)
    ckpts.save(1, state(value=1.0), {"row": 1}, {})
    ckpts.save(2, state(value=float("nan")), {"row": 2}, {})
    ckpts.save(3, state(value=3.0, bad_step=1), {"row": 3}, {})
    ckpts.wait()
    said = []
    got = Checkpoints(tmp_path, CFG, log=said.append).restore(abstract())
    assert got.step == 1 and got.data == {"row": 1}
    assert said[:2] == [
        f"checkpoint: skipping step 3 ({tmp_path / '3'}): its state is not finite (training "
        f"diverged at step 2, before this save)",
        f"checkpoint: skipping step 2 ({tmp_path / '2'}): its parameters are not finite (NaN "
        f"or inf)"]
    assert sorted(p.name.split("-")[0] for p in (tmp_path / "skipped").iterdir()) == ["2", "3"]


def test_rollback_targets_keep_two_and_the_missing_step_is_one_line(tmp_path):
    ckpts = Checkpoints(tmp_path, ConfigDict({"keep": 1, "keep_every": 0, "async_save": False}),
                        log=lambda m: None)
    for s in range(1, 5):
        ckpts.save(s, state(value=float(s)), {"row": s}, {})
    ckpts.wait()
    assert ckpts.steps() == [3, 4]  # keep=1 still keeps the one before the newest
    assert ckpts.restore(abstract(), below=4).step == 3
    ckpts.discard_after(3)
    assert ckpts.steps() == [3] and (tmp_path / "skipped").is_dir()
    with pytest.raises(CheckpointError) as e:
        ckpts.restore(abstract(), step=7)
    assert str(e.value) == f"no checkpoint for step 7 in {tmp_path} (steps there: [3])"


def test_no_complete_checkpoint_is_one_line(tmp_path):
    d = saved(tmp_path, steps=(1,))
    (d / "1" / "commit_success.txt").unlink()
    with pytest.raises(CheckpointError) as e:
        Checkpoints(d, log=lambda m: None).restore(abstract())
    assert str(e.value) == (f"no checkpoint in {d} could be restored: step 1: it has no "
                            f"commit_success.txt (the write never committed) (move the "
                            f"directory aside to start fresh)")


def test_a_write_error_names_the_os_cause():
    from checkpoints.storage import cause
    inner = ValueError('RESOURCE_EXHAUSTED: Error writing "w/0" in OCDBT database: Failed to write '
                       '97715 bytes to file 5: No space left on device [os_error_code=\'28\']')
    try:
        try:
            raise inner
        except ValueError as e:
            raise TimeoutError("Timed out while waiting for the commit") from e
    except TimeoutError as outer:
        assert cause(outer) == "No space left on device"
    assert cause(OSError(13, "Permission denied")) == "Permission denied"
    assert cause(RuntimeError("tensorstore: something else\nmore")) == "tensorstore: something else"


def test_locate_accepts_run_checkpoints_and_step_directories(tmp_path):
    d = saved(tmp_path)
    assert locate(tmp_path) == (d, None)
    assert locate(d) == (d, None)
    assert locate(d / "2") == (d, 2)
    with pytest.raises(CheckpointError, match="no such path"):
        locate(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no checkpoints in"):
        locate(tmp_path / "empty")


def test_stop_on_signal_records_then_hands_over_and_restores_handlers():
    # Start from known handlers whatever started pytest: a background job (nohup, `cmd &`)
    # inherits SIGINT ignored, and the hand-over would then (rightly) ignore the second one.
    outer = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    handed_over = []
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own Ctrl-C
    signal.signal(signal.SIGTERM, lambda signum, frame: handed_over.append(signum))
    try:
        before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
        with StopOnSignal() as stop:
            assert not stop.requested
            os.kill(os.getpid(), signal.SIGINT)
            assert stop.requested and stop.name == "SIGINT"
            with pytest.raises(KeyboardInterrupt):  # a second Ctrl-C: the handler from before
                os.kill(os.getpid(), signal.SIGINT)
        assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
        with StopOnSignal() as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop.name == "SIGTERM" and handed_over == []
            os.kill(os.getpid(), signal.SIGTERM)  # the second goes to the handler from before
            assert handed_over == [signal.SIGTERM]
        assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # as in a background job
        with StopOnSignal() as stop:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)  # handed over to SIG_IGN: still alive
            assert stop.name == "SIGINT"
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, outer[0])
        signal.signal(signal.SIGTERM, outer[1])


def test_stop_on_signal_test_holds_when_started_with_sigint_ignored():
    """As in `bash -c 'make test &'`: a background job of a shell starts with SIGINT ignored."""
    test = f"{__file__}::test_stop_on_signal_records_then_hands_over_and_restores_handlers"
    # Without the plugins this one test does not use (xdist, hypothesis): a second less.
    proc = subprocess.run(["bash", "-c", '"$@" & wait $!', "bash", sys.executable, "-m", "pytest",
                           "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-p",
                           "no:hypothesispytest", test],
                          capture_output=True, text=True, timeout=300,
                          # its pytest is this test's child: its CPU is counted here, not twice
                          env={k: v for k, v in os.environ.items() if k != "STRIPEDJAX_TEST_CPU"})
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-3000:]


def test_orphaned_read_errors_of_a_skipped_checkpoint_are_dropped_and_nothing_else():
    """When one read of a damaged checkpoint fails, asyncio later reports its never-awaited
    siblings as tracebacks; only exactly those reports are dropped (the skip is one line)."""
    import logging
    from checkpoints import manager, storage
    manager._quiet_orphaned_reads()
    assert storage.not_an_orphaned_future in logging.getLogger("asyncio").filters

    def record(msg, exc):
        return logging.LogRecord("asyncio", logging.ERROR, "", 0, msg, None, (type(exc), exc, None))

    orphan = ValueError('OUT_OF_RANGE: Error opening "zarr" driver: Error reading byte range')
    assert not storage.not_an_orphaned_future(record("Task exception was never retrieved\nfuture: <Task>", orphan))
    # a write's sibling on a full disk: tensorstore's, raised in C++ (no Python frames)
    full = ValueError('RESOURCE_EXHAUSTED: Error writing "opt_state.1.0.nu" in OCDBT database at '
                      'local file "/x/": Failed to write 410402 bytes to file 6: No space left on device')
    assert not storage.not_an_orphaned_future(record("Future exception was never retrieved\nfuture: <Future>", full))
    assert storage.not_an_orphaned_future(record("Task exception was never retrieved", ValueError("a bug")))
    assert storage.not_an_orphaned_future(record("Task exception was never retrieved",
                                                 ValueError("bad shape: Error writing it")))
    bug = ValueError('INVALID_ARGUMENT: Error writing "params.w" in OCDBT database: dtype')
    assert storage.not_an_orphaned_future(record("Future exception was never retrieved", bug))
    assert storage.not_an_orphaned_future(record("Unclosed client session", orphan))
