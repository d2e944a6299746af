"""Data pipeline: sources, tokenizer, packing, layout permutation at batch construction.

Entry point: ``data.pipeline.make_pipeline(config, mesh)``.
"""

from errors import DataError  # noqa: F401  (re-exported: ``from data import DataError``)
