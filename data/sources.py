"""Document sources behind one interface, chosen by ``config.data.source``.

A source yields documents (``str``) in a deterministic order and has a cheap ``signature``
(paths, sizes, modification times, names) that keys the tokenizer and token caches, so a
second run with unchanged inputs never reads them again.

- ``stdlib``: the running Python's standard-library ``.py`` files (real text, no download).
- ``text`` / ``jsonl`` / ``parquet``: local files, globs or a comma list, read record by
  record (data/files.py); a text file is one document, jsonl lines / parquet rows are
  documents; a bad record is named by file and line or row (``data.bad_records``).
- ``hf``: a hub dataset name or a local dataset directory (``save_to_disk`` output or a
  directory of data files), through the same ``datasets`` calls.
- ``tfds``: a TFDS builder name (``data.path``) prepared under ``data.data_dir``; optional
  extra (requirements-tfds.txt).

With ``data.mixture`` set, the source is a ``MixtureSource``: one source of kind
``data.source`` per entry (its PATH in place of ``data.path``), read one after the other.
"""
from __future__ import annotations

import glob
import hashlib
import os
import sys
import sysconfig
from typing import Iterator

from data import files, mixture
from data.files import one_line
from errors import DataError

SOURCES = ("stdlib", "text", "jsonl", "parquet", "hf", "tfds")
TFDS_EXTRA = "requirements-tfds.txt"
# Test suites are large, repetitive and full of deliberately odd text; they are not the
# library's prose, so they stay out of the corpus.
_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
_EXTENSIONS = {"text": (".txt", ".text", ".md"), "jsonl": (".jsonl", ".json"),
               "parquet": (".parquet",)}
_BATCH = 512  # rows pulled from a datasets table at a time


def _stat_signature(paths) -> str:
    h = hashlib.sha256()
    for p in paths:
        st = os.stat(p)
        h.update(f"{os.path.abspath(p)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _files_under(root: str) -> list[str]:
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if not x.startswith("."))
        out += [os.path.join(d, f) for f in sorted(files) if not f.startswith(".")]
    return out


class Source:
    kind = ""
    description = ""
    weights = None  # a mixture's relative token shares, one per part

    @property
    def parts(self) -> list["Source"]:
        """The sources read one after the other (each its own part of the corpus)."""
        return [self]

    def signature(self) -> str:
        raise NotImplementedError

    def documents(self) -> Iterator[str]:
        raise NotImplementedError

    def records(self) -> Iterator[tuple[str, object]]:
        """(where, record) of a source of records (jsonl files, a dataset): the chat and
        preference formats read whole records, not a text field."""
        raise DataError(f"data.source={self.kind!r} holds documents, not records: conversations "
                        f"are read from data.source=jsonl or hf")


class StdlibSource(Source):
    kind = "stdlib"

    def __init__(self):
        self.root = sysconfig.get_paths().get("stdlib") or os.path.dirname(os.__file__)
        self.description = f"the Python {sys.version.split()[0]} standard library at {self.root}"

    def files(self) -> list[str]:
        out = []
        for d, dirs, files in os.walk(self.root):
            dirs[:] = sorted(x for x in dirs if x not in _STDLIB_SKIP_DIRS)
            out += [os.path.join(d, f) for f in sorted(files) if f.endswith(".py")]
        return sorted(out, key=lambda p: os.path.relpath(p, self.root))

    def signature(self) -> str:
        return f"stdlib:{sys.version}:{_stat_signature(self.files())}"

    def documents(self) -> Iterator[str]:
        for path in self.files():
            with open(path, encoding="utf-8", errors="replace") as f:
                yield f.read()


def _text_column(ds, field: str, where: str):
    """Selects ``field`` from a datasets (Iterable)Dataset, or says which fields exist."""
    names = ds.column_names
    if names is None:  # a stream whose schema is only known once a row is read
        first = next(iter(ds), None)
        names = list(first) if first is not None else [field]
    if field not in names:
        raise DataError(f"data.text_field {field!r} is not a field of {where}; "
                        f"fields: {', '.join(map(str, names))}")
    return ds.select_columns([field])


def _rows_as_text(ds, field: str, where: str) -> Iterator[str]:
    for batch in ds.iter(batch_size=_BATCH):
        for value in batch[field]:
            if value is None:
                continue
            if isinstance(value, bytes):
                value = value.decode("utf-8", errors="replace")
            if not isinstance(value, str):
                raise DataError(f"data.text_field {field!r} of {where} holds "
                                f"{type(value).__name__} values, not text")
            yield value


def _quiet_datasets():
    try:
        import datasets
    except ImportError as e:  # pragma: no cover - datasets is in requirements.txt
        raise DataError(f"the {e.name} package is missing: pip install -r requirements.txt") from None
    datasets.disable_progress_bars()
    # We raise our own one-line DataError; the builders would log the same failure again.
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    return datasets


class FilesSource(Source):
    """Local text / jsonl / parquet files, read record by record (data/files.py): a bad record
    is named by file and line or row, and stops the run or is passed over and counted."""

    def __init__(self, kind: str, path: str, text_field: str, bad_records: str = "stop",
                 field: str = "data.path"):
        self.kind, self.text_field, self.bad_records = kind, text_field, bad_records
        self.reader = files.Reader(kind, "text" if kind == "text" else text_field, bad_records)
        if not path.strip():
            raise DataError(f"data.path is empty: data.source={kind!r} needs a file, glob or "
                            f"comma list of {'/'.join(_EXTENSIONS[kind])} files")
        self.files = []
        for pattern in (p.strip() for p in path.split(",") if p.strip()):
            pattern = os.path.expanduser(pattern)
            if os.path.isdir(pattern):
                found = [f for f in _files_under(pattern) if f.endswith(_EXTENSIONS[kind])]
            else:
                found = sorted(glob.glob(pattern, recursive=True))
            if not found:
                raise DataError(f"{field}: no {kind} file matches {pattern!r}")
            self.files += [f for f in found if os.path.isfile(f)]
        self.description = (f"{kind} file {self.files[0]}" if len(self.files) == 1
                            else f"{len(self.files)} {kind} files ({self.files[0]}, ...)")

    @property
    def bad(self) -> files.BadRecords:
        """What the last read passed over (data.bad_records=skip)."""
        return self.reader.bad

    def signature(self) -> str:
        field = "" if self.kind == "text" else self.text_field
        # Skipping keeps other documents than stopping would; "stop" keeps the old key.
        policy = ":skip-bad-records" if self.bad_records == "skip" else ""
        return f"{self.kind}:{field}{policy}:{_stat_signature(self.files)}"

    def documents(self) -> Iterator[str]:
        return self.reader.documents(self.files)

    def records(self) -> Iterator[tuple[str, object]]:
        if self.kind != "jsonl":
            return super().records()
        return self.reader.records(self.files)

    def record_signature(self) -> str:
        """The signature of the files themselves, whatever data.text_field says."""
        policy = ":skip-bad-records" if self.bad_records == "skip" else ""
        return f"{self.kind}:records{policy}:{_stat_signature(self.files)}"


class HFSource(Source):
    """A hub dataset name or a local dataset directory, through ``datasets``."""
    kind = "hf"

    def __init__(self, path: str, hf_config: str, split: str, text_field: str, streaming: bool,
                 cache_dir: str):
        if not path.strip():
            raise DataError("data.path is empty: data.source='hf' needs a dataset name or a "
                            "local dataset directory")
        self.path, self.hf_config, self.split = os.path.expanduser(path.strip()), hf_config, split
        self.text_field, self.streaming = text_field, streaming
        self.cache_dir = os.path.join(cache_dir, "hf")
        self.local = os.path.isdir(self.path)
        self.saved = self.local and any(
            os.path.exists(os.path.join(self.path, f)) for f in ("state.json", "dataset_dict.json"))
        self.description = f"dataset {self.path!r} split {split!r}"

    def signature(self) -> str:
        head = f"hf:{self.hf_config}:{self.split}:{self.text_field}"
        if self.local:
            return f"{head}:{_stat_signature(_files_under(self.path))}"
        # A hub dataset is named, not stat-able; its revision is whatever the hub serves.
        return f"{head}:hub:{self.path}"

    def _load(self):
        datasets = _quiet_datasets()
        if self.saved:
            ds = datasets.load_from_disk(self.path)
            if isinstance(ds, datasets.DatasetDict):
                if self.split not in ds:
                    raise DataError(f"data.split {self.split!r} is not in {self.path}; "
                                    f"splits: {', '.join(ds)}")
                ds = ds[self.split]
            return ds.to_iterable_dataset() if self.streaming else ds
        return datasets.load_dataset(self.path, name=self.hf_config or None, split=self.split,
                                     streaming=self.streaming, cache_dir=self.cache_dir)

    def _loaded(self):
        try:
            return self._load()
        except DataError:
            raise
        except Exception as e:
            raise DataError(f"cannot load {self.description}: {one_line(e)}") from None

    def documents(self) -> Iterator[str]:
        ds = self._loaded()
        yield from _rows_as_text(_text_column(ds, self.text_field, self.description),
                                 self.text_field, self.description)

    def records(self) -> Iterator[tuple[str, object]]:
        for n, row in enumerate(self._loaded()):
            yield f"{self.description} row {n}", row

    def record_signature(self) -> str:
        return self.signature().replace(f":{self.text_field}:", ":records:", 1)


class TfdsSource(Source):
    """A prepared TFDS dataset: ``data.path`` is the builder name, ``data.data_dir`` its root."""
    kind = "tfds"

    def __init__(self, name: str, data_dir: str, split: str, text_field: str):
        if not name.strip():
            raise DataError("data.path is empty: data.source='tfds' needs a TFDS builder name")
        self.name, self.data_dir, self.split, self.text_field = name.strip(), data_dir, split, text_field
        self.description = f"TFDS dataset {self.name!r} split {split!r}"
        self.tfds = self._import()

    @staticmethod
    def _import():
        try:
            import tensorflow_datasets as tfds
        except ImportError:
            raise DataError(f"data.source='tfds' needs TensorFlow Datasets: "
                            f"pip install -r {TFDS_EXTRA}") from None
        return tfds

    def _builder(self):
        try:
            builder = self.tfds.builder(self.name, data_dir=self.data_dir or None)
        except Exception as e:
            raise DataError(f"cannot open {self.description}: {one_line(e)}") from None
        if not builder.is_prepared():
            raise DataError(f"{self.description} is not prepared under "
                            f"{self.data_dir or 'the default data_dir'}; run its download_and_prepare first")
        return builder

    def signature(self) -> str:
        builder = self._builder()
        return (f"tfds:{self.name}:{self.split}:{self.text_field}:"
                f"{_stat_signature(_files_under(builder.data_dir))}")

    def documents(self) -> Iterator[str]:
        builder = self._builder()
        fields = list(builder.info.features.keys())
        if self.text_field not in fields:
            raise DataError(f"data.text_field {self.text_field!r} is not a field of "
                            f"{self.description}; fields: {', '.join(fields)}")
        try:
            ds = builder.as_dataset(split=self.split, shuffle_files=False)
        except Exception as e:
            raise DataError(f"cannot read {self.description}: {one_line(e)}") from None
        for example in self.tfds.as_numpy(ds):
            value = example[self.text_field]
            yield value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


class MixtureSource(Source):
    """The entries of ``data.mixture``, in order; the signature changes when any part does."""
    kind = "mixture"

    def __init__(self, parts: list[Source], weights: list[float]):
        self._parts, self.weights = parts, weights
        self.description = f"a mixture of {len(parts)} sources ({parts[0].description}, ...)"

    @property
    def parts(self) -> list[Source]:
        return list(self._parts)

    def signature(self) -> str:
        return "mixture:" + "\0".join(p.signature() for p in self._parts)

    def documents(self) -> Iterator[str]:
        for part in self._parts:
            yield from part.documents()


def make_source(data_cfg) -> Source:
    """The source named by ``data_cfg.source`` (a mixture of them with ``data_cfg.mixture``);
    raises DataError naming the valid ones."""
    entries = mixture.entries(data_cfg)
    if not entries:
        return _single(data_cfg, data_cfg.path)
    return MixtureSource([_single(data_cfg, e.path, "data.mixture") for e in entries],
                         [e.weight for e in entries])


def _single(data_cfg, path: str, field: str = "data.path") -> Source:
    kind = data_cfg.source
    if kind == "stdlib":
        return StdlibSource()
    if kind in ("text", "jsonl", "parquet"):
        return FilesSource(kind, path, data_cfg.text_field, data_cfg.bad_records, field)
    if kind == "hf":
        return HFSource(path, data_cfg.hf_config, data_cfg.split, data_cfg.text_field,
                        data_cfg.streaming, data_cfg.cache_dir)
    if kind == "tfds":
        return TfdsSource(path, data_cfg.data_dir, data_cfg.split, data_cfg.text_field)
    raise DataError(f"data.source {kind!r} is not a source; valid: {', '.join(SOURCES)}")


def documents(source: Source, max_docs: int = 0) -> Iterator[str]:
    """Non-empty documents of ``source`` in order, at most ``max_docs`` (0 = all) from each of
    its parts (each source of a mixture)."""
    for part in source.parts:
        n = 0
        for doc in part.documents():
            if not doc:
                continue
            yield doc
            n += 1
            if max_docs and n >= max_docs:
                break


def interleaved(source: Source, max_docs: int = 0) -> Iterator[str]:
    """The documents of ``documents(source, max_docs)``, one part after another in turn: the
    tokenizer reads a capped prefix of them, which then holds every source of a mixture."""
    streams = [documents(part, max_docs) for part in source.parts]
    while streams:
        for stream in list(streams):
            doc = next(stream, None)
            if doc is None:
                streams.remove(stream)
            else:
                yield doc
