"""The resumable training iterator with a background prefetch thread.

Every batch is a pure function of its first global row ``g`` (epoch ``g // rows_per_epoch``,
row ``g % rows_per_epoch``), so the iterator's state is just the next row to yield, plus the
facts that must match on restore. The prefetch thread runs ahead, but ``state()`` describes
the consumer's position, never the thread's. The rollbacks (``train.on_nonfinite=rollback``)
and the batches they passed over are counted in the state too, so a resumed run knows how
many rollbacks it has spent.
"""
from __future__ import annotations

import queue
import threading
from typing import Callable

from errors import DataError

_STOP_POLL_S = 0.1
# What a mismatch of an identity key usually means, for the one-line error.
_WHY = {"documents": "other documents per epoch: data source, filter, upsampling or mixture",
        "data_plan": "another data.min_doc_tokens, data.long_doc_* or data.mixture, or other files"}


class TrainIterator:
    def __init__(self, build: Callable[[int], dict], batch_rows: int, rows_per_epoch: int,
                 prefetch: int, identity: dict, defaults: dict | None = None):
        """``build(g)`` makes the batch whose first global row is ``g``; ``identity`` holds the
        ints/strings a saved state must match (tokenizer, seq_len, documents, shuffle seed);
        ``defaults`` the values of identity keys that older states lack."""
        self._build, self._batch_rows, self._rows_per_epoch = build, batch_rows, rows_per_epoch
        self._prefetch, self._identity = max(0, int(prefetch)), dict(identity)
        self._defaults = dict(defaults or {})
        self._row = 0
        self._rollbacks, self._skipped_batches = 0, 0  # so far, resumes included
        self._thread = None
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()

    # -- state ---------------------------------------------------------------------------
    def state(self) -> dict:
        epoch, row = divmod(self._row, self._rows_per_epoch)
        return {"epoch": epoch, "row": row, "rows_per_epoch": self._rows_per_epoch,
                "rollbacks": self._rollbacks, "skipped_batches": self._skipped_batches,
                **self._identity}

    @property
    def position(self) -> int:
        """The global row of the next batch."""
        return self._row

    @property
    def rollbacks(self) -> int:
        """The rollbacks of this run and the ones it resumed (``skip``)."""
        return self._rollbacks

    def restore(self, state: dict) -> None:
        """Continue exactly where ``state`` (from ``state()``) was taken."""
        state = {**self._defaults, **state}
        for key in ("epoch", "row", "rows_per_epoch", *self._identity):
            if key not in state:
                raise DataError(f"data iterator state lacks {key!r}; it is not from this pipeline")
        for key, value in self._identity.items():
            if state[key] != value:
                why = f" ({_WHY[key]})" if key in _WHY else ""
                raise DataError(f"data iterator state does not match this pipeline: {key} is "
                                f"{state[key]!r} in the checkpoint but {value!r} now{why}")
        if state["rows_per_epoch"] != self._rows_per_epoch:
            raise DataError(f"data iterator state does not match this pipeline: rows_per_epoch is "
                            f"{state['rows_per_epoch']} in the checkpoint but "
                            f"{self._rows_per_epoch} now (different data or seq_len)")
        self._halt()
        self._row = int(state["epoch"]) * self._rows_per_epoch + int(state["row"])
        self._rollbacks = int(state.get("rollbacks", 0))
        self._skipped_batches = int(state.get("skipped_batches", 0))

    def skip(self, batches: int, rollbacks: int) -> None:
        """Passes over the next ``batches`` batches (a rollback's bad data); ``rollbacks``
        counts the rollbacks so far, since restoring an older state also restores its count."""
        self._halt()
        self._rollbacks, self._skipped_batches = rollbacks, self._skipped_batches + int(batches)
        self._row += int(batches) * self._batch_rows

    # -- iteration -----------------------------------------------------------------------
    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self._prefetch == 0:
            batch = self._build(self._row)
        else:
            if self._thread is None:
                self._start()
            row, batch = self._queue.get()
            if isinstance(batch, BaseException):
                self._halt()
                raise batch
            assert row == self._row, (row, self._row)
        self._row += self._batch_rows
        return batch

    def close(self) -> None:
        """Stops the prefetch thread; ``next`` would start a new one from the same position."""
        self._halt()

    # -- the prefetch thread -------------------------------------------------------------
    def _start(self) -> None:
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=self._prefetch)
        self._thread = threading.Thread(target=self._produce, args=(self._row, self._queue, self._stop),
                                        name="data-prefetch", daemon=True)
        self._thread.start()

    def _produce(self, row: int, out: queue.Queue, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                item = (row, self._build(row))
            except BaseException as e:  # handed to the consumer, which raises it
                item = (row, e)
            while not stop.is_set():
                try:
                    out.put(item, timeout=_STOP_POLL_S)
                    break
                except queue.Full:
                    continue
            if isinstance(item[1], BaseException):
                return
            row += self._batch_rows

    def _halt(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        self._thread, self._queue = None, None

    def __del__(self):
        try:
            self._halt()
        except Exception:
            pass
