"""train.py as on a disk that fills up at checkpoint step FAIL_SAVES_FROM: the fallback of
tests/test_faults.py where a small tmpfs cannot be mounted (no user namespaces).

    FAIL_SAVES_FROM=4 python tests/no_space.py train.py --config ...

From that step on, a save leaves what a write cut short leaves (orbax's tmp directory) and
fails with ENOSPC, as tensorstore's writes do on a full disk.
"""
import errno
import os
import runpy
import sys

import orbax.checkpoint as ocp

FROM = int(os.environ["FAIL_SAVES_FROM"])
_save = ocp.CheckpointManager.save


def save(self, step, *args, **kwargs):
    if step >= FROM:
        partial = self.directory / f"{step}.orbax-checkpoint-tmp" / "state"
        partial.mkdir(parents=True, exist_ok=True)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(partial))
    return _save(self, step, *args, **kwargs)


ocp.CheckpointManager.save = save
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
runpy.run_path(sys.argv[0], run_name="__main__")
