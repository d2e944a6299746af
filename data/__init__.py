"""Data pipeline: sources, tokenizer, packing, layout permutation at batch construction.

Entry point: ``data.pipeline.make_pipeline(config, mesh)``.
"""


class DataError(ValueError):
    """A user mistake in the data setup; the message is one line the trainer prints before exiting."""
