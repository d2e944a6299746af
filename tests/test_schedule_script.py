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


def test_window_rows(capsys):
    """--window 2048 on 4 devices, 16k, tile 128 (C = 4096, 32 tiles a chunk, the band 16
    tiles deep): a contiguous device computes sum(min(i, 16) + 1) = 408 tiles of its own chunk
    and 16 + 15 + ... + 1 = 136 of the previous one, then stops: 2 of 4 hops, 544 on the
    critical path. Striped keeps all 4 rounds, and its strided tiles cover more of the band."""
    _script().main(["--devices", "4", "--seq-len", "16384", "--block", "128", "--window", "2048",
                    "--layouts", "contiguous,striped"])
    out = capsys.readouterr().out.splitlines()
    assert "| 4 | 32 | 544 | 0.94 | 1.000 | 2 of 4 |" in out
    assert "| 4 | 32 | 600 | 1.00 | 0.907 | 4 of 4 |" in out
