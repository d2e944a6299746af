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


def test_per_worker_busy_time_and_last_end(rng):
    start = 1.7e9 + float(rng.uniform(0, 1e6))
    rows, want = [], {}
    for w in ("gw0", "gw1", "gw2"):
        t = start + float(rng.uniform(0, 3))  # each worker's first test starts a little apart
        busy = 0.0
        for _ in range(int(rng.integers(1, 6))):
            wall = float(rng.uniform(0.1, 30))
            t += wall
            busy += wall
            rows.append({"test": "tests/test_a.py::t", "self": 0.0, "children": 0.0,
                         "wall": wall, "worker": w, "end": t})
        want[w] = (busy, t)
    rows.append({"test": "tests/test_b.py::old", "self": 1.0, "children": 0.0, "wall": 1.0})
    first = min(r["end"] - r["wall"] for r in rows if "end" in r)
    got = tt.per_worker(rows)
    assert [g[0] for g in got] == ["gw0", "gw1", "gw2"]
    for w, n, busy, end in got:
        assert n == sum(r.get("worker") == w for r in rows)
        assert abs(busy - want[w][0]) < 1e-6 and abs(end - (want[w][1] - first)) < 1e-6
    assert tt.per_worker([{"test": "x", "self": 0, "children": 0, "wall": 1}]) == []


def test_jax_phases_sum_and_count_cache_hits(tmp_path, rng, capsys):
    rows = [{"test": f"tests/test_a.py::test_{i}", "self": 1.0, "children": 0.0, "wall": 1.0,
             **{k: float(rng.uniform(0, 5)) for k in tt.PHASES},
             "hits": float(rng.integers(0, 4)), "requests": float(rng.integers(4, 9))}
            for i in range(int(rng.integers(2, 6)))]
    rows.append({"test": "tests/test_b.py::test_old", "self": 1.0, "children": 0.0, "wall": 1.0})
    path = tmp_path / "cpu.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = tt.jax_phases(tt.load(str(path)))
    for k in (*tt.PHASES, "hits", "requests"):
        assert abs(got[k] - sum(r.get(k, 0) for r in rows)) < 1e-9
    assert tt.jax_phases(rows[-1:]) is None
    assert tt.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert f"answered {got['hits']:.0f} of the {got['requests']:.0f} compiles that asked it" in out
