"""Every `python ...` command that README.md, the docs/*.md pages and the configs' docstrings
print runs as printed (with tiny sizes appended), or is listed in docs/readme_commands.txt as
skipped with a reason. Every relative link in those pages points at a file that exists (and a
heading that exists, for links into a page), and the README stays a front page.

Run as a new user would on a CPU: a subprocess from the repository root, without JAX_PLATFORMS
or a device count (conftest.user_process_env: the commands simulate their own devices),
checking the exit code and the output. The commands of a script that keeps no state between
runs (SHARED: the planner without compiling, the schedule model, the corpus writer, the GPU
compile report, the Hugging Face converter) share one such process, each run as the script's
__main__."""
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from conftest import user_process_env

ROOT = pathlib.Path(__file__).resolve().parent.parent
LIST = ROOT / "docs" / "readme_commands.txt"
KEYS = ("with", "as", "expect", "skip")


def _normal(text: str) -> str:
    return " ".join(text.replace("\\\n", " ").split())


README_MAX_LINES = 200


def pages() -> list[pathlib.Path]:
    """The pages whose commands and links are checked: the README, then every docs/*.md."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def documented_commands() -> dict[str, str]:
    """Printed command -> where (the first page that prints it): code blocks (fenced or indented)
    and inline code of README.md and every docs/*.md page, and the configs' module docstrings."""
    found = {}
    for page in pages():
        where, text = str(page.relative_to(ROOT)), page.read_text()
        blocks = re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S)
        blocks += re.findall(r"(?:^|\n\n)((?: {4}[^\n]*\n?)+)", text)
        for block in blocks:
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split("  #")[0].strip()
                if line.startswith("python "):
                    found.setdefault(_normal(line), where)
        for span in re.findall(r"`(python [^`]+)`", text):
            found.setdefault(_normal(span), where)
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
    assert any(where.startswith("docs/") for where in documented.values())
    for e in entries:
        kinds = [k for k in ("with", "as", "skip") if k in e]
        assert len(kinds) <= 1, f"line {e['line']}: at most one of with/as/skip"
        placeholder = re.search(r"[\[<]|\.\.\.|RUN_DIR|\b[NL]\b", e["command"])
        if placeholder and not kinds:
            pytest.fail(f"line {e['line']}: {e['command']!r} has placeholders: give 'as:' or 'skip:'")
        if "with" in e:
            assert not placeholder, f"line {e['line']}: placeholders: use 'as:', not 'with:'"


def _anchor(heading: str) -> str:
    """GitHub's anchor for a markdown heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: pathlib.Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_anchor(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def test_every_relative_link_points_at_an_existing_file():
    """[text](path) and ![alt](path) links in README.md and docs/*.md, outside code; a link
    with #anchor into a markdown page needs that heading."""
    broken = []
    for page in pages():
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        text = re.sub(r"`[^`]*`", "", text)
        links = re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", text)
        assert page.name != "README.md" or links, "the README links nowhere?"
        for link in links:
            if re.match(r"[a-z][a-z0-9+.-]*:", link):  # http:, https:, mailto:
                continue
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}: ({link})"
            if not target.exists():
                broken.append(f"{where}: no such file")
            elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
                broken.append(f"{where}: no heading #{anchor} in {target.relative_to(ROOT)}")
    assert not broken, "broken links:\n  " + "\n  ".join(broken)


def test_the_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, \
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move detail to docs/"
    for command in ("make demo", "make test"):
        assert any(line.startswith(command) for line in lines), f"README.md lost {command!r}"


RUN = [e for e in listed_commands() if "skip" not in e]
# Scripts whose printed commands share one process: tests/run_commands.py runs them in order,
# each as __main__ with its own sys.argv, as the user's shell would less the interpreter's
# start-up. They keep no state from one run to the next and size no devices (plan.py does when
# it compiles: its compiling commands keep a process of their own). convert_hf.py's export of
# the demo run and the import of that export run in this order, in one process (JAX on its
# one CPU device, started once).
SHARED = ("scripts/plan.py", "scripts/schedule.py", "scripts/make_passkey_corpus.py",
          "scripts/gpu_compile.py", "scripts/convert_hf.py")


def argv_of(entry, tmp) -> list[str]:
    text = entry.get("as") or f"{entry['command']} {entry.get('with', '')}"
    argv = shlex.split(text.replace("{tmp}", str(tmp)))
    assert argv[0] == "python", text
    return argv[1:]


def shared_script(argv) -> str | None:
    script = argv[0]
    if script in SHARED and (script != "scripts/plan.py" or "--no-compile" in argv):
        return script
    return None


@pytest.fixture(scope="module")
def shared_tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("readme")


_SHARED_RESULTS: dict[int, tuple[int, str]] = {}


def run_shared(script, tmp) -> None:
    """Every command of ``script`` in one process, once, at its first command's turn."""
    import json
    entries = [e for e in RUN if shared_script(argv_of(e, tmp)) == script]
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "run_commands.py"),
                           json.dumps([argv_of(e, tmp) for e in entries])], cwd=ROOT,
                          env=user_process_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for e, r in zip(entries, json.loads(proc.stdout.splitlines()[-1])):
        _SHARED_RESULTS[e["line"]] = r["returncode"], r["output"]


@pytest.mark.parametrize("entry", RUN, ids=[f"line{e['line']}" for e in RUN])
def test_printed_command_runs(entry, shared_tmp):
    argv = argv_of(entry, shared_tmp)
    text = " ".join(["python", *argv])
    script = shared_script(argv)
    if script:
        if entry["line"] not in _SHARED_RESULTS:
            run_shared(script, shared_tmp)
        code, out = _SHARED_RESULTS[entry["line"]]
    else:
        proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=user_process_env(),
                              capture_output=True, text=True, timeout=600)
        code, out = proc.returncode, proc.stdout + proc.stderr
    assert code == 0, f"{text}\nexit {code}\n{out[-3000:]}"
    for want in entry["expect"]:
        assert want.replace("{tmp}", str(shared_tmp)) in out, f"{text}\nno {want!r} in:\n{out[-3000:]}"
