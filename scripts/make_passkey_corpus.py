"""Write a jsonl corpus of passkey documents (data/passkey.py's format, or RULER's) to train on.

    python scripts/make_passkey_corpus.py --out runs/passkey_short.jsonl --docs 4000 \
        --min-sentences 1 --max-sentences 20 [--seed 0] [--format passkey|ruler]

Each line is {"text": ...}: filler sentences with "The pass key is N. Remember it. N is the
pass key." between two of them, then "What is the pass key? The pass key is N." The number of
filler sentences is uniform in [--min-sentences, --max-sentences] (about 5 tokens each), so
the longest documents set how far back a trained model has learnt to look.
Train on it with --config.data.source=jsonl --config.data.path=FILE.

--format ruler writes RULER's needle-in-a-haystack prompts with their answers instead
(data/ruler.py: lm-evaluation-harness's niah_single_1 and niah_multikey_2 formats, half each;
--haystack repeat|needle for one of them), with --min/--max-sentences haystack lines.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="jsonl file to write")
    p.add_argument("--docs", type=int, default=4000)
    p.add_argument("--min-sentences", type=int, default=1)
    p.add_argument("--max-sentences", type=int, default=20)
    p.add_argument("--digits", type=int, default=5, help="digits of each pass key")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--format", choices=("passkey", "ruler"), default="passkey")
    p.add_argument("--haystack", choices=("both", "repeat", "needle"), default="both",
                   help="ruler: the repeated sentence (niah_single_1), other keys' needles "
                        "(niah_multikey_2), or half each")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import numpy as np

    from data import passkey, ruler
    if args.docs < 1 or not 0 <= args.min_sentences <= args.max_sentences or args.digits < 1:
        print(f"error: need --docs >= 1, 0 <= --min-sentences <= --max-sentences and "
              f"--digits >= 1 (got {args.docs}, {args.min_sentences}, {args.max_sentences}, "
              f"{args.digits})", file=sys.stderr)
        return 2
    rng = np.random.default_rng(args.seed)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        for _ in range(args.docs):
            n = int(rng.integers(args.min_sentences, args.max_sentences + 1))
            if args.format == "ruler":
                haystack = (ruler.HAYSTACKS[int(rng.integers(2))] if args.haystack == "both"
                            else args.haystack)
                text = ruler.document(rng, n, haystack)
            else:
                text = passkey.document(rng, n, args.digits)
            f.write(json.dumps({"text": text}) + "\n")
    what = "RULER needle-in-a-haystack" if args.format == "ruler" else "passkey"
    print(f"wrote {args.docs} {what} documents ({args.min_sentences}-{args.max_sentences} "
          f"{'haystack lines' if args.format == 'ruler' else 'filler sentences'}) to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
