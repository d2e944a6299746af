"""scripts/schedule.py --impls: the strategy tile counts the README quotes, printed by a command."""
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README_IMPLS = ["--impls", "--devices", "4", "--seq-len", "16384", "--block", "128",
                "--layouts", "contiguous,striped"]


def _script():
    spec = importlib.util.spec_from_file_location("schedule_script",
                                                  os.path.join(ROOT, "scripts", "schedule.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_impls_prints_the_readme_tile_counts(capsys):
    """The README's 4-device, 16k, tile-128 figures: every row's total work (8,256 tiles for
    contiguous, 8,448 for striped) and usp's critical path on contiguous against the ring's
    (3,088 against 3,600)."""
    _script().main(README_IMPLS)
    out = capsys.readouterr().out.splitlines()
    assert "| layout | total tiles | ring | allgather | ulysses | usp(U=2) |" in out
    assert "| contiguous | 8,256 | 3,600 | 3,600 | 2,064 | 3,088 |" in out
    assert "| striped | 8,448 | 2,112 | 2,112 | 2,112 | 2,112 |" in out


def test_impl_rows_mark_a_usp_degree_that_does_not_divide():
    header, rows = _script().impl_rows(["zigzag"], 4096, 2, 64, impls=("ring", "usp"), ulysses=4)
    assert header == ["layout", "total tiles", "ring", "usp(U=4)"]
    assert rows[0][3] is None and rows[0][2] > 0


def test_impls_rejects_an_unknown_strategy(capsys):
    with pytest.raises(SystemExit) as e:
        _script().main(["--impls", "ring,rng", "--devices", "4", "--seq-len", "1024"])
    assert e.value.code == 2 and "--impls rng" in capsys.readouterr().err
