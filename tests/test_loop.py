"""training/loop.py: what the loop measures and logs, apart from the end-to-end runs."""
import json

import jax
import pytest

import trained_run as tr
from training import loop
from training.optim import schedule
from training.state import Trainer

PAUSE_S = 0.25  # virtual seconds a step takes: the only cost a log interval may count


class VirtualClock:
    """The loop's clock, advanced only by the steps: each logged tokens/s is then exact, whatever
    else the machine runs (a real sleep let a loaded CI machine's scheduling noise through)."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def blocking_dispatch(clock: VirtualClock) -> type[Trainer]:
    """A trainer whose step dispatch returns only once the step is done, PAUSE_S later on the
    clock: what an H200 does with a 1B model's step (its kernels fill the launch queue, so the
    dispatch returns near the end of the step)."""

    class BlockingDispatch(Trainer):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            step = self.train_step

            def synchronous(state, batch):
                out = step(state, batch)
                jax.block_until_ready(out)
                clock.now += PAUSE_S
                return out

            self.train_step = synchronous

    return BlockingDispatch


def test_tokens_per_s_counts_each_interval_once_when_dispatch_blocks(tmp_path, monkeypatch):
    """Each logged tokens/s covers exactly the steps since the last log step: with a dispatch
    that blocks for its step, the first log step read half the speed and the last twice it while
    the clock was read after the next step's dispatch. The learning rate logged is the
    schedule's at the step (it travels in the step's metrics)."""
    clock = VirtualClock()
    monkeypatch.setattr(loop, "time", clock)
    monkeypatch.setattr(loop, "Trainer", blocking_dispatch(clock))
    # One layer, 8 steps: the model and schedule of tests/test_faults.py's runs (SANE), so
    # their compiled step and initialiser serve both files (a schedule is in the program)
    steps, every = 8, 2
    config = tr.config(**{"model.num_layers": 1, "train.steps": steps, "train.log_every": every,
                          "train.eval_batches": 0, "checkpoint.every": 0})
    loop.run(config, tmp_path)
    records = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(every, steps + 1, every))
    # seconds per step as logged (step 2: the step after the compiled first; then 2 each): a
    # clock read one dispatch late gives 2 steps' time at step 2 and half a step's at the last
    per_step = [config.data.batch_size * config.data.seq_len / r["tokens_per_s"] for r in records]
    assert per_step == pytest.approx([PAUSE_S] * len(records), rel=1e-9), per_step
    lr = schedule(config.train)
    for r in records:
        assert r["lr"] == pytest.approx(float(lr(r["step"] - 1)), rel=1e-6)
