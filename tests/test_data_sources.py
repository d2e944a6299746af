"""Every source reads a small real file made here; bad input gives one clear DataError line."""
import argparse
import bisect
import csv
import difflib
import fractions
import heapq
import json
import os
import sys

import ml_collections
import pytest

from configs import base
from errors import DataError
from data.sources import StdlibSource, documents, interleaved, make_source

# Real prose: module docstrings of the standard library.
DOCS = [m.__doc__.strip() for m in (json, csv, difflib, argparse, heapq, bisect, fractions)]


def data_cfg(tmp_path, **kw) -> ml_collections.ConfigDict:
    d = base.get_config().data
    d.cache_dir = str(tmp_path / "cache")
    d.update(kw)
    return d


def read(cfg, max_docs=0):
    return list(documents(make_source(cfg), max_docs))


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def assert_one_line(excinfo, *fragments):
    msg = str(excinfo.value)
    assert msg and "\n" not in msg, msg
    for frag in fragments:
        assert frag in msg, msg


# -- each source ------------------------------------------------------------------------------
def test_stdlib_is_the_running_pythons_library():
    src = StdlibSource()
    files = src.files()
    assert len(files) > 500 and files == sorted(files, key=lambda p: os.path.relpath(p, src.root))
    assert os.path.join(src.root, "os.py") in files
    assert not any(f"{os.sep}test{os.sep}" in os.path.relpath(f, src.root) for f in files)
    docs = list(documents(src, max_docs=3))
    non_empty = [f for f in files if os.path.getsize(f) > 0][:3]
    for doc, path in zip(docs, non_empty):
        with open(path, encoding="utf-8") as f:
            assert doc == f.read()
    assert src.signature() == StdlibSource().signature() and sys.version in src.signature()


def test_text_files_are_one_document_each_in_sorted_order(tmp_path):
    for i, doc in enumerate(DOCS[:4]):
        (tmp_path / f"part{3 - i}.txt").write_text(doc + "\n\nwith a second paragraph\n")
    got = read(data_cfg(tmp_path, source="text", path=str(tmp_path / "part*.txt")))
    assert got == [d + "\n\nwith a second paragraph\n" for d in reversed(DOCS[:4])]
    # A comma list keeps its order; a directory means its text files.
    pair = f"{tmp_path / 'part0.txt'},{tmp_path / 'part3.txt'}"
    assert read(data_cfg(tmp_path, source="text", path=pair)) == [got[0], got[3]]
    assert read(data_cfg(tmp_path, source="text", path=str(tmp_path))) == got


@pytest.mark.parametrize("streaming", [False, True])
def test_jsonl_rows_with_the_text_field(tmp_path, streaming):
    write_jsonl(tmp_path / "a.jsonl", [{"id": i, "body": d} for i, d in enumerate(DOCS[:4])])
    write_jsonl(tmp_path / "b.jsonl", [{"id": 9, "body": DOCS[4]}, {"id": 10, "body": ""},
                                       {"id": 11, "body": DOCS[5]}])
    cfg = data_cfg(tmp_path, source="jsonl", path=str(tmp_path / "*.jsonl"), text_field="body",
                   streaming=streaming)
    assert read(cfg) == DOCS[:6]  # the empty document is dropped
    assert read(cfg, max_docs=2) == DOCS[:2]


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": DOCS, "n": list(range(len(DOCS)))}), tmp_path / "docs.parquet")
    assert read(data_cfg(tmp_path, source="parquet", path=str(tmp_path / "docs.parquet"))) == DOCS


def test_hf_saved_dataset_dir_and_split(tmp_path):
    import datasets
    train = datasets.Dataset.from_dict({"text": DOCS[:5]})
    test = datasets.Dataset.from_dict({"text": DOCS[5:]})
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "dd"))
    train.save_to_disk(str(tmp_path / "single"))
    assert read(data_cfg(tmp_path, source="hf", path=str(tmp_path / "dd"))) == DOCS[:5]
    assert read(data_cfg(tmp_path, source="hf", path=str(tmp_path / "dd"), split="test")) == DOCS[5:]
    assert read(data_cfg(tmp_path, source="hf", path=str(tmp_path / "single"),
                         streaming=True)) == DOCS[:5]
    with pytest.raises(DataError) as e:
        read(data_cfg(tmp_path, source="hf", path=str(tmp_path / "dd"), split="validation"))
    assert_one_line(e, "data.split 'validation'", "splits: train, test")


def test_hf_directory_of_data_files(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    (tmp_path / "ds" / "data").mkdir(parents=True)
    pq.write_table(pa.table({"content": DOCS}), tmp_path / "ds" / "data" / "train-00000.parquet")
    cfg = data_cfg(tmp_path, source="hf", path=str(tmp_path / "ds"), text_field="content")
    assert read(cfg) == DOCS


def test_signature_changes_when_a_file_changes(tmp_path):
    path = tmp_path / "a.jsonl"
    write_jsonl(path, [{"text": d} for d in DOCS])
    cfg = data_cfg(tmp_path, source="jsonl", path=str(path))
    sig = make_source(cfg).signature()
    assert make_source(cfg).signature() == sig
    write_jsonl(path, [{"text": d} for d in DOCS[::-1]] + [{"text": "one more"}])
    assert make_source(cfg).signature() != sig


def test_mixture_reads_each_entry_in_order_with_max_docs_per_source(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"text": d} for d in DOCS[:4]])
    (tmp_path / "b").mkdir()
    write_jsonl(tmp_path / "b" / "x.jsonl", [{"text": d} for d in DOCS[4:]])
    cfg = data_cfg(tmp_path, source="jsonl", mixture=f"{tmp_path / 'b'}=1,{tmp_path / 'a.jsonl'}=3")
    src = make_source(cfg)
    assert src.weights == [1.0, 3.0] and len(src.parts) == 2
    assert read(cfg) == DOCS[4:] + DOCS[:4]
    assert read(cfg, max_docs=2) == DOCS[4:6] + DOCS[:2]  # at most 2 from each source
    assert list(interleaved(src)) == [DOCS[4], DOCS[0], DOCS[5], DOCS[1], DOCS[6], DOCS[2], DOCS[3]]
    sig = src.signature()
    assert make_source(data_cfg(tmp_path, source="jsonl", mixture=f"{tmp_path / 'b'}=5,"
                                f"{tmp_path / 'a.jsonl'}=1")).signature() == sig  # weights: same files
    write_jsonl(tmp_path / "a.jsonl", [{"text": d} for d in DOCS[:3]])
    assert make_source(cfg).signature() != sig


# -- bad input --------------------------------------------------------------------------------
def test_missing_file(tmp_path):
    with pytest.raises(DataError) as e:
        read(data_cfg(tmp_path, source="jsonl", path=str(tmp_path / "nope*.jsonl")))
    assert_one_line(e, "data.path: no jsonl file matches", "nope*.jsonl")


def test_empty_path(tmp_path):
    with pytest.raises(DataError) as e:
        read(data_cfg(tmp_path, source="parquet", path=""))
    assert_one_line(e, "data.path is empty")


@pytest.mark.parametrize("streaming", [False, True])
def test_missing_text_field(tmp_path, streaming):
    write_jsonl(tmp_path / "a.jsonl", [{"body": d, "id": 1} for d in DOCS])
    with pytest.raises(DataError) as e:
        read(data_cfg(tmp_path, source="jsonl", path=str(tmp_path / "a.jsonl"), streaming=streaming))
    assert_one_line(e, "data.text_field 'text' is not a field of", "fields: body, id")


def test_text_field_that_is_not_text(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"text": i} for i in range(3)])
    with pytest.raises(DataError) as e:
        read(data_cfg(tmp_path, source="jsonl", path=str(tmp_path / "a.jsonl")))
    assert_one_line(e, "holds int values, not text")


# A torn line (a writer killed mid-line) and bytes that are not UTF-8, each among good lines.
TORN = b'{"text": "fine"}\n\n{"text": "cut off he\n{"text": "after"}\n'
NOT_UTF8 = b'{"text": "fine"}\n{"text": "caf\xe9 latin-1"}\n{"text": "after"}\n'


@pytest.mark.parametrize("content,where,why", [
    (TORN, "line 3", "not JSON (Unterminated string starting at column 10)"),
    (NOT_UTF8, "line 2", "not UTF-8 (byte 0xe9 at column 14)"),
])
def test_a_bad_jsonl_record_names_its_file_and_line(tmp_path, content, where, why):
    path = tmp_path / "a.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError) as e:
        read(data_cfg(tmp_path, source="jsonl", path=str(path)))
    assert_one_line(e, f"{path} {where}: {why}", "data.bad_records=skip")


def test_skip_leaves_out_torn_records_and_replaces_invalid_utf8(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(TORN)
    (tmp_path / "b.jsonl").write_bytes(NOT_UTF8)
    source = make_source(data_cfg(tmp_path, source="jsonl", path=str(tmp_path / "*.jsonl"),
                                  bad_records="skip"))
    assert list(documents(source)) == ["fine", "after", "fine", "caf\ufffd latin-1", "after"]
    assert (source.bad.skipped, source.bad.replaced) == (1, 1)
    assert source.bad.first.startswith(f"{tmp_path / 'a.jsonl'} line 3: not JSON")
    stop = make_source(data_cfg(tmp_path, source="jsonl", path=str(tmp_path / "*.jsonl")))
    assert stop.signature() != source.signature()  # skipping keeps other documents: other caches


def test_text_and_parquet_name_the_line_or_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    (tmp_path / "a.txt").write_bytes(b"one\ntwo \xff\n")
    with pytest.raises(DataError) as e:
        read(data_cfg(tmp_path, source="text", path=str(tmp_path / "a.txt")))
    assert_one_line(e, f"{tmp_path / 'a.txt'} line 2: not UTF-8 (byte 0xff at column 5)")
    assert read(data_cfg(tmp_path, source="text", path=str(tmp_path / "a.txt"),
                         bad_records="skip")) == ["one\ntwo \ufffd\n"]
    pq.write_table(pa.table({"text": [b"good", b"bad \xff", b"good"]}), tmp_path / "b.parquet")
    with pytest.raises(DataError) as e:
        read(data_cfg(tmp_path, source="parquet", path=str(tmp_path / "b.parquet")))
    assert_one_line(e, f"{tmp_path / 'b.parquet'} row 1: not UTF-8")
    pq.write_table(pa.table({"text": ["a", None, "b"], "n": [1, 2, 3]}), tmp_path / "c.parquet")
    with pytest.raises(DataError) as e:
        read(data_cfg(tmp_path, source="parquet", path=str(tmp_path / "c.parquet"),
                      text_field="n"))
    assert_one_line(e, f"data.text_field 'n' of {tmp_path / 'c.parquet'} row 0 holds int")
    data = (tmp_path / "c.parquet").read_bytes()
    (tmp_path / "c.parquet").write_bytes(data[:len(data) // 2])  # truncated
    with pytest.raises(DataError) as e:
        read(data_cfg(tmp_path, source="parquet", path=str(tmp_path / "c.parquet")))
    assert_one_line(e, f"cannot read {tmp_path / 'c.parquet'}: ")


def test_unknown_source(tmp_path):
    with pytest.raises(DataError) as e:
        make_source(data_cfg(tmp_path, source="csv"))
    assert_one_line(e, "data.source 'csv' is not a source; valid: stdlib, text, jsonl, parquet, hf, tfds")


def test_tfds_without_the_extra_names_the_requirements_file(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)  # import now fails
    with pytest.raises(DataError) as e:
        make_source(data_cfg(tmp_path, source="tfds", path="my_dataset"))
    assert_one_line(e, "pip install -r requirements-tfds.txt")
