"""Faults a long run meets, met as a user meets them: train.py, its exit code, its one line,
and what it leaves on disk (docs/reliability.md's table points here). The run that needs a
process of its own (a disk that fills up, in a mount namespace) is a train.py subprocess; the
others run train.py's entry after its flags (training/entry.py's main_with_errors: the exit code
and the lines train.py prints) in this process (tests/trained_run.py's entry), which spares each
a Python and JAX start.

Divergence never poisons a checkpoint and a diverged run resumes; a full disk keeps the last
good checkpoint; a bad record names its file and line. (A dead peer: test_multiprocess.py.)
"""
import json
import logging
import shutil
import subprocess
import sys

import pytest

import trained_run as tr

# Every run here: one layer (its programs compile in about two thirds of the time of two: a scan
# of length 1) and no held-out evaluation (no program for it): no fault depends on either.
ONE_LAYER = {"model.num_layers": 1, "train.eval_batches": 0}
SANE = {**ONE_LAYER, "train.steps": 8, "checkpoint.every": 1}


def errors(out) -> list[str]:
    assert "Traceback" not in out.stdout + out.stderr, out.stderr[-3000:]
    return [ln for ln in out.stderr.splitlines() if ln.strip()]


def steps_on_disk(workdir) -> list[int]:
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


def data_state(workdir, step) -> dict:
    return json.loads((workdir / "checkpoints" / str(step) / "data" / "metadata").read_text())


# -- divergence -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def diverged():
    """The issue's command: a learning rate that blows up at step 3, a save every step, a log
    every 10 (the old loop noticed only at step 10, after saving NaN checkpoints 3 to 10)."""
    workdir = tr.SESSION / "diverged"
    out = tr.entry(workdir, **ONE_LAYER, **{"train.lr": 1e30, "train.steps": 6,
                                            "checkpoint.every": 1, "train.log_every": 10})
    return workdir, out


@pytest.fixture(scope="module")
def recovered(diverged):
    """The same run directory rerun with a sane learning rate and rollbacks on."""
    workdir, _ = diverged
    return workdir, tr.entry(workdir, **SANE, **{"train.on_nonfinite": "rollback"})


def test_divergence_is_caught_before_a_save_and_names_the_newest_finite_checkpoint(diverged):
    workdir, out = diverged
    assert out.returncode == 1, out.stderr[-3000:]
    assert errors(out) == [
        f"error: training diverged at step 3 (the loss or gradient norm is not finite); newest "
        f"finite checkpoint: step 2 ({workdir / 'checkpoints' / '2'}); to resume from it, rerun "
        f"with a lower train.lr or a longer train.warmup_steps (or train.on_nonfinite=rollback)"]
    assert steps_on_disk(workdir) == [1, 2]  # nothing from step 3 on was saved


def test_a_diverged_run_resumes_and_rolls_back_past_a_ruined_checkpoint(recovered):
    """Step 2 is finite but one step at lr 1e30 ruined it: the resumed run diverges at once,
    rolls back to it and skips a batch, diverges again before saving past it, so the next
    rollback goes to the step before it, and from there the run trains to the end."""
    workdir, out = recovered
    assert out.returncode == 0 and not errors(out), out.stderr[-3000:]
    ckpt = workdir / "checkpoints"
    said = [ln for ln in out.stdout.splitlines() if ln.startswith(("resuming", "training"))]
    assert said == [
        f"resuming from step 2 ({ckpt / '2'})",
        f"training diverged at step 3: rolled back to step 2 ({ckpt / '2'}) and skipped 1 batch "
        f"of data (rollback 1 of train.max_rollbacks=3)",
        f"training diverged at step 3: rolled back to step 1 ({ckpt / '1'}) and skipped 3 "
        f"batches of data (rollback 2 of train.max_rollbacks=3)"], out.stdout
    assert [p.name.split("-")[0] for p in (ckpt / "skipped").iterdir()] == ["2"]
    records = tr.metrics(workdir)  # step 1 was never logged (log_every 10), 2 to 8 once each
    assert sorted(records) == list(range(2, 9)) and all(r["loss"] < 10 for r in records.values())
    # Two rollbacks; the data trained on passed over the 3 batches after step 1.
    last = data_state(workdir, 8)
    assert (last["rollbacks"], last["skipped_batches"]) == (2, 3)


def test_a_resume_after_rollbacks_is_exact(recovered):
    """The skips live in the data iterator's state: resuming from a checkpoint taken after the
    rollbacks trains on the very batches the uninterrupted run did."""
    workdir, _ = recovered
    copy = tr.SESSION / "recovered_copy"
    shutil.copytree(workdir, copy)
    shutil.rmtree(copy / "checkpoints" / "8")
    out = tr.entry(copy, **SANE, **{"train.on_nonfinite": "rollback"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"resuming from step 7 ({copy / 'checkpoints' / '7'})" in out.stdout
    assert tr.metrics(copy)[8]["loss"] == tr.metrics(workdir)[8]["loss"]


def test_orbax_failures_left_in_asyncio_futures_are_not_logged_and_others_are(caplog):
    """Newer orbax leaves a failed save's futures unread: asyncio would log a traceback for
    each when they are collected, around the one line the failure is raised as."""
    from checkpoints import storage
    storage.quiet_background_failures()

    def failure(filename):
        try:
            exec(compile("raise ValueError('No space left on device')", filename, "exec"))
        except ValueError:
            return sys.exc_info()

    logger = logging.getLogger("asyncio")
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        logger.error("_GatheringFuture exception was never retrieved",
                     exc_info=failure("/site/orbax/checkpoint/_src/serialization.py"))
        assert caplog.records == []
        logger.error("Task exception was never retrieved", exc_info=failure("/site/mine.py"))
        logger.error("something else in asyncio")
        assert [r.getMessage() for r in caplog.records] == [
            "Task exception was never retrieved", "something else in asyncio"]


# -- a full disk, read from a file with bad records -------------------------------------------
def mount_works() -> bool:
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                            "mount -t tmpfs -o size=1M tmpfs /mnt"], capture_output=True)
    return probe.returncode == 0


def train_on_small_disk(workdir, size_bytes, **overrides):
    """train.py with WORKDIR/checkpoints on a tmpfs of ``size_bytes`` in a private mount
    namespace; what the tmpfs held at the end is copied to WORKDIR/on_tmpfs."""
    ckpt, copy = workdir / "checkpoints", workdir / "on_tmpfs"
    ckpt.mkdir(parents=True)
    copy.mkdir()
    script = ('mount -t tmpfs -o size="$1" tmpfs "$2" || exit 99; shift 3; "$@"; rc=$?; '
              'cp -a "$0"/. "$0"/../on_tmpfs/; exit $rc')
    return subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, str(ckpt),
         str(size_bytes), str(ckpt), "--", *tr.train_cmd(workdir, **overrides)],
        cwd=tr.ROOT, env=tr.env(), capture_output=True, text=True, timeout=240)


def corpus(path):
    """Stdlib docstrings as jsonl with one torn line (line 40) and one not UTF-8 (line 70)."""
    import argparse, bisect, csv, difflib, fractions, heapq  # noqa: E401
    docs = [m.__doc__.strip() for m in (argparse, bisect, csv, difflib, fractions, heapq, json)]
    lines = [json.dumps({"text": f"{i}: {docs[i % len(docs)]}"}).encode() for i in range(120)]
    lines[39] = lines[39][:25]
    lines[69] = lines[69][:20] + b"\xff\xfe" + lines[69][20:]
    path.write_bytes(b"\n".join(lines) + b"\n")


@pytest.fixture(scope="module")
def full_disk(recovered):
    """A run reading a jsonl file with bad records (data.bad_records=skip) whose checkpoints
    fill their disk at the save of step 4, then the same command on a disk with room. Returns
    (workdir, the data file, the names the checkpoint directory held after the full run, whether
    step 2's checkpoint was complete then, the full run, the resumed run)."""
    workdir = tr.SESSION / "full_disk"
    data = tr.SESSION / "docs.jsonl"
    corpus(data)
    run = {**ONE_LAYER, "train.steps": 8, "checkpoint.every": 2, "data.source": "jsonl",
           "data.path": str(data),
           "data.cache_dir": str(tr.SESSION / "jsonl_cache"), "data.bad_records": "skip"}
    if mount_works():  # room for one checkpoint and a half: the save of step 4 runs out
        size = sum(f.stat().st_size for f in (recovered[0] / "checkpoints" / "8").rglob("*")
                   if f.is_file())
        full = train_on_small_disk(workdir, size * 3 // 2, **run)
        on_disk = workdir / "on_tmpfs"
    else:  # no user namespaces here: inject the write error instead
        full = subprocess.run(
            [sys.executable, "tests/no_space.py", *tr.train_cmd(workdir, **run)[1:]], cwd=tr.ROOT,
            env={**tr.env(), "FAIL_SAVES_FROM": "4"}, capture_output=True, text=True, timeout=240)
        on_disk = workdir / "checkpoints"
    listed = sorted(p.name for p in on_disk.iterdir())
    marked = (on_disk / "2" / "commit_success.txt").is_file()
    if on_disk != workdir / "checkpoints":
        shutil.rmtree(workdir / "checkpoints")
        on_disk.rename(workdir / "checkpoints")
    resumed = tr.entry(workdir, **run)  # on a disk with room: the same command
    return workdir, data, listed, marked, full, resumed


def test_a_full_disk_stops_in_one_line_and_keeps_the_last_good_checkpoint(full_disk):
    workdir, _, listed, marked, out, resumed = full_disk
    assert out.returncode == 2, out.stderr[-3000:]
    assert errors(out) == [
        f"error: cannot write checkpoint step 4 to {workdir / 'checkpoints' / '4'}: No space left "
        f"on device; removed the partial write and stopped (newest complete checkpoint: step 2 "
        f"({workdir / 'checkpoints' / '2'})); free space or fix permissions there (or use "
        f"another --workdir) and rerun the same command to resume"]
    assert listed == ["2"] and marked  # no partial write left, the last good one whole
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from step 2 ({workdir / 'checkpoints' / '2'})" in resumed.stdout
    assert sorted(tr.metrics(workdir)) == list(range(1, 9))


def test_a_bad_record_names_its_line_or_is_skipped_and_counted_alike_on_resume(full_disk,
                                                                             tmp_path):
    """data.bad_records=stop (the default): one line naming the file and line, exit 2. With
    skip (the full-disk runs above): counted in one line, and the resumed run, which reads the
    token cache and not the file, says the same."""
    _, data, _, _, full, resumed = full_disk
    run = {**ONE_LAYER, "data.source": "jsonl", "data.path": str(data),
           "data.cache_dir": str(tmp_path), "train.steps": 8}
    out = tr.entry(tmp_path / "stop", **run)
    assert out.returncode == 2
    assert errors(out) == [f"error: {data} line 40: not JSON (Unterminated string starting at "
                           f"column 10); fix the file or set data.bad_records=skip to pass over "
                           f"such records"]
    note = (f"data: data.bad_records=skip left out 1 record(s) that are not JSON and replaced "
            f"invalid UTF-8 in 1 (first: {data} line 40: not JSON (Unterminated string starting "
            f"at column 10))")
    assert note in full.stdout.splitlines(), full.stdout + full.stderr[-3000:]
    assert note in resumed.stdout.splitlines(), resumed.stdout + resumed.stderr[-3000:]
