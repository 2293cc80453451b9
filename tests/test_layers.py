"""The package's imports only go down, none closes a cycle, and no module is over 480 lines.

From the bottom: utils < workdir < text < models < retrieval < gnn < spalm < lit < datamodules <
pipeline < inference < cli. A module may import its own package and the packages below it,
never one above.
Every import counts: those inside functions (a lazy import is a dependency all the same) and
those under ``if TYPE_CHECKING:`` (an annotation that names a type from above, or from a module
that imports this one, ties the two modules as much as a run-time import does).
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYERS = ("gnnlm.utils", "gnnlm.workdir", "gnnlm.text", "gnnlm.models", "gnnlm.retrieval",
          "gnnlm.gnn", "gnnlm.spalm", "gnnlm.lit", "datamodules", "gnnlm.pipeline",
          "gnnlm.inference", "gnnlm")
MAX_LINES = 480  # past this a module holds more than one job: cut it by job


def modules() -> dict[str, Path]:
    """Every module of the package and the data modules, by dotted name."""
    found = {}
    for root in ("gnnlm", "datamodules"):
        for path in sorted((REPO / root).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def layer(module: str) -> int:
    """The index in ``LAYERS`` of the package a module belongs to (``gnnlm.cli``: the top)."""
    return next(i for i, prefix in enumerate(LAYERS)
                if module == prefix or module.startswith(prefix + "."))


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that ``path`` imports (a name imported from a package resolves to
    its submodule when there is one)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in known else node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return {name for name in found if name in known}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, known) - {name} for name, path in known.items()}


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    return sorted(f"{module} imports {other} (a package above it)"
                  for module, targets in edges.items() for other in targets
                  if layer(other) > layer(module))


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return found


def test_the_checker_sees_upward_imports_and_cycles():
    edges = {"gnnlm.utils.a": {"gnnlm.pipeline.b"}, "gnnlm.pipeline.b": {"gnnlm.utils.a"}}
    assert upward_imports(edges) == ["gnnlm.utils.a imports gnnlm.pipeline.b (a package above "
                                     "it)"]
    assert cycles(edges) == [["gnnlm.pipeline.b", "gnnlm.utils.a"]]


def test_imports_only_go_down():
    assert upward_imports(graph()) == []


def test_no_import_cycle():
    assert cycles(graph()) == []


def test_no_module_is_over_480_lines():
    lengths = {name: len(path.read_text(encoding="utf-8").splitlines())
               for name, path in modules().items()}
    assert {name: n for name, n in lengths.items() if n > MAX_LINES} == {}
    assert max(lengths.values()) > MAX_LINES // 2   # it read the modules
