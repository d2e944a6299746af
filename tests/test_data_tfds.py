"""The optional TFDS source, read for real (``make test`` installs requirements-tfds.txt), and
the one-line error naming that file where TFDS is not installed (``make demo``'s venv)."""
import bisect
import csv
import difflib
import heapq
import importlib.util
import json
import sys

import numpy as np
import pytest

from configs import base
from errors import DataError
from data.sources import documents, make_source

DOCS = [m.__doc__.strip() for m in (json, csv, difflib, heapq, bisect, np)]  # real prose
HAVE_TFDS = importlib.util.find_spec("tensorflow_datasets") is not None


def tfds_cfg(tmp_path, **kw):
    d = base.get_config().data
    d.update(source="tfds", path="stdlib_docstrings", data_dir=str(tmp_path / "tfds"),
             cache_dir=str(tmp_path / "cache"))
    d.update(kw)
    return d


def prepare_dataset(tmp_path):
    """A real TFDS dataset, generated and prepared locally: docstrings, split train/test."""
    import tensorflow_datasets as tfds

    class StdlibDocstrings(tfds.core.GeneratorBasedBuilder):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
                {"text": tfds.features.Text(), "id": np.int64}))

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples(DOCS[:5], 0),
                    "test": self._generate_examples(DOCS[5:], 5)}

        def _generate_examples(self, docs, first):
            for i, doc in enumerate(docs):
                yield first + i, {"text": doc, "id": first + i}

    StdlibDocstrings(data_dir=str(tmp_path / "tfds")).download_and_prepare()


def test_tfds_missing_is_one_line_naming_the_requirements_file(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)  # import fails as if absent
    with pytest.raises(DataError) as e:
        make_source(tfds_cfg(tmp_path))
    assert str(e.value) == ("data.source='tfds' needs TensorFlow Datasets: "
                            "pip install -r requirements-tfds.txt")


def test_tfds_source(tmp_path):
    assert HAVE_TFDS, ("tensorflow-datasets is not installed in this venv: `make test` installs "
                       "it (or: pip install -r requirements-tfds.txt)")
    prepare_dataset(tmp_path)
    train = list(documents(make_source(tfds_cfg(tmp_path))))
    assert sorted(train) == sorted(DOCS[:5])  # TFDS stores examples in its own (fixed) order
    assert list(documents(make_source(tfds_cfg(tmp_path)))) == train
    assert sorted(documents(make_source(tfds_cfg(tmp_path, split="test")))) == sorted(DOCS[5:])
    with pytest.raises(DataError, match=r"data.text_field 'body' is not a field of TFDS dataset "
                                        r"'stdlib_docstrings' split 'train'; fields: "):
        list(documents(make_source(tfds_cfg(tmp_path, text_field="body"))))
    with pytest.raises(DataError, match="is not prepared under"):
        make_source(tfds_cfg(tmp_path, data_dir=str(tmp_path / "elsewhere"))).signature()
