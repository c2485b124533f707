"""No import cycle between the modules of ``s2attn``.

Every import statement of a module counts, those inside functions too: a function-level import
does not fail at load time, but it is how a cycle between two modules hides (each needs the other,
and one of them defers its half to the call). Imports under ``if TYPE_CHECKING:`` never run and do
not count. Importing ``a.b.c`` also loads the packages ``a`` and ``a.b``, but those edges do not
count: a package's ``__init__`` that imports its own modules is loading already when they import
from it, which is how packages are built, not a cycle between two modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import s2attn

PACKAGE = Path(s2attn.__file__).parent


def _modules() -> dict[str, tuple[Path, bool]]:
    """Every module of the package: dotted name -> (file, whether it is a package's __init__)."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ["s2attn", *path.relative_to(PACKAGE).with_suffix("").parts]
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(body: list[ast.stmt]):
    """The import statements that can run, at any depth (functions and classes included)."""
    for node in body:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _import_nodes(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt):
                yield from _import_nodes([child])
            elif isinstance(child, ast.excepthandler):
                yield from _import_nodes(child.body)


def _imported(name: str, path: Path, is_package: bool, modules) -> set[str]:
    """The package's modules that ``name`` imports."""
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path)).body):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module
            # `from package import module` imports the module; `from module import name` not.
            targets = [source, *(f"{source}.{alias.name}" for alias in node.names)]
        # A module's own packages are loading already when it runs (see the module docstring).
        found.update(
            t for t in targets if t in modules and not name.startswith(f"{t}.") and t != name
        )
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imported(name, *where, modules) for name, where in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle_in_the_package():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle in s2attn: " + " -> ".join(cycle)


def test_the_cycle_check_finds_a_cycle():
    # The check itself, on a graph with a cycle two edges away from its start.
    graph = {"a": {"b"}, "b": {"c"}, "c": {"d"}, "d": {"b"}, "e": set()}
    assert find_cycle(graph) == ["b", "c", "d", "b"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_graph_reads_relative_and_function_level_imports():
    graph = import_graph()
    # from .page_pool import PagePool, at module level
    assert "s2attn.inference.page_pool" in graph["s2attn.inference.cache"]
    # from .transformers import layer_pattern inside a function (vLLM's plugin)
    assert "s2attn.integrations.transformers" in graph["s2attn.integrations.vllm"]
    # from . import step_graph: the module, not its own package
    assert "s2attn.inference.step_graph" in graph["s2attn.inference.attention"]
    assert "s2attn.inference" not in graph["s2attn.inference.attention"]
