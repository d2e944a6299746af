"""scripts/test_times.py: the suite's CPU per file and its costliest tests, from conftest's lines."""
import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("test_times", os.path.join(ROOT, "scripts", "test_times.py"))
tt = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tt)


def test_per_file_sums_and_orders_by_cpu(tmp_path, rng, capsys):
    rows = [{"test": f"tests/test_{f}.py::test_{i}", "self": float(rng.uniform(0, 9)),
             "children": float(rng.uniform(0, 9)), "wall": float(rng.uniform(0, 20))}
            for f in "abc" for i in range(int(rng.integers(1, 5)))]
    path = tmp_path / "cpu.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = tt.per_file(tt.load(str(path)))
    want = {}
    for r in rows:
        f = r["test"].split("::")[0]
        n, cpu, wall = want.get(f, (0, 0.0, 0.0))
        want[f] = (n + 1, cpu + r["self"] + r["children"], wall + r["wall"])
    assert {f: (n, round(c, 9), round(w, 9)) for f, n, c, w in got} == \
        {f: (n, round(c, 9), round(w, 9)) for f, (n, c, w) in want.items()}
    assert [g[2] for g in got] == sorted((g[2] for g in got), reverse=True)
    assert tt.main([str(path), "--top", "2", "--scale", "2"]) == 0
    out = capsys.readouterr().out
    total = sum(r["self"] + r["children"] for r in rows)
    assert out.startswith(f"{len(rows)} tests, {total * 2 / 60:.1f} CPU minutes (x2)")
    costliest = max(rows, key=lambda r: r["self"] + r["children"])
    name = costliest["test"].split("tests/", 1)[-1]
    assert f"| {name} | {(costliest['self'] + costliest['children']) * 2:.1f} |" in out


def test_a_missing_file_is_one_line(tmp_path, capsys):
    assert tt.main([str(tmp_path / "nope.jsonl")]) == 2
    assert capsys.readouterr().err.startswith(f"error: {tmp_path / 'nope.jsonl'}: ")
