"""Stopping and resuming real runs: SIGTERM saves and exits 0, a resumed run continues bit for
bit, broken checkpoints are skipped with a message, a changed model or tokenizer stops with one
line, restore_from takes another run's weights or whole state, and a checkpoint restores onto
another mesh and layout.

The reference run and the run stopped by a real SIGTERM are train.py processes; the other runs
go through train.py's entry after its flags in this process (tests/trained_run.py's entry: the
same run, exit code and lines, without a Python and JAX start each). Every run but the
weights-only one uses the reference's training program (its 40-step schedule), so none compiles
one of its own; the weights-only run trains EVERY steps on a schedule of its own (one program
more, about a second, for 32 steps fewer)."""
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import time

import jax
import numpy as np
import pytest

import trained_run as tr
from errors import CheckpointError, ConfigError
from helpers import logged_step
from checkpoints.manager import Checkpoints
from parallel.layouts import permutation
from parallel.mesh import make_mesh
from training.state import Trainer

STOP_AFTER = 10  # SIGTERM once the interrupted run has logged this step (after the save at 8)


def newest_periodic_before(s: int) -> int:
    """The newest periodic checkpoint strictly before step ``s``."""
    return tr.EVERY * ((s - 1) // tr.EVERY)


@pytest.fixture(scope="module")
def reference():
    """This file's copy of the shared reference run: tests here run train.py on it."""
    return shutil.copytree(tr.reference(), tr.SESSION / "reference")  # returns the copy


@pytest.fixture(scope="module")
def interrupted(reference):
    """The reference run's command, stopped with a real SIGTERM near step STOP_AFTER; returns
    (workdir, copy of it at the stop, exit code, output)."""
    workdir = tr.SESSION / "interrupted"
    log = tr.SESSION / "interrupted.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(tr.train_cmd(workdir), cwd=tr.ROOT, env=tr.env(), stdout=out,
                                stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + 240
        while proc.poll() is None and time.time() < deadline:
            if logged_step(workdir / "metrics.jsonl") >= STOP_AFTER:
                proc.send_signal(signal.SIGTERM)
                break
            time.sleep(0.02)
        code = proc.wait(timeout=120)
    snapshot = tr.SESSION / "interrupted_at_stop"
    shutil.copytree(workdir, snapshot)
    return workdir, snapshot, code, log.read_text()


def stopped_step(output: str) -> int:
    m = re.search(r"stopped by SIGTERM after step (\d+): saved (\S+)", output)
    assert m, output[-3000:]
    return int(m.group(1))


@functools.cache
def trainer8() -> Trainer:
    """The reference's trainer (8 devices: fsdp 2 x sequence 4, striped), built once here."""
    c = tr.config()
    return Trainer(c, make_mesh(c.mesh))


def params_at(workdir, step):
    trainer = trainer8()
    ckpts = Checkpoints(workdir / "checkpoints", log=lambda m: None)
    try:
        got = ckpts.restore_params(trainer.abstract_state.params, step=step)
    finally:
        ckpts.close()
    return jax.tree.map(np.asarray, got.params)


def assert_same_losses(workdir, reference, steps, every=True):
    got, want = tr.metrics(workdir), tr.metrics(reference)
    for s in steps:
        assert (got[s]["loss"], got[s]["grad_norm"]) == (want[s]["loss"], want[s]["grad_norm"]), s
    if every:
        assert sorted(got) == sorted(want)


def test_sigterm_finishes_the_step_saves_and_exits_zero(interrupted):
    _, snapshot, code, output = interrupted
    assert code == 0, output[-3000:]
    s = stopped_step(output)
    assert STOP_AFTER <= s < tr.STEPS
    step_dir = snapshot / "checkpoints" / str(s)
    assert (step_dir / "commit_success.txt").is_file()
    assert {"state", "data", "meta"} <= {p.name for p in step_dir.iterdir()}
    assert max(tr.metrics(snapshot)) == s  # every finished step was logged, none beyond
    data = json.loads((step_dir / "data" / "metadata").read_text())
    assert data["epoch"] * data["rows_per_epoch"] + data["row"] == s * 4  # s batches of 4 rows


def test_resume_after_sigterm_continues_bit_for_bit(reference, interrupted):
    workdir, _, _, output = interrupted
    s = stopped_step(output)
    out = tr.entry(workdir)  # the same command
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"resuming from step {s} ({workdir / 'checkpoints' / str(s)})" in out.stdout
    assert len((workdir / "metrics.jsonl").read_text().splitlines()) == tr.STEPS  # no repeats
    assert_same_losses(workdir, reference, range(1, tr.STEPS + 1))
    got, want = params_at(workdir, tr.STEPS), params_at(reference, tr.STEPS)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.array_equal(a, b)


def test_broken_checkpoints_are_skipped_with_a_message(reference):
    """Three ways a save can be left broken, all newer than the last good one (a periodic,
    asynchronous save while training went on): a
    writer killed mid-save (orbax's tmp directory), a copy cut short before its commit marker,
    and a step whose array files were truncated. On a copy of the reference without its final
    checkpoint, as a run killed after logging its last steps leaves it: the newest periodic one
    (s) truncated, so the run resumes EVERY steps before it, near the end (fewer steps to train
    again than from the stopped run's)."""
    s = tr.STEPS - tr.EVERY
    workdir = tr.SESSION / "broken"
    shutil.copytree(reference, workdir)
    ckpt = workdir / "checkpoints"
    shutil.rmtree(ckpt / str(tr.STEPS))
    good = newest_periodic_before(s)
    for f in (ckpt / str(s) / "state" / "d").iterdir():
        os.truncate(f, 16)
    shutil.copytree(ckpt / str(good), ckpt / str(s + 1))
    (ckpt / str(s + 1) / "commit_success.txt").unlink()
    shutil.copytree(ckpt / str(good), ckpt / f"{s + 2}.orbax-checkpoint-tmp-1764400000")

    out = tr.entry(workdir)
    assert out.returncode == 0, out.stderr[-3000:]
    said = out.stdout
    assert f"skipping step {s + 2}:" in said and "never finished" in said
    assert f"skipping step {s + 1} ({ckpt / str(s + 1)}): it has no commit_success.txt" in said
    assert f"skipping step {s} ({ckpt / str(s)}): its metadata cannot be read" in said
    assert f"resuming from step {good} ({ckpt / str(good)})" in said
    assert "Traceback" not in out.stdout + out.stderr
    assert_same_losses(workdir, reference, range(good + 1, tr.STEPS + 1))
    # The steps the killed run had logged past the restored checkpoint are logged once only.
    assert len((workdir / "metrics.jsonl").read_text().splitlines()) == tr.STEPS
    skipped = sorted(p.name.split("-")[0] for p in (ckpt / "skipped").iterdir())
    assert skipped == sorted([str(s), str(s + 1)])
    assert not any(".orbax-checkpoint-tmp" in p.name for p in ckpt.iterdir())
    ckpts = Checkpoints(ckpt, log=lambda m: None)
    assert tr.STEPS in ckpts.steps()
    ckpts.close()


def test_changed_model_shape_stops_with_one_line(reference):
    before = (reference / "config.json").read_text()
    out = tr.entry(reference, **{"model.d_model": 128, "train.steps": tr.STEPS + 5})
    assert out.returncode == 2
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, out.stderr[-3000:]
    assert "model.d_model=64 in the checkpoint but 128 now" in errors[0]
    assert f"checkpoint step {tr.STEPS}" in errors[0]
    assert "Traceback" not in out.stdout + out.stderr
    assert (reference / "config.json").read_text() == before  # nothing recorded for the bad run


def test_changed_tokenizer_stops_with_one_line(reference, tmp_path):
    from training.loop import run
    other = {"data.max_docs": 150}  # another corpus slice trains another BPE
    with pytest.raises(ConfigError, match="tokenizer") as e:  # resuming the run itself
        run(tr.config(**other), reference)
    assert "\n" not in str(e.value)
    with pytest.raises(CheckpointError, match="was trained with tokenizer") as e:  # restore_from
        run(tr.config(**other, **{"checkpoint.restore_from": str(reference)}), tmp_path / "new")
    assert "\n" not in str(e.value) and f"checkpoint step {tr.STEPS}" in str(e.value)


def test_other_long_context_data_stops_with_one_line(reference):
    """The iterator's position only means something on the same epochs: a checkpoint of a plain
    run does not resume with long documents upsampled (data_plan in the saved state)."""
    from training.loop import run
    before = (reference / "config.json").read_text()
    with pytest.raises(CheckpointError, match="data iterator state does not match this pipeline: "
                                              "documents is") as e:
        run(tr.config(**{"data.long_doc_tokens": 1, "data.long_doc_upsample": 2}), reference)
    assert "\n" not in str(e.value) and "restore_weights_only=True" in str(e.value)
    assert (reference / "config.json").read_text() == before


def test_restore_from_weights_only(reference, tmp_path):
    """The reference's final weights, a fresh optimizer and data iterator, a schedule of its
    own (EVERY steps)."""
    workdir = tmp_path / "finetune"
    out = tr.entry(workdir, **{"checkpoint.restore_from": str(reference),
                               "checkpoint.restore_weights_only": True, "train.steps": tr.EVERY})
    assert out.returncode == 0, out.stderr[-3000:]
    assert (f"starting from the weights of step {tr.STEPS} "
            f"({reference / 'checkpoints' / str(tr.STEPS)})") in out.stdout
    # Step 0's held-out loss is the reference's final one: the very same weights.
    assert tr.evals(workdir)[0]["eval_loss"] == tr.evals(reference)[tr.STEPS]["eval_loss"]
    assert sorted(tr.metrics(workdir)) == list(range(1, tr.EVERY + 1))
    data = json.loads((workdir / "checkpoints" / str(tr.EVERY) / "data" / "metadata").read_text())
    # A fresh data iterator: EVERY batches of 4 rows from the start of the first epoch.
    assert data["epoch"] * data["rows_per_epoch"] + data["row"] == tr.EVERY * 4


def test_restore_from_all_state_of_one_step(reference, tmp_path):
    """Another run's step directory: weights, optimizer state and data position; the run
    continues as that run did, bit for bit."""
    workdir = tmp_path / "continued"
    at = tr.STEPS - tr.EVERY
    step_dir = reference / "checkpoints" / str(at)
    out = tr.entry(workdir, **{"checkpoint.restore_from": str(step_dir)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"starting from step {at} of another run ({step_dir})" in out.stdout
    assert sorted(tr.metrics(workdir)) == list(range(at + 1, tr.STEPS + 1))
    assert_same_losses(workdir, reference, range(at + 1, tr.STEPS + 1), every=False)
    before = json.loads((step_dir / "data" / "metadata").read_text())
    after = json.loads((workdir / "checkpoints" / str(tr.STEPS) / "data" / "metadata")
                       .read_text())
    rows = lambda d: d["epoch"] * d["rows_per_epoch"] + d["row"]  # noqa: E731
    assert rows(after) == rows(before) + tr.EVERY * 4  # the data position came along
    # Run again (as after a preemption), the same command resumes its own progress.
    out = tr.entry(workdir, **{"checkpoint.restore_from": str(step_dir)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert (f"checkpoint.restore_from={step_dir} is ignored: this run resumes from its own "
            f"checkpoints") in out.stdout
    assert f"resuming from step {tr.STEPS} ({workdir / 'checkpoints' / str(tr.STEPS)})" \
        in out.stdout


def test_resuming_an_import_of_weights_only_is_refused(reference, tmp_path):
    """scripts/convert_hf.py import writes weights without an optimizer state or data position:
    a run directory made of one is a start, never something to resume."""
    from training.loop import run
    workdir = tmp_path / "imported"
    shutil.copytree(reference, workdir)
    meta = workdir / "checkpoints" / str(tr.STEPS) / "meta" / "metadata"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "params_only": True}))
    with pytest.raises(CheckpointError, match=f"checkpoint step {tr.STEPS} .* holds weights only "
                                              f".* --config.checkpoint.restore_weights_only=True"):
        run(tr.config(), workdir)


def test_restore_onto_four_devices_contiguous(reference):
    """Written on 8 devices (fsdp 2 x sequence 4, striped); read onto 4 devices (sequence 4,
    contiguous). The same natural-order held-out batch gives the same loss on both."""
    from data.pipeline import make_pipeline
    c8 = tr.config()
    c4 = tr.config(**{"attention.layout": "contiguous"})
    c4.mesh.update(data=1, fsdp=1, sequence=4, tensor=1)
    mesh4 = make_mesh(c4.mesh, jax.devices()[:4])
    pipe = make_pipeline(c8, trainer8().mesh)
    natural = pipe.host_batch(0, heldout=True, natural=True)
    pipe.close()

    losses = {}
    for name, c, trainer in (("8 striped", c8, trainer8()),
                             ("4 contiguous", c4, Trainer(c4, mesh4))):
        mesh = trainer.mesh
        ckpts = Checkpoints(reference / "checkpoints", log=lambda m: None)
        got = ckpts.restore(trainer.abstract_state)
        ckpts.close()
        assert got.step == tr.STEPS and int(got.state.step) == tr.STEPS
        assert ([leaf.sharding for leaf in jax.tree.leaves(got.state)] ==
                jax.tree.leaves(trainer.state_shardings))
        perm = permutation(c.attention.layout, c.data.seq_len, mesh.shape["sequence"])
        batch = {k: jax.device_put(v[:, perm], trainer.batch_shardings[k])
                 for k, v in natural.items()}
        loss, _ = jax.jit(trainer.loss)(got.state.params, batch)
        losses[name] = float(loss)
    assert abs(losses["8 striped"] - losses["4 contiguous"]) <= 1e-5 * losses["8 striped"], losses


def test_a_checkpoint_past_train_steps_is_one_line(reference):
    from training.loop import run
    with pytest.raises(CheckpointError, match=f"at step {tr.STEPS}, past train.steps=20"):
        run(tr.config(**{"train.steps": 20}), reference)
    assert json.loads((reference / "config.json").read_text())["train"]["steps"] == tr.STEPS
