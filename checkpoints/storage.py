"""A checkpoint that cannot be written (no space, no permission, a vanished directory) stops
the run with one line naming the path and the cause; the partial write is removed and the
checkpoints before it stay intact, so the same command resumes once the disk is fixed.

Orbax writes in background threads. A failure there is logged by orbax with a traceback per
thread (hundreds of lines for a full disk) and raised again at the next save or wait; the
logged copies are dropped here, and the raised one becomes a StorageError.
"""
from __future__ import annotations

import errno
import logging
import os
import pathlib
import re
import shutil
import traceback

from errors import StorageError

COMMIT_MARKER = "commit_success.txt"  # orbax writes it into a step directory when it is whole

# The OS errors a save meets on a sick disk, as they read inside orbax's and tensorstore's
# messages (tensorstore wraps them in its own ValueError, so errno itself is gone).
_CAUSES = tuple(os.strerror(e) for e in (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM,
                                         errno.EROFS, errno.ENOENT, errno.EIO))
# Where orbax logs a failed save (its threads, then the manager waiting for them) before the
# failure is raised to the caller.
_BACKGROUND = ("orbax/checkpoint/_src/futures/future.py",
               "orbax/checkpoint/_src/checkpointers/async_checkpointer.py",
               "orbax/checkpoint/checkpoint_manager.py")


def cause(exc: BaseException) -> str:
    """The OS error behind a failed write, else the first line of the innermost error."""
    chain, e = [], exc
    while e is not None and len(chain) < 32:
        chain.append(e)
        e = e.__cause__ or e.__context__
    text = "\n".join(str(e) for e in chain)
    for known in _CAUSES:
        if known in text:
            return known
    lines = str(chain[-1]).strip().splitlines()
    return lines[0] if lines else type(chain[-1]).__name__


def remove_partial(directory: pathlib.Path, step: int, commit_marker: str) -> None:
    """Removes what a failed save of ``step`` left: its tmp directory, or a step directory
    that never got its commit marker."""
    for p in directory.glob(f"{step}.orbax-checkpoint-tmp*"):
        shutil.rmtree(p, ignore_errors=True)
    final = directory / str(step)
    if final.is_dir() and not (final / commit_marker).exists():
        shutil.rmtree(final, ignore_errors=True)


def failed(step: int, path: pathlib.Path, exc: BaseException, newest: int | None,
           newest_path: pathlib.Path | None) -> StorageError:
    """The one-line error of a save that could not be written."""
    kept = (f"newest complete checkpoint: step {newest} ({newest_path})" if newest is not None
            else "no checkpoint was complete before it")
    return StorageError(
        f"cannot write checkpoint step {step} to {path}: {cause(exc)}; removed the partial write "
        f"and stopped ({kept}); free space or fix permissions there (or use another --workdir) "
        f"and rerun the same command to resume")


# tensorstore's failed open (any status, as before), or a read or write that failed for the
# storage's sake (full, gone, unreadable, refused): an absl status code, then what it was doing.
# A write refused as INVALID_ARGUMENT or INTERNAL is a bug, and stays reported.
_TENSORSTORE_IO = re.compile(
    r"[A-Z_]+: Error opening |(RESOURCE_EXHAUSTED|OUT_OF_RANGE|NOT_FOUND|DATA_LOSS|UNAVAILABLE"
    r"|PERMISSION_DENIED): Error (reading|writing) ")


def _not_a_background_failure(record: logging.LogRecord) -> bool:
    return not (record.levelno >= logging.ERROR
                and record.pathname.replace(os.sep, "/").endswith(_BACKGROUND))


def not_an_orphaned_future(record: logging.LogRecord) -> bool:
    """False (drop) for asyncio's report of an orbax/tensorstore future nobody awaited.

    When one read or write of a checkpoint fails, its siblings' futures are left unread (the
    failure itself reaches us once, and becomes one line); asyncio logs each with a traceback
    ("... exception was never retrieved") when it is collected: a read's is tensorstore's
    "Error opening", a write's tensorstore's "Error writing" (with no Python frames: it fails in
    C++) or (newer orbax) one ending in orbax's own frames."""
    if record.levelno < logging.ERROR or "exception was never retrieved" not in record.getMessage():
        return True
    exc, tb = (record.exc_info[1], record.exc_info[2]) if record.exc_info else (None, None)
    if isinstance(exc, ValueError) and _TENSORSTORE_IO.match(str(exc)):
        return False
    frames = traceback.extract_tb(tb) if tb is not None else []
    return not any("/orbax/" in f.filename.replace(os.sep, "/") for f in frames)


def quiet_orphaned_futures() -> None:
    """Drops asyncio's reports of the futures a failed read or write leaves unread."""
    logger = logging.getLogger("asyncio")
    if not_an_orphaned_future not in logger.filters:
        logger.addFilter(not_an_orphaned_future)


def quiet_background_failures() -> None:
    """Drops orbax's logged copies of a background save's failure (it is raised again)."""
    absl_logger = logging.getLogger("absl")
    if _not_a_background_failure not in absl_logger.filters:
        absl_logger.addFilter(_not_a_background_failure)
    quiet_orphaned_futures()
