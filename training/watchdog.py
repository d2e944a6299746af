"""Stuck is as bad as dead: when no train step finishes within ``distributed.step_timeout_s``,
every process of a multi-process run ends in one line naming the stuck process and the last
step each process finished, with exit code STUCK (a requeue loop reads it; the same command on
every host resumes from the newest complete checkpoint).

jax.distributed's heartbeats only catch a process that is gone or frozen whole. One that is
alive but stuck (a deadlock in its data loader, a file system that hangs, a collective that
never completes) keeps its heartbeat, and every host would wait forever. So a thread in each
process watches the steps it dispatched: it polls the newest ones with ``is_ready()`` (no host
sync in the loop) and publishes, through the coordination service's key-value store, the last
step it saw finish, the steps dispatched and a counter that shows the thread itself is alive.
When the timeout passes without a finished step, it reads every process's record twice:
- a process whose counter stood still is frozen or cut off (SIGSTOP, a dead NIC);
- else one that dispatched fewer steps than the others is stuck on its own host;
- else every process waits inside the same step: a collective that never completed.
The first process to decide writes the line to the store, and the others end with it.

The first step (a compile, a restore behind it) gets the larger of 30 minutes and three
timeouts, evaluations, saves and rollbacks three timeouts, and the run's last save is not
timed (the processes leave the loop at different times). ``distributed.step_timeout_s=0`` means the
larger of 10 minutes and 20 median step times.
"""
from __future__ import annotations

import collections
import contextlib
import json
import os
import statistics
import sys
import threading
import time

STUCK = 4  # the exit code of a run ended by a stuck process
PREFIX = "stripedjax/progress/"
STUCK_KEY = "stripedjax/stuck"
MIN_AUTO_TIMEOUT_S = 600.0
FIRST_STEP_MIN_S = 1800.0  # the first step compiles: a 7B model's compile takes minutes


def kv_client():
    """jax.distributed's coordination-service client (None without jax.distributed)."""
    try:
        from jax._src.distributed import global_state
        return global_state.client
    except ImportError:
        return None


class StepWatchdog:
    def __init__(self, timeout_s: float, process_id: int, num_processes: int, client,
                 tail: callable, poll_s: float = 1.0, say=None, end=os._exit):
        self.timeout_s = float(timeout_s)  # 0: auto
        self.process_id, self.num_processes = process_id, num_processes
        self.client, self.tail, self.poll_s = client, tail, poll_s
        self.say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self.end = end
        self._pending: collections.deque = collections.deque()  # (step, an output of it)
        self._lock = threading.Lock()
        self.dispatched_steps = 0
        self.finished = 0
        self._first = True  # no step finished yet: the first-step bound applies
        self._progress_at: float | None = time.monotonic()  # None: not timed
        self._paused = 0
        self._rates: collections.deque = collections.deque(maxlen=200)  # seconds per step
        self._beat = 0
        self._busy: set[str] = set()  # store calls still waiting for an answer
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="step-watchdog", daemon=True)

    # -- the training loop's side (main thread) -------------------------------------------
    def dispatched(self, step: int, output) -> None:
        with self._lock:
            self._pending.append((step, output))
            self.dispatched_steps = step

    @contextlib.contextmanager
    def paused(self):
        """Work that is not a train step and may outlast a step's timeout (an evaluation, a
        save, a rollback's restore): it gets three timeouts (a save that waits for a frozen
        peer must still end the run), and the clock starts again when it is done."""
        with self._lock:
            self._paused += 1
        try:
            yield
        finally:
            with self._lock:
                self._paused -= 1
                if self._progress_at is not None:
                    self._progress_at = time.monotonic()

    def restart(self, step: int) -> None:
        """After a rollback: the steps dispatched before it will never be read, and the next
        one compiles again."""
        with self._lock:
            self._pending.clear()
            self.dispatched_steps = self.finished = step
            self._first = True
            if self._progress_at is not None:
                self._progress_at = time.monotonic()

    def disarm(self) -> None:
        """For the run's last save: the processes leave the loop at different times, and a
        save of a large model can outlast the timeout (orbax's own barriers time out)."""
        with self._lock:
            self._progress_at = None
            self._pending.clear()

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=5)
        self._poll_finished()  # the count at exit does not depend on when the thread last woke
        return False

    # -- the watching thread --------------------------------------------------------------
    def step_timeout(self) -> float:
        if self.timeout_s > 0:
            return self.timeout_s
        median = statistics.median(self._rates) if self._rates else 0.0
        return max(MIN_AUTO_TIMEOUT_S, 20 * median)

    def timeout(self) -> float:
        """The bound now: a step's, or more for the first step and for a save or evaluation."""
        step = self.step_timeout()
        if self._first:
            return max(FIRST_STEP_MIN_S, 3 * step)
        return 3 * step if self._paused else step

    def _poll_finished(self) -> None:
        now = time.monotonic()
        with self._lock:
            before = self.finished
            while self._pending and self._pending[0][1].is_ready():
                self.finished = self._pending.popleft()[0]
            if self.finished > before:
                if self._progress_at is not None and not self._first:
                    self._rates.append((now - self._progress_at) / (self.finished - before))
                if self._progress_at is not None:
                    self._progress_at = now
                self._first = False

    def _since(self) -> float | None:
        """Seconds without progress; None once disarmed."""
        with self._lock:
            if self._progress_at is None:
                return None
            return time.monotonic() - self._progress_at

    def _publish(self) -> None:
        with self._lock:
            self._beat += 1
            record = {"finished": self.finished, "dispatched": self.dispatched_steps,
                      "beat": self._beat}
        self._call("publish", lambda: self.client.key_value_set(
            PREFIX + str(self.process_id), json.dumps(record), True), 5.0)

    def _decided(self) -> str | None:
        """The line another process decided, if one did."""
        return self._call("decided", lambda: self.client.key_value_try_get(STUCK_KEY), 5.0)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._poll_finished()
            if self.client is not None:
                self._publish()
            since = self._since()
            if since is None:
                continue
            line = self._decided() if since > 2 * self.poll_s and self.client else None
            if line is None and since > self.timeout():
                line = self.diagnose(since)
                if self._since() is None or self._since() < since:
                    continue  # a step finished while it looked
                line = self._claim(line)
            if line is not None:
                self._finish(line)
                return

    def _claim(self, line: str) -> str:
        """Writes this process's line unless another got there first: then theirs, so that
        every process ends with the same one."""
        if self.client is None:
            return line
        if self._call("claim", lambda: self.client.key_value_set(STUCK_KEY, line, False),
                      5.0, ok=True):
            return line
        return self._decided() or line

    def records(self) -> dict[int, dict] | None:
        """Every process's last record, or None when the store does not answer (its host,
        process 0, is frozen or gone)."""
        got = self._call("records", lambda: self.client.key_value_dir_get(PREFIX), 10.0)
        if got is None:
            return None
        return {int(k.rsplit("/", 1)[1]): json.loads(v) for k, v in got}

    def diagnose(self, since: float) -> str:
        during = (" in the first step" if self._first
                  else " in a save or an evaluation" if self._paused else "")
        head = (f"no step finished for {since:.0f} s{during} (distributed.step_timeout_s="
                f"{self.step_timeout():g}{'; it gets three' if during else ''})")
        first = self.records() if self.client is not None else None
        if first is None:
            who = ("process 0 (the coordinator) stopped answering" if self.client is not None
                   else f"process {self.process_id} is stuck")
            return f"{head}: {who}; last step finished here (process {self.process_id}): " \
                   f"{self.finished}; {self.tail()}"
        time.sleep(2.5 * self.poll_s)  # long enough for every live watchdog to publish again
        second = self.records() or {}
        frozen = [p for p in range(self.num_processes) if p != self.process_id and (
            p not in second or p not in first or second[p]["beat"] == first[p]["beat"])]
        latest = {**first, **second}
        dispatched = {p: r["dispatched"] for p, r in latest.items()}
        if frozen:
            who = (f"{_processes(frozen)} stopped answering (no progress report for "
                   f"{2.5 * self.poll_s:g} s: stopped, frozen or cut off)")
        elif dispatched and min(dispatched.values()) < max(dispatched.values()):
            low = min(dispatched.values())
            behind = [p for p, d in sorted(dispatched.items()) if d == low]
            who = (f"{_processes(behind)} never started step {low + 1} (stuck on its host: "
                   f"data, I/O or a deadlock) while the others wait for it")
        else:
            step = min((r["finished"] for r in latest.values()), default=self.finished) + 1
            who = (f"every process waits inside step {step}: a collective that never completed "
                   f"(docs/clusters.md: the NCCL settings that turn it into an error)")
        finished = ", ".join(f"process {p}: {latest[p]['finished']}" for p in sorted(latest))
        return f"{head}: {who}; last step finished: {finished}; {self.tail()}"

    def _call(self, name: str, fn, timeout_s: float, ok: bool = False):
        """``fn()`` in a helper thread: its result (True with ``ok``), or None when it raised
        or did not answer in time (a store whose host is frozen never answers). A call of the
        same name still waiting is not repeated, so a frozen store gathers no threads."""
        if name in self._busy:
            return None
        box, done = [], threading.Event()

        def run():
            try:
                result = fn()
                box.append(True if ok else result)
            except Exception:  # noqa: BLE001  (the store's errors mean "no answer" here)
                pass
            finally:
                self._busy.discard(name)
                done.set()

        self._busy.add(name)
        threading.Thread(target=run, daemon=True).start()
        done.wait(timeout_s)
        return box[0] if box else None

    def _finish(self, line: str) -> None:
        self.say(f"error: {line}")
        if self.process_id == 0 and self.client is not None:
            # The coordination service lives here: give the others a few polls to read the
            # line before it goes, or they would report a lost coordinator instead.
            time.sleep(4 * self.poll_s)
        self.end(STUCK)


def _processes(ids: list[int]) -> str:
    return ("process " if len(ids) == 1 else "processes ") + ", ".join(map(str, ids))


class NoWatchdog:
    """One process: nothing to wait for."""

    def dispatched(self, step, output):
        pass

    def disarm(self):
        pass

    @contextlib.contextmanager
    def paused(self):
        yield

    def restart(self, step):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def for_run(config, workdir):
    """The watchdog of a training run: a real one with several processes."""
    import jax
    if jax.process_count() == 1:
        return NoWatchdog()
    from training.supervisor import resume_tail
    return StepWatchdog(config.distributed.step_timeout_s, jax.process_index(),
                        jax.process_count(), kv_client(),
                        tail=lambda: resume_tail(workdir.absolute()))
