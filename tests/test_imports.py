"""The package's import graph: no circle between two files (module level or inside a
function), and every import points down the layers of docs/architecture.md. Read from the source (AST),
nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

import exactspec

ROOT = Path(exactspec.__file__).parent

# docs/architecture.md's layers, lowest first; a folder may import its own rank or lower ones
RANK = {"errors": 0, "lazy": 0, "_collector": 0, "sampling": 1, "kernels": 2, "models": 3,
        "invariant": 4, "drafters": 4, "engine": 5, "audit": 6, "training": 6, "integrations": 6,
        "bench": 7, "serve": 8, "batch": 8, "cli": 9}


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(path: Path) -> set[str]:
    """Every exactspec name an import statement in `path` names (the module, and module.name
    for `from module import name`, which may be a submodule)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return {n for n in out if n.startswith("exactspec.")}


def _graph() -> dict[str, set[str]]:
    """module -> the modules it imports. An edge into a package's __init__ from inside that
    package (or from the __init__ to its own submodules) is the package re-exporting, not a
    dependency, and is left out."""
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    def inside(a: str, pkg: str) -> bool:
        return a.startswith(pkg + ".") and mods[pkg].name == "__init__.py"

    graph: dict[str, set[str]] = {}
    for m, path in mods.items():
        deps = {resolve(n) for n in _imports(path)} - {None, m}
        graph[m] = {d for d in deps if not inside(m, d) and not inside(d, m)}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_circles():
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_planted_circle():
    graph = _graph()
    graph["exactspec.sampling.chain"].add("exactspec.sampling.verify")  # verify -> ... -> chain
    (cycle,) = _cycles(graph)
    assert {"exactspec.sampling.chain", "exactspec.sampling.methods",
            "exactspec.sampling.verify"} <= set(cycle)


def test_a_hidden_import_counts(tmp_path):
    """An import inside a function is an edge like a module-level one."""
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from exactspec.bench.report import format_report\n")
    assert _imports(path) == {"exactspec.bench.report", "exactspec.bench.report.format_report"}


def _layer(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def test_imports_point_down_the_layers():
    graph = _graph()
    assert {_layer(m) for m in graph if m.count(".") >= 1} - {"__main__", "api"} <= set(RANK)
    wrong = sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps
                   if _layer(m) in RANK and _layer(d) in RANK
                   and RANK[_layer(d)] > RANK[_layer(m)])
    assert wrong == []
