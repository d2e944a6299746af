"""The step watchdog (training/watchdog.py) on a fake key-value store and fake step outputs: who
it names as stuck, when it fires, and that every process ends with the first one's line. The
end-to-end run with a frozen process is test_multiprocess.py::test_a_stuck_peer_*."""
import json
import time

from training.watchdog import PREFIX, STUCK, STUCK_KEY, StepWatchdog


class Store:
    """The coordination service's key-value store, as the watchdog uses it."""

    def __init__(self):
        self.kv = {}

    def key_value_set(self, key, value, allow_overwrite=False):
        if key in self.kv and not allow_overwrite:
            raise RuntimeError(f"ALREADY_EXISTS: {key}")
        self.kv[key] = value

    def key_value_try_get(self, key):
        if key not in self.kv:
            raise KeyError(key)  # the real store raises NOT_FOUND
        return self.kv[key]

    def key_value_dir_get(self, prefix):
        return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]


class Output:
    def __init__(self, ready=True):
        self.ready = ready

    def is_ready(self):
        return self.ready


def peer(store, pid, finished, dispatched, beat):
    store.kv[PREFIX + str(pid)] = json.dumps(
        {"finished": finished, "dispatched": dispatched, "beat": beat})


def watchdog(store, pid=0, n=3, timeout_s=0.4, poll_s=0.05):
    ended = []
    said = []
    w = StepWatchdog(timeout_s, pid, n, store, tail=lambda: "TAIL", poll_s=poll_s,
                     say=said.append, end=ended.append)
    return w, said, ended


def run_until_ended(w, ended, steps, seconds=10.0, peers=None):
    """Dispatches ``steps`` finished steps, then one that never finishes; keeps the live peers
    publishing (``peers``: a function called every poll) until the watchdog ends."""
    with w:
        for s in range(1, steps + 1):
            w.dispatched(s, Output())
        w.dispatched(steps + 1, Output(ready=False))
        deadline = time.monotonic() + seconds
        while not ended and time.monotonic() < deadline:
            if peers:
                peers()
            time.sleep(w.poll_s / 2)
    return ended


def test_a_frozen_process_is_named(rng):
    store = Store()
    beats = iter(range(1, 10**6))
    steps = int(rng.integers(3, 9))
    peer(store, 2, steps, steps + 1, 7)  # frozen: its counter never moves

    def live():
        peer(store, 1, steps, steps + 1, next(beats))
    w, said, ended = watchdog(store)
    assert run_until_ended(w, ended, steps, peers=live) == [STUCK]
    assert len(said) == 1 and said[0].startswith("error: no step finished for ")
    assert said[0].endswith(
        f"(distributed.step_timeout_s=0.4): process 2 stopped answering (no progress report for "
        f"0.125 s: stopped, frozen or cut off); last step finished: process 0: {steps}, "
        f"process 1: {steps}, process 2: {steps}; TAIL")
    assert store.kv[STUCK_KEY] == said[0][len("error: "):]


def test_a_process_behind_the_others_is_named():
    store = Store()
    beats = iter(range(1, 10**6))

    def live():
        b = next(beats)
        peer(store, 1, 4, 4, b)  # never started step 5, while 0 and 2 wait inside it
        peer(store, 2, 4, 5, b)
    w, said, ended = watchdog(store)
    assert run_until_ended(w, ended, 4, peers=live) == [STUCK]
    assert ": process 1 never started step 5 (stuck on its host: data, I/O or a deadlock) while " \
           "the others wait for it; last step finished: process 0: 4, process 1: 4, process 2: 4" \
           in said[0]


def test_a_collective_that_never_completes():
    store = Store()
    beats = iter(range(1, 10**6))

    def live():
        b = next(beats)
        for p in (1, 2):
            peer(store, p, 6, 7, b)
    w, said, ended = watchdog(store)
    assert run_until_ended(w, ended, 6, peers=live) == [STUCK]
    assert ": every process waits inside step 7: a collective that never completed" in said[0]


def test_a_frozen_coordinator_is_named_without_its_store():
    store = Store()
    w, said, ended = watchdog(store, pid=1, n=2)
    w.records = lambda: None  # the store's calls never return (their helper thread times out)
    assert run_until_ended(w, ended, 3) == [STUCK]
    assert ": process 0 (the coordinator) stopped answering; last step finished here " \
           "(process 1): 3; TAIL" in said[0]


def test_the_first_line_ends_every_process():
    store = Store()
    store.kv[STUCK_KEY] = "the line another process decided"
    w, said, ended = watchdog(store, pid=2, timeout_s=30)
    assert run_until_ended(w, ended, 2) == [STUCK]
    assert said == ["error: the line another process decided"]


def test_steps_that_keep_finishing_never_end_the_run():
    store = Store()
    w, said, ended = watchdog(store, timeout_s=0.3)
    with w:
        for s in range(1, 30):
            w.dispatched(s, Output())
            time.sleep(0.05)  # 1.5 s of steady progress, five timeouts long
    assert ended == [] and said == [] and w.finished == 29
    assert 0 < json.loads(store.kv[PREFIX + "0"])["finished"] <= 29


def test_the_first_step_and_pauses_get_three_timeouts_and_the_last_save_none(monkeypatch):
    import training.watchdog as wd
    monkeypatch.setattr(wd, "FIRST_STEP_MIN_S", 0.0)  # the first step: three timeouts (1.5 s)
    store = Store()
    # sleeps of 1.5 timeouts: past one timeout, with 0.75 s to spare on a loaded machine
    w, said, ended = watchdog(store, timeout_s=0.5)
    with w:
        first = Output(ready=False)
        w.dispatched(1, first)  # the compile
        time.sleep(0.75)
        assert ended == []
        first.ready = True
        w.dispatched(2, Output())
        while w.finished < 2:
            time.sleep(0.01)
        with w.paused():  # an evaluation or a save that outlasts the timeout, not three
            time.sleep(0.75)
        assert ended == []
        w.dispatched(3, Output(ready=False))
        w.disarm()  # the run's last save
        time.sleep(0.75)
    assert ended == [] and said == []
    w, said, ended = watchdog(store, timeout_s=0.2)  # a pause that never ends: it ends
    with w.paused():
        start = time.monotonic()
        assert run_until_ended(w, ended, 2) == [STUCK]
    assert time.monotonic() - start >= 0.6


def test_of_two_processes_that_decide_at_once_the_first_line_wins():
    """Both read the store before either wrote: the second to write ends with the first's."""
    store = Store()
    first, _, _ = watchdog(store, pid=0)
    second, _, _ = watchdog(store, pid=1)
    assert first._claim("process 2 is stuck, says 0") == "process 2 is stuck, says 0"
    assert second._claim("process 2 is stuck, says 1") == "process 2 is stuck, says 0"
    assert store.kv[STUCK_KEY] == "process 2 is stuck, says 0"


def test_the_automatic_timeout():
    w, _, _ = watchdog(Store(), timeout_s=0)
    assert w.timeout() == 1800.0  # the first step compiles
    w._first = False
    assert w.timeout() == 600.0
    w._rates.extend([40.0, 50.0, 45.0])
    assert w.timeout() == 900.0  # 20 median steps
