"""scripts/bench_data.py runs end to end on a small slice and reports consistent numbers."""
import importlib.util
import json
import os

import pytest

from model.flops import flops_per_token

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_data", os.path.join(ROOT, "scripts", "bench_data.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_reports_rates_and_the_ratio(bench, tmp_path, capsys):
    out = tmp_path / "bench.json"
    r = bench.main(["--seq-len", "256", "--batch", "4", "--vocab", "300", "--max-docs", "12",
                    "--batches", "3", "--json", str(out)])
    assert json.loads(out.read_text()) == r
    rates = r["tokens_per_s"]
    assert all(rates[k] > 0 for k in ("tokenize", "pack", "batch", "iterator", "end_to_end"))
    # End-to-end cannot beat either of its stages.
    assert rates["end_to_end"] < min(rates["tokenize"], rates["batch"])
    model, _ = bench.llama_1b_model()
    assert model.num_layers == 22 and model.d_model == 2048
    assert r["h100_consumption_tokens_per_s"] == pytest.approx(0.5 * 989e12 / flops_per_token(model, 256))
    assert r["ratio_end_to_end"] == pytest.approx(rates["end_to_end"] / r["h100_consumption_tokens_per_s"])
    assert r["documents"] == 12 and r["corpus_tokens"] > 1000
    table = capsys.readouterr().out
    assert "end-to-end cold" in table and f"{r['ratio_end_to_end']:.1f}x" in table
