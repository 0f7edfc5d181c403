"""Fails when a package's modules import each other in a cycle (docs/architecture.md, "Packages").

Every import inside a package counts, at module level or inside a function (a function-level import that dodges a
cycle is still one), except those under `if TYPE_CHECKING:` (annotations only, never executed). An import of
`pkg.a.b` is an edge to module `pkg.a.b`; `from pkg.a import b` to `pkg.a.b` when that is a module, else to `pkg.a`.
Strongly connected components of that graph with more than one module are the cycles.

    uv run python tests/check_cycles.py            # every package under packages/
    uv run python tests/check_cycles.py miles-orchestrator
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "packages"


def modules(src: Path) -> dict[str, Path]:
    """Dotted module name → file, for every .py under a package's src/."""
    out = {}
    for path in sorted(src.rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    stack = [tree]
    while stack:
        node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                stack.extend(child.orelse)
                continue
            if isinstance(child, ast.Import | ast.ImportFrom):
                yield child
            stack.append(child)


def edges(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that module `name` imports."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:  # relative: from the module's package, up level - 1
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join([*package, *([base] if base else [])])
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        out |= {t for t in targets if t in known and t != name}
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def main() -> int:
    names = sys.argv[1:] or sorted(p.name for p in ROOT.iterdir() if (p / "src").is_dir())
    failed = False
    for package in names:
        known = modules(ROOT / package / "src")
        graph = {name: edges(name, path, known) for name, path in known.items()}
        for component in cycles(graph):
            failed = True
            print(f"{package}: import cycle among {', '.join(component)}")
            for module in component:
                print(f"  {module} imports {', '.join(sorted(graph[module] & set(component)))}")
    if not failed:
        print(f"no import cycle in {', '.join(names)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
