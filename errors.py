"""User errors: mistakes the user can fix (a config value, a file, a checkpoint, a mesh), each
reported as one line and exit code 2 by the entry points, never as a traceback.

They live here, at the top, so that every layer (configs, data, parallel, checkpoints,
training, scripts) imports them downward; this module imports nothing of the project.
"""


class UserError(ValueError):
    """A mistake the user can fix; the message is one line saying what is wrong and what would
    be valid."""


class ConfigError(UserError):
    """A config value that cannot run; the message names the field, the value and what is valid."""


class ConfigFileError(ConfigError):
    """A config file or override that cannot be used (no such file, no such field, a value of
    the wrong type)."""


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used with this config, or none usable at all."""


class StorageError(UserError):
    """A file the run must write cannot be written: no space, no permission, a vanished
    directory; the message names the path and the cause."""


class LayoutError(UserError):
    """A layout request that cannot be satisfied."""


class MeshError(UserError):
    """A mesh that cannot be built on these devices."""


class DataError(UserError):
    """A mistake in the data setup (source, files, tokenizer, split)."""


class KernelError(UserError):
    """An attention kernel request that cannot run (an unknown name)."""


class ConversionError(UserError):
    """A Hugging Face checkpoint or a run that cannot be converted (another architecture, a
    setting the model does not have, missing or malformed files)."""


class ClusterError(UserError):
    """A launch whose place in a run cannot be found (a cluster step with variables missing or
    malformed, a coordinator the other hosts cannot reach) or a run directory another live run
    is writing."""


class EvalError(UserError):
    """An evaluation request that cannot run: an unknown model argument, a prompt longer than
    the model's max_length, a chat template the tokenizer lacks, an offline task's missing
    data."""
