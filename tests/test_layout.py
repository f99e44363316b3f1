"""The layout's rules: each folder one concern, imports in one direction, no circles.

The import graph counts every import in a module, at any depth (an import inside a function is
still a dependency), between the project's own modules.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("shared", "extract", "train")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    """Project module -> the project modules it imports (a `from pkg import name` of a
    submodule counts as that submodule)."""
    modules = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module not in modules:
                    continue
                subs = {f"{node.module}.{a.name}" for a in node.names}
                deps.update(subs & modules.keys() or {node.module})
        graph[name] = deps - {name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    assert _cycles(_graph()) == []


def _importers(prefix: str) -> dict[str, set[str]]:
    return {
        m: {d for d in deps if d == prefix or d.startswith(prefix + ".")}
        for m, deps in _graph().items()
    }


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_training_path_never_imports_the_proof_tools():
    """train/proof/ checks a trained drafter; the loop, data path and drafters run without it.
    train/sweep/ runs training as a command and reports with train.proof.compare: above both."""
    bad = {
        m: deps
        for m, deps in _importers("train.proof").items()
        if deps and not _inside(m, "train.proof") and not _inside(m, "train.sweep")
    }
    assert bad == {}


def test_nothing_imports_the_sweep():
    bad = {
        m: deps
        for m, deps in _importers("train.sweep").items()
        if deps and not _inside(m, "train.sweep")
    }
    assert bad == {}


def test_drafters_import_only_drafters():
    """train/drafters/ is model code over its own shared pieces: no loop, data or config."""
    bad = {
        m: {d for d in deps if _inside(d, "train") and not _inside(d, "train.drafters")}
        for m, deps in _graph().items()
        if _inside(m, "train.drafters")
    }
    assert {m: d for m, d in bad.items() if d} == {}


def test_the_data_path_does_not_import_the_step_or_the_drafters():
    bad = {
        m: {d for d in deps if _inside(d, "train") and not _inside(d, "train.data")}
        for m, deps in _graph().items()
        if _inside(m, "train.data")
    }
    assert {m: d for m, d in bad.items() if d} == {}


def test_extraction_never_imports_regeneration():
    bad = {
        m: deps
        for m, deps in _importers("extract.regen").items()
        if deps and not _inside(m, "extract.regen")
    }
    assert bad == {}


def test_no_module_over_the_size_budget():
    """STYLE.md: files under ~400 lines (a little slack for formatting)."""
    sizes = {
        str(p.relative_to(ROOT)): len(p.read_text().splitlines())
        for pkg in PACKAGES
        for p in (ROOT / pkg).rglob("*.py")
    }
    assert {f: n for f, n in sizes.items() if n > 420} == {}
