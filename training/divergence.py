"""A loss or gradient that stops being finite (``train.on_nonfinite``): stop, naming the newest
finite checkpoint, or roll back to it, pass over the data that led there and go on.

The step latches the first non-finite step in the state (``bad_step``) without a host sync;
the loop reads it at every log step and before every save, so no non-finite state is ever
saved and the newest checkpoint is always one to resume from. Rolling back is what large runs
do for loss spikes (PaLM restarted about 100 steps before a spike and skipped 200-500
batches): restore the newest finite checkpoint, skip the batches from it to the bad step, go
on; at most ``train.max_rollbacks`` times per run, resumes included (the data iterator's
state counts them). A state saved just before a divergence can be finite and already ruined
(one step at a huge learning rate), so when the run diverges again before saving past the
checkpoint it rolled back to, the next rollback goes to the one before it.
"""
from __future__ import annotations


class Diverged(RuntimeError):
    """Training diverged and the run stops (``train.on_nonfinite=stop``, or no rollback left)."""


class Divergence:
    def __init__(self, config, trainer, pipe, ckpts, log):
        self.t, self.trainer, self.pipe, self.ckpts, self.log = config.train, trainer, pipe, ckpts, log
        self.rollbacks = pipe.train.rollbacks  # spent by the runs this one resumed
        self.target: int | None = None  # the checkpoint the last rollback went back to

    def handle(self, bad: int, step: int):
        """Step ``bad`` (1-based) was not finite and the batches through ``step`` are consumed:
        raises Diverged, or rolls back and returns (checkpoint step, its TrainState)."""
        self.ckpts.wait()  # saves in flight are of finite states: they count
        newest = self.ckpts.latest_step()
        if self.t.on_nonfinite != "rollback" or self.rollbacks >= self.t.max_rollbacks:
            raise Diverged(self._stop_line(bad, newest))
        below = newest if newest is not None and newest == self.target else None
        got = self.ckpts.restore(self.trainer.abstract_state, below=below)
        if got is None:
            raise Diverged(f"training diverged at step {bad} (the loss or gradient norm is not "
                           f"finite) and no finite checkpoint is left to roll back to; lower "
                           f"train.lr or raise train.warmup_steps")
        self.ckpts.discard_after(got.step)
        # The batch of step `bad` ends (step - bad) batches before the iterator's position.
        bad_end = self.pipe.train.position - (step - bad) * self.pipe.batch_size
        self.pipe.train.restore(got.data)
        batches = (bad_end - self.pipe.train.position) // self.pipe.batch_size
        self.rollbacks, self.target = self.rollbacks + 1, got.step
        self.pipe.train.skip(batches, self.rollbacks)
        self.log(f"training diverged at step {bad}: rolled back to step {got.step} ({got.path}) "
                 f"and skipped {batches} batch{'es' if batches != 1 else ''} of data (rollback "
                 f"{self.rollbacks} of train.max_rollbacks={self.t.max_rollbacks})")
        return got.step, got.state

    def _stop_line(self, bad: int, newest: int | None) -> str:
        why = f"training diverged at step {bad} (the loss or gradient norm is not finite)"
        if self.rollbacks:
            why += f" after {self.rollbacks} rollbacks (train.max_rollbacks={self.t.max_rollbacks})"
        fix = "a lower train.lr or a longer train.warmup_steps"
        if self.t.on_nonfinite != "rollback":
            fix += " (or train.on_nonfinite=rollback)"
        if newest is None:
            return f"{why}; no checkpoint was saved before it; rerun with {fix}"
        return (f"{why}; newest finite checkpoint: step {newest} ({self.ckpts.path(newest)}); "
                f"to resume from it, rerun with {fix}")
