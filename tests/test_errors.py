"""User errors live in errors.py, below every layer: each layer raises the same classes, and the
entry point reports all of them as one line."""
import ast
import pathlib

import errors
from checkpoints import compat
from configs import loading
from data import DataError
from parallel import layouts, mesh
from training.entry import user_errors

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_each_layer_raises_the_classes_of_errors_py():
    assert compat.CheckpointError is errors.CheckpointError
    assert loading.ConfigFileError is errors.ConfigFileError
    assert layouts.LayoutError is errors.LayoutError
    assert mesh.MeshError is errors.MeshError
    assert DataError is errors.DataError
    from parallel import kernels
    assert kernels.KernelError is errors.KernelError
    for cls in (errors.ConfigError, errors.ConfigFileError, errors.CheckpointError,
                errors.LayoutError, errors.MeshError, errors.DataError, errors.KernelError):
        assert issubclass(cls, user_errors()), cls
        assert issubclass(cls, ValueError), cls  # callers that catch ValueError still do


def imported_modules(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_imports_point_downward():
    assert imported_modules(ROOT / "errors.py") == set()  # nothing of the project, no jax
    assert imported_modules(ROOT / "accelerators.py") == {"__future__"}  # the peaks table too
    for path in sorted((ROOT / "training").glob("*.py")):
        up = [m for m in imported_modules(path) if m.split(".")[0] == "planning"]
        assert not up, f"training/{path.name} imports {up} from the planning layer"
    for path in sorted((ROOT / "checkpoints").glob("*.py")):
        up = [m for m in imported_modules(path) if m.split(".")[0] in ("training", "model")]
        assert not up, f"{path.name} imports {up} from the model or training layer"


def test_the_entry_points_settle_the_collector_once():
    """conftest settles it as train.py's entry does (training/entry.settle_gc): the imports
    frozen, full collections rarer; a second call (an entry point run inside a process that has
    settled) freezes nothing more, so what a test made later stays collectable."""
    import gc
    import weakref

    from training.entry import GC_THRESHOLDS, settle_gc

    class Node:
        pass
    assert gc.get_threshold() == GC_THRESHOLDS
    frozen = gc.get_freeze_count()
    assert frozen > 10_000  # the imports: jax, numpy, pytest ...
    cycle = Node()
    cycle.me = cycle
    alive = weakref.ref(cycle)
    settle_gc()
    assert gc.get_freeze_count() == frozen
    del cycle
    gc.collect()
    assert alive() is None  # the new cycle was not frozen: collected
