"""The import layering the design promises, read from the source (nothing is imported): what
reads a trained run (evaluation/) never imports training/, whose model on a mesh sits below
both (model/sharded.py), and no project module reaches itself through its imports, those
inside functions included (a loop that only works because an import is deferred is still a
loop). A package's ``__init__`` reaching into its own submodules (a registry of them) is the
package itself, not a loop."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("checkpoints", "configs", "data", "evaluation", "hf", "model", "parallel",
            "planning", "training")


def modules() -> dict[str, pathlib.Path]:
    found = {p.stem: ROOT / p for p in map(pathlib.Path, ("errors.py", "accelerators.py"))}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imports() -> dict[str, set[str]]:
    """Each module's project imports, at any depth of its code."""
    mods = modules()
    edges = {name: set() for name in mods}
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    target = full if full in mods else node.module
                    if target in mods and target != name and not target.startswith(name + "."):
                        edges[name].add(target)
            elif isinstance(node, ast.Import):
                edges[name].update(a.name for a in node.names if a.name in mods and a.name != name)
    return edges


def test_evaluation_imports_nothing_from_training():
    edges = imports()
    assert "evaluation.harness" in edges and "model.sharded" in edges["evaluation.harness"]
    bad = sorted((m, t) for m, ts in edges.items() if m.startswith("evaluation")
                 for t in ts if t.startswith("training"))
    assert bad == []


def test_no_module_imports_itself_through_others():
    edges = imports()
    cycles = []
    for start in edges:  # a path back to start, by depth-first search
        stack, seen = [(start, (start,))], set()
        while stack:
            node, path = stack.pop()
            for nxt in edges[node]:
                if nxt == start:
                    cycles.append(" -> ".join(path + (start,)))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + (nxt,)))
    assert cycles == []
