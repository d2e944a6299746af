"""Every `python ...` command that README.md and the configs' docstrings print runs as printed
(with tiny sizes appended), or is listed in docs/readme_commands.txt as skipped with a reason.

Run as a new user would on a CPU: a subprocess from the repository root, without XLA_FLAGS or
JAX_PLATFORMS, checking the exit code and the output."""
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LIST = ROOT / "docs" / "readme_commands.txt"
KEYS = ("with", "as", "expect", "skip")


def _normal(text: str) -> str:
    return " ".join(text.replace("\\\n", " ").split())


def documented_commands() -> dict[str, str]:
    """Printed command -> where: README code blocks (fenced or indented) and inline code,
    and the configs' module docstrings."""
    found = {}
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```[^\n]*\n(.*?)```", readme, flags=re.S)
    blocks += re.findall(r"(?:^|\n\n)((?: {4}[^\n]*\n?)+)", readme)
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if line.startswith("python "):
                found.setdefault(_normal(line), "README.md")
    for span in re.findall(r"`(python [^`]+)`", readme):
        found.setdefault(_normal(span), "README.md")
    for path in sorted((ROOT / "configs").glob("*.py")):
        doc = re.match(r'\s*"""(.*?)"""', path.read_text(), flags=re.S)
        for line in (doc.group(1) if doc else "").replace("\\\n", " ").splitlines():
            if "python " in line:
                found.setdefault(_normal(line[line.index("python "):]), f"configs/{path.name}")
    return found


def listed_commands() -> list[dict]:
    """The entries of docs/readme_commands.txt, in order."""
    entries = []
    for n, line in enumerate(LIST.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        if not line[0].isspace():
            entries.append({"command": _normal(line), "expect": [], "line": n})
            continue
        key, _, value = line.strip().partition(": ")
        assert entries and key in KEYS and value, f"{LIST.name}:{n}: expected 'KEY: value', {KEYS}"
        if key == "expect":
            entries[-1]["expect"].append(value)
        else:
            assert key not in entries[-1], f"{LIST.name}:{n}: a second {key!r}"
            entries[-1][key] = value
    return entries


def test_every_printed_command_is_listed_and_every_listed_one_is_printed():
    documented, entries = documented_commands(), listed_commands()
    listed = [e["command"] for e in entries]
    assert len(listed) == len(set(listed)), "an entry is listed twice"
    missing = sorted(set(documented) - set(listed))
    stale = sorted(set(listed) - set(documented))
    assert not missing, "printed but not in docs/readme_commands.txt (run it or skip it):\n" + \
        "\n".join(f"  {documented[c]}: {c}" for c in missing)
    assert not stale, "in docs/readme_commands.txt but printed nowhere:\n  " + "\n  ".join(stale)
    assert any("README.md" == where for where in documented.values())
    for e in entries:
        kinds = [k for k in ("with", "as", "skip") if k in e]
        assert len(kinds) <= 1, f"line {e['line']}: at most one of with/as/skip"
        placeholder = re.search(r"[\[<]|\.\.\.|RUN_DIR|\b[NL]\b", e["command"])
        if placeholder and not kinds:
            pytest.fail(f"line {e['line']}: {e['command']!r} has placeholders: give 'as:' or 'skip:'")
        if "with" in e:
            assert not placeholder, f"line {e['line']}: placeholders: use 'as:', not 'with:'"


RUN = [e for e in listed_commands() if "skip" not in e]


@pytest.fixture(scope="module")
def shared_tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("readme")


@pytest.mark.parametrize("entry", RUN, ids=[f"line{e['line']}" for e in RUN])
def test_printed_command_runs(entry, shared_tmp):
    text = entry.get("as") or f"{entry['command']} {entry.get('with', '')}"
    argv = shlex.split(text.replace("{tmp}", str(shared_tmp)))
    assert argv[0] == "python"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    proc = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{text}\nexit {proc.returncode}\n{out[-3000:]}"
    for want in entry["expect"]:
        assert want.replace("{tmp}", str(shared_tmp)) in out, f"{text}\nno {want!r} in:\n{out[-3000:]}"
