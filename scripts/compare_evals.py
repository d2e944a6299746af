"""Loss by position of several evaluations side by side: one table, one plot.

    python scripts/compare_evals.py NAME=DIR [NAME=DIR ...] [--out FILE.png] [--mark N]

Each DIR holds a scripts/eval.py ``eval.json`` (its --out), e.g. the same run evaluated past its
training length with plain RoPE, YaRN and dynamic NTK (docs/huggingface.md). Prints a markdown
table of the mean loss per position bucket (one column each) and draws the curves in one plot;
``--mark N`` draws a vertical line at position N (the length the model was trained at).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("evals", nargs="+", help="NAME=DIR, DIR holding eval.json")
    p.add_argument("--out", default=None, help="the plot (PNG); none without it")
    p.add_argument("--mark", type=int, default=0, help="a vertical line at this position")
    return p.parse_args(argv)


def load(items: list[str]) -> dict[str, dict]:
    out = {}
    for item in items:
        name, eq, directory = item.partition("=")
        path = pathlib.Path(directory if eq else name) / "eval.json"
        try:
            out[name] = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"error: {path}: not a scripts/eval.py result ({e})")
    edges = {tuple((b["start"], b["end"]) for b in r["buckets"]) for r in out.values()}
    if len(edges) != 1:
        raise SystemExit("error: the evaluations have different position buckets; give "
                         "scripts/eval.py the same --buckets and data.seq_len")
    return out


def table(results: dict[str, dict]) -> str:
    names = list(results)
    first = results[names[0]]["buckets"]
    lines = ["| positions | tokens | " + " | ".join(names) + " |",
             "|---|---|" + "---|" * len(names)]
    for i, b in enumerate(first):
        cells = []
        for name in names:
            loss = results[name]["buckets"][i]["loss"]
            cells.append("-" if loss is None else f"{loss:.3f}")
        lines.append(f"| {b['start']}-{b['end'] - 1} | {b['tokens']} | " + " | ".join(cells) + " |")
    lines.append("| all | | " + " | ".join(f"{results[n]['loss']:.3f}" for n in names) + " |")
    return "\n".join(lines)


def plot(results: dict[str, dict], path: pathlib.Path, mark: int):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results.items():
        rows = [b for b in r["buckets"] if b["loss"] is not None]
        ax.plot([(b["start"] + b["end"]) / 2 for b in rows], [b["loss"] for b in rows],
                marker="o", label=name)
    if mark:
        ax.axvline(mark, color="gray", linestyle="--", linewidth=1, label=f"trained at {mark}")
    ax.set_xlabel("position in document (tokens of context)")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("loss by position")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    results = load(args.evals)
    print(table(results))
    if args.out:
        out = pathlib.Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        plot(results, out, args.mark)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
