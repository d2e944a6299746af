"""Local text / jsonl / parquet files, read record by record so that a bad one is named by file
and line (or row), and either stops the run or is counted and passed over
(``data.bad_records=stop|skip``).

Under ``skip``, a record that cannot be parsed (a torn JSON line) is left out and bytes that
are not UTF-8 are replaced (U+FFFD); both are counted in a ``BadRecords`` tally that the
pipeline reports in its startup line and keeps beside the token cache, so a resumed run, which
reads the cache, reports the same. Every read is sequential and streams (memory stays flat).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Iterator

from errors import DataError

POLICIES = ("stop", "skip")
_FIX = "fix the file or set data.bad_records=skip to pass over such records"


@dataclasses.dataclass
class BadRecords:
    """What ``skip`` passed over in one read of a source."""
    skipped: int = 0  # records left out (not JSON)
    replaced: int = 0  # records whose invalid UTF-8 was replaced
    first: str = ""  # where the first one was, and what was wrong

    def add(self, kind: str, where: str, why: str) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        self.first = self.first or f"{where}: {why}"

    def merge(self, other: "BadRecords") -> None:
        self.skipped += other.skipped
        self.replaced += other.replaced
        self.first = self.first or other.first

    def __bool__(self) -> bool:
        return bool(self.skipped or self.replaced)


def tally(sources) -> BadRecords:
    """The bad records of the last read of each source (those read through a Reader)."""
    total = BadRecords()
    for source in sources:
        if isinstance(getattr(source, "bad", None), BadRecords):
            total.merge(source.bad)
    return total


class Reader:
    """Documents of one kind of file under one ``data.bad_records`` policy."""

    def __init__(self, kind: str, text_field: str, policy: str):
        self.kind, self.field, self.policy = kind, text_field, policy
        self.bad = BadRecords()

    def documents(self, paths: list[str]) -> Iterator[str]:
        self.bad = BadRecords()  # this pass's tally: the last full pass is the one reported
        read = {"text": self._text, "jsonl": self._jsonl, "parquet": self._parquet}[self.kind]
        for path in paths:
            yield from read(path)

    def records(self, paths: list[str]) -> Iterator[tuple[str, object]]:
        """(where, record) of every JSON record of jsonl files (a line, or an element of a .json
        array), as parsed: what a record holds is the caller's to check (data/chat.py). A line
        that is not JSON stops the read or is counted and passed over, as for documents."""
        if self.kind != "jsonl":
            raise DataError(f"records are read from jsonl files, not {self.kind}")
        self.bad = BadRecords()
        for path in paths:
            if _first_byte(path) == b"[":
                for n, record in enumerate(_json_array(path), 1):
                    yield f"{path} record {n}", record
            else:
                for n, record in self._json_lines(path):
                    yield f"{path} line {n}", record

    def _decode(self, raw: bytes, where: str) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            column = e.start - raw.rfind(b"\n", 0, e.start)
            why = f"not UTF-8 (byte 0x{raw[e.start]:02x} at column {column})"
            if self.policy == "stop":
                raise DataError(f"{where}: {why}; {_FIX}") from None
            self.bad.add("replaced", where, why)
            return raw.decode("utf-8", errors="replace")

    def _text(self, path: str) -> Iterator[str]:
        # A text file is one document: lines or paragraphs would cut documents apart.
        raw = _read_bytes(path)
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError as e:
            line = raw.count(b"\n", 0, e.start) + 1
            yield self._decode(raw, f"{path} line {line}")

    def _jsonl(self, path: str) -> Iterator[str]:
        if _first_byte(path) == b"[":  # a .json file holding one array of records
            yield from self._records(path, "record", enumerate(_json_array(path), 1))
            return
        yield from self._records(path, "line", self._json_lines(path))

    def _json_lines(self, path: str) -> Iterator[tuple[int, object]]:
        with _open(path) as f:
            for n, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                where = f"{path} line {n}"
                try:
                    yield n, json.loads(self._decode(raw.rstrip(b"\r\n"), where))
                except json.JSONDecodeError as e:
                    why = f"not JSON ({e.msg.removesuffix(' at')} at column {e.colno})"
                    if self.policy == "stop":
                        raise DataError(f"{where}: {why}; {_FIX}") from None
                    self.bad.add("skipped", where, why)

    def _records(self, path: str, unit: str, records) -> Iterator[str]:
        for n, record in records:
            where = f"{path} {unit} {n}"
            if not isinstance(record, dict) or self.field not in record:
                fields = ", ".join(map(str, record)) if isinstance(record, dict) else "none"
                raise DataError(f"data.text_field {self.field!r} is not a field of {where}; "
                                f"fields: {fields}")
            yield from self._value(record[self.field], where)

    def _value(self, value, where: str) -> Iterator[str]:
        if value is None:
            return
        if isinstance(value, bytes):
            value = self._decode(value, where)
        if not isinstance(value, str):
            raise DataError(f"data.text_field {self.field!r} of {where} holds "
                            f"{type(value).__name__} values, not text")
        yield value

    def _parquet(self, path: str) -> Iterator[str]:
        import pyarrow as pa
        import pyarrow.parquet as pq
        try:
            f = pq.ParquetFile(path)
        except Exception as e:  # not parquet, truncated: pyarrow's own one-line reason
            raise DataError(f"cannot read {path}: {one_line(e)}") from None
        names = f.schema_arrow.names
        if self.field not in names:
            raise DataError(f"data.text_field {self.field!r} is not a field of {path}; "
                            f"fields: {', '.join(names)}")
        row = 0
        for group in range(f.num_row_groups):
            try:
                column = f.read_row_group(group, columns=[self.field]).column(0)
            except Exception as e:
                raise DataError(f"cannot read {path} row group {group} (rows from {row}): "
                                f"{one_line(e)}") from None
            if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
                column = column.cast(pa.binary())  # decoded below, so bad bytes are named
            for value in column.to_pylist():
                yield from self._value(value, f"{path} row {row}")
                row += 1


def _open(path: str):
    try:
        return open(path, "rb")
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror}") from None


def _read_bytes(path: str) -> bytes:
    with _open(path) as f:
        return f.read()


def _first_byte(path: str) -> bytes:
    with _open(path) as f:
        for line in f:
            if line.strip():
                return line.lstrip()[:1]
    return b""


def _json_array(path: str) -> list:
    raw = _read_bytes(path)
    try:
        return json.loads(raw.decode("utf-8", errors="strict"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"cannot read {path}: {one_line(e)}; {_FIX}") from None


def one_line(exc: BaseException) -> str:
    """The innermost cause's message, first line only: datasets wraps errors in generic ones."""
    for _ in range(32):  # chains are short; the bound only guards against a cycle
        inner = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
        if inner is None:
            break
        exc = inner
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")
