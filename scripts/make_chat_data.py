"""Conversations made from the Python standard library, offline: SFT data that is real text.

    python scripts/make_chat_data.py qa --out data/examples/stdlib_qa.jsonl [--count 400]
    python scripts/make_chat_data.py long --out runs/chat_long.jsonl --tokenizer RUN/tokenizer.json
        [--tokens 3800] [--count 200]
    python scripts/make_chat_data.py pairs --from data/examples/stdlib_qa.jsonl --out PAIRS.jsonl

``qa``: questions about the library's public functions and classes, answered from their own
docstrings (the first paragraph, after the signature), some with a system prompt, some with a
second turn (which module, and how to import it). The committed ``data/examples/stdlib_qa.jsonl``
is this command's output under Python 3.11 (``--count 400``).

``long``: a long-context task: several modules' source joined (about ``--tokens`` tokens of the
given tokenizer, so a conversation fills a row of that length), then a question whose answer is
in one of them: what does the function NAME of FILE do, by its docstring? The answer is the
docstring's first line. Every name asked about appears once in its conversation. A ``--tokens``
that no file fits (a file's tokens + 200) stops with one line naming the smallest that can.

``pairs``: preference pairs from a ``qa`` or ``long`` file (the DPO format: ``prompt``,
``chosen``, ``rejected``): the real answer against another function's answer (a file needs two
different answers).

Records are the ``messages`` format (role/content); the same seed gives the same file.
"""
from __future__ import annotations

import argparse
import ast
import bisect
import json
import os
import pathlib
import random
import sys
import sysconfig

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "ensurepip", "site-packages",
             "__pycache__", "pydoc_data", "encodings", "tkinter"}
SYSTEM = "You are a concise assistant who knows Python's standard library."


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("kind", choices=("qa", "long", "pairs"))
    p.add_argument("--out", required=True)
    p.add_argument("--count", type=int, default=400, help="conversations (or pairs) to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default="", help="long: the tokenizer.json that sizes a conversation")
    p.add_argument("--tokens", type=int, default=3800, help="long: tokens per conversation, about")
    p.add_argument("--from", dest="source", default="", help="pairs: a qa or long file")
    return p.parse_args(argv)


def modules() -> list[tuple[str, str]]:
    """(dotted name, path) of the library's pure-Python modules, sorted."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if set(rel.parts[:-1]) & SKIP_DIRS or rel.name.startswith("_") and rel.name != "__init__.py":
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if not parts or any(p.startswith("_") for p in parts):
            continue
        out.append((".".join(parts), str(path)))
    return out


def first_paragraph(doc: str) -> str:
    para = doc.strip().split("\n\n")[0]
    return " ".join(line.strip() for line in para.splitlines())


def documented(path: str) -> list[tuple[str, str, str]]:
    """(name, signature, docstring) of a module's public top-level functions and classes."""
    try:
        tree = ast.parse(pathlib.Path(path).read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    out = []
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        if not doc or len(first_paragraph(doc)) < 40:
            continue
        if isinstance(node, ast.FunctionDef):
            sig = f"({ast.unparse(node.args)})"
        else:
            init = next((b for b in node.body if isinstance(b, ast.FunctionDef)
                         and b.name == "__init__"), None)
            sig = f"({ast.unparse(init.args).removeprefix('self, ').removeprefix('self')})" if init else "()"
        out.append((node.name, sig, doc))
    return out


def qa(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    items = [(mod, *d) for mod, path in modules() for d in documented(path)]
    rng.shuffle(items)
    out = []
    for mod, name, sig, doc in items[:count]:
        ask = rng.choice([f"What does `{mod}.{name}` do?",
                          f"In Python's standard library, what is `{mod}.{name}` for?",
                          f"Explain `{name}` from the `{mod}` module."])
        messages = [{"role": "user", "content": ask},
                    {"role": "assistant", "content": f"`{mod}.{name}{sig}`: {first_paragraph(doc)}"}]
        if rng.random() < 0.3:
            messages.insert(0, {"role": "system", "content": SYSTEM})
        if rng.random() < 0.3:
            messages += [{"role": "user", "content": "How do I import it?"},
                         {"role": "assistant", "content": f"`from {mod} import {name}`"}]
        out.append({"messages": messages})
    return out


class Unfillable(ValueError):
    """A request this script cannot fill: main prints it as one line and exits 2."""


def defined(text: str) -> dict[str, int]:
    """How many ``def NAME``/``class NAME`` lines a source has for each name."""
    names: dict[str, int] = {}
    for line in text.splitlines():
        s = line.strip()
        for kw in ("def ", "class "):
            if s.startswith(kw):
                name = s[len(kw):].split("(")[0].split(":")[0]
                names[name] = names.get(name, 0) + 1
    return names


def askable(found, names: dict[str, int]) -> bool:
    """Whether one of a file's documented names is defined only once in it."""
    return any(names.get(name) == 1 for name, _, _ in found)


def long_task(count: int, seed: int, tokenizer_path: str, tokens: int) -> list[dict]:
    """Conversations of about ``tokens`` tokens: sources joined, one question about them.

    Raises ``Unfillable`` when no file fits ``tokens`` (naming the smallest ``tokens`` with one
    that does), or when 1,000 draws in a row find nothing to ask."""
    from tokenizers import Tokenizer
    if tokenizer_path and not os.path.isfile(tokenizer_path):
        raise Unfillable(f"long: --tokenizer {tokenizer_path}: no such file")
    rng = random.Random(seed)
    tok = Tokenizer.from_file(tokenizer_path) if tokenizer_path else None
    count_tokens = (lambda s: len(tok.encode(s, add_special_tokens=False).ids)) if tok else (
        lambda s: len(s) // 3)
    sizes: dict[str, int] = {}  # by path: each file is sized once, not once a conversation

    def size(path: str, text: str) -> int:
        if path not in sizes:
            sizes[path] = count_tokens(text)
        return sizes[path]

    sources = [(mod, path, pathlib.Path(path).read_text(encoding="utf-8", errors="replace"))
               for mod, path in modules()]
    files = []
    for mod, path, text in sources:
        if 400 < len(text) < 12 * tokens:
            found = documented(path)
            if found:
                files.append((mod, path, text, found))
    budget = tokens - 200  # the question, the answer and the template's own tokens
    names_of = {path: defined(text) for _, path, text, _ in files}
    # Without a file that fits and has a name to ask about on its own, no draw ends.
    if not any(askable(found, names_of[path]) and size(path, text) <= budget
               for _, path, text, found in sorted(files, key=lambda f: len(f[2]))):
        least = smallest_tokens(sources, size)
        raise Unfillable(f"long: --tokens {tokens} fits no standard-library file with a question"
                         f" (a file's tokens + 200 for the question and the template): " + (
                             f"--tokens {least} is the smallest that can" if least else
                             "this Python's library has no such file at any --tokens"))
    out = []
    misses = 0
    while len(out) < count:
        if misses == 1000:
            raise Unfillable(f"long: made {len(out)} of {count} conversations: 1,000 draws in a"
                             f" row found no name to ask about within --tokens {tokens}: give a"
                             f" larger --tokens")
        misses += 1
        picked, used = [], 0
        for mod, path, text, found in rng.sample(files, len(files)):
            n = size(path, text)
            if used + n > budget:
                continue
            picked.append((mod, path, text, found))
            used += n
            if used > 0.8 * budget:
                break
        if not picked:
            continue
        names = {}
        for _, path, _, _ in picked:
            for name, k in names_of[path].items():
                names[name] = names.get(name, 0) + k
        candidates = [(mod, name, sig, doc) for mod, _, _, found in picked
                      for name, sig, doc in found if names.get(name) == 1]
        if not candidates:
            continue
        misses = 0
        mod, name, sig, doc = rng.choice(candidates)
        body = "\n\n".join(f"# ---- file: {m.replace('.', '/')}.py ----\n{t}" for m, _, t, _ in picked)
        ask = (f"{body}\n\nIn the code above, what does `{name}` in the file "
               f"`{mod.replace('.', '/')}.py` do, according to its docstring?")
        out.append({"messages": [{"role": "user", "content": ask},
                                 {"role": "assistant", "content": doc.strip().splitlines()[0]}]})
    return out


def smallest_tokens(sources, size) -> int | None:
    """The smallest ``--tokens`` with a file that ``long`` can ask about alone: over 400
    characters, under 12 characters a token, and its tokens + 200 within it. Files are read
    shortest first, until no longer one can do better."""
    best = None
    for _, path, text in sorted(sources, key=lambda f: len(f[2])):
        least = len(text) // 12 + 1
        if best is not None and least >= best:
            break
        if len(text) <= 400:
            continue
        found = documented(path)
        if found and askable(found, defined(text)):
            need = max(size(path, text) + 200, least)
            best = need if best is None else min(best, need)
    return best


def pairs(source: str, count: int, seed: int) -> list[dict]:
    """The real answer (chosen) against another conversation's answer (rejected), drawn evenly
    from those whose answer differs. Raises ``Unfillable`` for a file without two answers."""
    rng = random.Random(seed)
    try:
        lines = pathlib.Path(source).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise Unfillable(f"pairs: --from {source}: {e.strerror or e}") from None
    convs, answers = [], []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            messages = json.loads(line)["messages"]
            answers.append(next(m["content"] for m in messages if m["role"] == "assistant"))
        except (ValueError, KeyError, TypeError, StopIteration):
            raise Unfillable(f"pairs: --from {source} line {n} is not a conversation with an "
                             f"assistant's answer (a qa or long file: messages of role/content)"
                             ) from None
        convs.append(messages)
    # Each answer's conversations, ascending. The r-th conversation whose answer differs from
    # answer a is r + (how many of a's come before it): a bisection in a's list shifted by its
    # own positions: O(n + count log n) in all, where a list of the others for each
    # conversation was O(n * count). The draw is choice's own (randrange(m)): the same file.
    where: dict[str, list[int]] = {}
    for k, a in enumerate(answers):
        where.setdefault(a, []).append(k)
    if len(where) < 2:
        raise Unfillable(f"pairs: --from {source} has {len(convs)} conversation(s) and "
                         f"{len(where)} distinct answer(s): a pair rejects another answer, so it "
                         f"needs at least 2 different answers")
    shifted = {a: [k - t for t, k in enumerate(ks)] for a, ks in where.items()}
    out = []
    for i, c in enumerate(convs[:count]):
        first = next(k for k, m in enumerate(c) if m["role"] == "assistant")
        same = shifted[answers[i]]
        r = rng.randrange(len(answers) - len(same))
        j = r + bisect.bisect_right(same, r)
        out.append({"prompt": c[:first],
                    "chosen": [{"role": "assistant", "content": answers[i]}],
                    "rejected": [{"role": "assistant", "content": answers[j]}]})
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.kind == "qa":
            records = qa(args.count, args.seed)
        elif args.kind == "long":
            records = long_task(args.count, args.seed, args.tokenizer, args.tokens)
        else:
            if not args.source:
                print("error: pairs needs --from FILE (a qa or long file)", file=sys.stderr)
                return 2
            records = pairs(args.source, args.count, args.seed)
    except Unfillable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"wrote {len(records)} {args.kind} records to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
