"""What every kind of data shares: natural-order rows of a row source become this process's
block of a global batch in the layout's order, sharded on the mesh (data/batching.py); held-out
batches; the shape checks that run before anything is read. The text pipeline
(data/pipeline.py) and the chat and preference pipelines (data/sft.py, data/preference.py) are
``Batches`` over their own rows (an object with ``rows(first, count)`` and ``rows_per_pass``:
``_train_rows`` and ``_heldout_rows``)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from jax.sharding import Mesh

from data import batching, files, mixture
from errors import DataError
from parallel import layouts
from parallel.mesh import batch_shards


@dataclass(frozen=True)
class Layout:
    name: str
    num_shards: int
    stripe: int

    def perm(self, seq_len: int) -> np.ndarray:
        return layouts.permutation(self.name, seq_len, self.num_shards, self.stripe)


class Batches:
    """Batches of a pipeline's rows (subclasses set ``_train_rows``, ``_heldout_rows`` and
    ``train``)."""

    def _init_batches(self, config, mesh: Mesh) -> None:
        """The batches' shape, layout and sharding, this process's block of them."""
        d = config.data
        self.seq_len, self.batch_size = int(d.seq_len), int(d.batch_size)
        self.layout = Layout(config.attention.layout, int(mesh.shape["sequence"]),
                             int(config.attention.stripe))
        _check_shapes(self.seq_len, self.batch_size, self.layout, mesh)
        _check_data_fields(d)
        self.mesh = mesh
        self.sharding = batching.batch_sharding(mesh)
        self.global_shape = (self.batch_size, self.seq_len)
        self._rows, self._cols = batching.process_block(self.sharding, self.global_shape)
        self._perm = self.layout.perm(self.seq_len)
        self.bad_records = files.BadRecords()

    # -- batches -------------------------------------------------------------------------
    def host_batch(self, first_row: int, heldout: bool = False, natural: bool = False) -> dict:
        """This process's block of the batch whose first global row is ``first_row``, as numpy
        (the whole batch when there is one process), in layout order; with ``natural``, this
        process's rows with every column in natural order instead."""
        rows = self._heldout_rows if heldout else self._train_rows
        batch = rows.rows(first_row + self._rows.start, self._rows.stop - self._rows.start)
        if natural:
            return batch
        return self.in_layout(batch)

    def in_layout(self, rows: dict) -> dict:
        """This process's rows (natural order) with its columns of the layout."""
        return {k: np.ascontiguousarray(v[:, self._perm[self._cols]]) for k, v in rows.items()}

    def device_batch(self, first_row: int, heldout: bool = False) -> dict:
        return batching.to_global(self.host_batch(first_row, heldout), self.sharding,
                                  self.global_shape)

    def heldout_batches(self, n: int) -> list[dict]:
        """The same batches every call (at most ``n``), from held-out documents only, spread
        evenly over the held-out set so that a few batches sample all of it rather than its
        first documents (``heldout_rows``)."""
        return [self.device_batch(row, heldout=True) for row in self.heldout_rows(n)]

    def heldout_rows(self, n: int) -> list[int]:
        """First global row of each held-out batch. Rows that fill at most ``n`` batches: every
        row once, when the rows past the last are empty (a source with ``wrap`` False: chat and
        preference rows, data/sft.py), else ``n`` batches that run on into the rows' next pass
        (the text pipeline's, which repeat); more rows: ``n`` batches spread evenly."""
        rows = self._heldout_rows.rows_per_pass
        if rows <= n * self.batch_size and not getattr(self._heldout_rows, "wrap", True):
            return list(range(0, rows, self.batch_size))
        if rows < n * self.batch_size:
            return [i * self.batch_size for i in range(n)]
        return [i * rows // n for i in range(n)]

    def close(self) -> None:
        """Stops the training iterator's prefetch thread."""
        self.train.close()

    # -- facts for logs ------------------------------------------------------------------
    @property
    def rows_per_epoch(self) -> int:
        return self._train_rows.rows_per_pass

    def bad_records_line(self) -> str:
        """One line on what data.bad_records=skip passed over ("" when nothing)."""
        b = self.bad_records
        if not b:
            return ""
        return (f"data: data.bad_records=skip left out {b.skipped} record(s) that are not JSON "
                f"and replaced invalid UTF-8 in {b.replaced} (first: {b.first})")


def _check_shapes(seq_len: int, batch_size: int, layout: Layout, mesh: Mesh) -> None:
    if seq_len < 1 or batch_size < 1:
        raise DataError(f"data.seq_len ({seq_len}) and data.batch_size ({batch_size}) must be >= 1")
    shards = batch_shards(mesh)
    if batch_size % shards:
        raise DataError(f"data.batch_size={batch_size} is not divisible by the data x fsdp mesh axes "
                        f"({shards}); use a multiple of {shards}")
    try:
        layouts.check(layout.name, seq_len, layout.num_shards, layout.stripe)
    except layouts.LayoutError as e:
        raise DataError(f"data.seq_len / attention.layout: {e}") from None


def _check_data_fields(d) -> None:
    """Checks that would otherwise only fail after minutes of reading and tokenizing."""
    if int(d.max_docs) < 0:
        raise DataError(f"data.max_docs={d.max_docs} must be >= 0 (0 reads every document)")
    if not 0.0 <= float(d.heldout_fraction) < 1.0:
        raise DataError(f"data.heldout_fraction={d.heldout_fraction} must be in [0, 1)")
    if int(d.prefetch) < 0:
        raise DataError(f"data.prefetch={d.prefetch} must be >= 0 (0 builds batches inline)")
    mixture.check_fields(d)
