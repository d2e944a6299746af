"""SIGTERM / SIGINT become a request to stop after the current step, not a kill mid-step.

The handler only records the signal; the train loop polls ``requested`` once per step (a
Python attribute read, no device sync), saves, waits for the write and returns. A second
signal hands over to the previous handler, so a user who presses Ctrl-C
twice still gets an immediate stop.

Handlers can only be installed from the main thread; elsewhere (a run started from a worker
thread) the guard does nothing. With several processes the hosts must agree on the stop step,
so there no handler is installed and the loop asks the preemption sync point of
jax.distributed (through orbax) instead, see ``should_stop``.
"""
from __future__ import annotations

import os
import signal
import threading

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopOnSignal:
    def __init__(self, signals=SIGNALS):
        self.signals = tuple(signals)
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def __enter__(self):
        import jax
        # With several processes, jax.distributed's preemption notifier owns SIGTERM and tells
        # every process the same stop step (see should_stop); a Python handler would hide it.
        if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        self._restore()
        return False

    def _restore(self):
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum, frame):
        if self.signum is None:
            self.signum = signum
            return
        previous = self._previous.get(signum, signal.SIG_DFL)
        self._restore()
        if callable(previous):
            previous(signum, frame)  # SIGINT's default raises KeyboardInterrupt here
        elif previous == signal.SIG_DFL:
            os.kill(os.getpid(), signum)


def should_stop(guard: StopOnSignal, manager, step: int) -> bool:
    """Whether to stop after ``step``: this process's signal, or with several processes the
    step that orbax's preemption sync point (jax.distributed) picks for all of them."""
    import jax
    if jax.process_count() > 1:
        return bool(manager.reached_preemption(step))
    return guard.requested
