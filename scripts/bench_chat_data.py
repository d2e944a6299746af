"""How long chat data takes to tokenize: one long agentic conversation, and many short ones, with
each family's chat template (data/chat_template.py, data/sft.py ``tokenize``).

Turn-by-turn masking (templates without generation marks) finds each assistant turn by
rendering the conversation up to it, twice: quadratic in the turns. The linear path
(``ChatTemplate._fast_turns``) finds the first and last turns so and the others from one more
render of the whole conversation. This script times both on the same conversations, in one
run, and checks they give the same masks:

  turn by turn  every turn rendered up to it (the linear path switched off for the template)
  linear        the default, once a template has earned trust (TRUST_AFTER conversations on
                which both paths agreed; the script earns it first, untimed)

Rows: ``one long`` (one conversation of --turns messages: user questions, assistant answers,
and every third answer an agent's tool call and the tool's reply first: Qwen3's template
renders those), ``many`` (--count conversations of 1-4 exchanges, some with a system prompt:
render, mask and encode with the family's tokenizer). Median of --repeats after one warm-up.

Run:  python scripts/bench_chat_data.py [--turns 200] [--count 10000] [--repeats 3]
          [--families qwen3,smollm2,llama3,gemma3,phi3] [--json bench_out/chat_data.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# the families' templates as their tokenizer_config.json files carry them, with small
# tokenizers that know their special tokens: the test data of tests/test_chat_template.py
sys.path.insert(0, os.path.join(ROOT, "tests"))

WORDS = ("the a of to in is that for it as with was on be by this are from or an which at but "
         "function returns value list string file path module class object error type").split()


def sentence(rng, lo=4, hi=30) -> str:
    return " ".join(rng.choice(WORDS, int(rng.integers(lo, hi))))


def agentic(rng, messages: int, tools: bool) -> list[dict]:
    """User questions and assistant answers, every third answer preceded (where ``tools``) by a
    tool call and the tool's reply, to about ``messages`` messages."""
    out = [{"role": "system", "content": sentence(rng)}]
    k = 0
    while len(out) < messages:
        out.append({"role": "user", "content": sentence(rng)})
        if tools and k % 3 == 2:
            out += [{"role": "assistant", "content": "", "tool_calls": [{
                "type": "function", "function": {"name": "search", "arguments": {
                    "query": sentence(rng, 2, 5)}}}]},
                    {"role": "tool", "content": sentence(rng)}]
        out.append({"role": "assistant", "content": sentence(rng)})
        k += 1
    return out


def short(rng) -> dict:
    messages = [{"role": "system", "content": sentence(rng)}] if rng.random() < 0.3 else []
    for _ in range(int(rng.integers(1, 5))):
        messages += [{"role": "user", "content": sentence(rng)},
                     {"role": "assistant", "content": sentence(rng)}]
    return {"messages": messages}


def timed(fn, repeats: int) -> tuple[float, object]:
    fn()  # warm-up: the template compiled, caches filled
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=200, help="messages in the long conversation")
    ap.add_argument("--count", type=int, default=10000, help="short conversations")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--families", default="qwen3,smollm2,llama3,gemma3,phi3")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    import numpy as np
    import chat_templates as ct
    from data import chat_template, sft
    rows = []
    for family in args.families.split(","):
        source, _, special = ct.FAMILIES[family]
        template = chat_template.ChatTemplate(source, family, special)
        tok = ct.tokenizer(family)
        rng = np.random.default_rng(0)
        # Gemma 3's template takes no tool role; the others get the agent's turns
        long = agentic(rng, args.turns, tools=family == "qwen3")
        records = [(f"record {i}", short(rng)) for i in range(args.count)]

        def one():
            return template.spans(long)

        def many():
            return sft.tokenize(records, template, tok, "assistant")

        # earn the template's trust (both paths computed and compared), then time each
        before = chat_template._TRUSTED.get(template.digest)
        for _ in range(chat_template.TRUST_AFTER):
            one()
        trusted = chat_template._TRUSTED.get(template.digest, 0)
        got = {}
        for path, trust in (("turn by turn", -1), ("linear", trusted)):
            chat_template._TRUSTED[template.digest] = trust
            t_one, spans = timed(one, args.repeats)
            t_many, conv = timed(many, max(1, args.repeats // 2))
            got[path] = (spans, conv)
            rows.append({"family": family, "path": path, "messages": len(long),
                         "assistant_turns": sum(m["role"] == "assistant" for m in long),
                         "one_long_s": t_one, "conversations": args.count, "many_s": t_many,
                         "trusted": trust >= chat_template.TRUST_AFTER})
        if before is None:  # as it was: the script's main() may run inside a longer process
            chat_template._TRUSTED.pop(template.digest, None)
        else:
            chat_template._TRUSTED[template.digest] = before
        (a, ca), (b, cb) = got["turn by turn"], got["linear"]
        same = a == b and all(np.array_equal(x, y) for x, y in
                              ((ca.ids, cb.ids), (ca.trained, cb.trained)))
        for r in rows[-2:]:
            r["same_masks"] = bool(same)
    print(f"{'family':8} {'path':13} {'long conv':>10} {'s':>8} {'conversations':>14} {'s':>8}"
          f" {'trusted':>8} same")
    for r in rows:
        print(f"{r['family']:8} {r['path']:13} {r['messages']:>6} msgs {r['one_long_s']:8.3f} "
              f"{r['conversations']:>14} {r['many_s']:8.2f} {str(r['trusted']):>8} "
              f"{r['same_masks']}")
    result = {"rows": rows, "command": " ".join(["python scripts/bench_chat_data.py",
                                                 *(argv if argv is not None else sys.argv[1:])])}
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
