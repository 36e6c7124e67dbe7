"""The package's shape: no import cycles between its modules, blutrain.tensor reached through
models._tensor (which checks its API level) and used through its public API only, with no
probes for older builds of our own packages."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import blutrain.models

PKG = Path(blutrain.models.__file__).parent
NAME = "blutrain.models"


def modules() -> dict[str, Path]:
    out = {}
    for f in sorted(PKG.rglob("*.py")):
        rel = f.relative_to(PKG).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        out[".".join([NAME, *parts])] = f
    return out


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Modules of this package that `name` imports, at module level or inside functions (an
    import in a function is still a dependency); `if TYPE_CHECKING:` blocks do not count."""
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                continue
            if isinstance(child, ast.ImportFrom):
                if child.level:
                    root = base[: len(base) - child.level + 1]
                    mod = ".".join(root + ([child.module] if child.module else []))
                else:
                    mod = child.module or ""
                for alias in child.names:
                    sub = f"{mod}.{alias.name}"
                    found.add(sub if sub in known else mod)
            elif isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in found if m in known and m != name}


def test_no_import_cycles():
    mods = modules()
    graph = {m: imports_of(m, p, set(mods)) for m, p in mods.items()}
    # the package's own __init__ re-exports; importing a submodule runs it first, so it is not
    # an edge of the cycles that matter (submodule <-> submodule)
    graph = {m: deps - {NAME} for m, deps in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycle = stack[stack.index(d) :] + [d]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if d not in state:
                dfs(d)
        stack.pop()
        state[m] = 2

    for m in graph:
        if m not in state:
            dfs(m)
    # the loop knows nothing of the CLI; checkpoints know nothing of conversions
    assert f"{NAME}.cli" not in graph[f"{NAME}.trainer"]
    assert f"{NAME}.convert" not in graph[f"{NAME}.checkpoint"]


def test_the_tensor_library_is_reached_through_models_tensor_and_its_public_api():
    banned = [
        (re.compile(r"^\s*import blutrain\.tensor\b|^\s*from blutrain\.tensor\b"), "imports"),
        (re.compile(r"\bbt\._\w"), "private bt API"),
        (re.compile(r"\b(hasattr|getattr)\(bt\b"), "a probe of bt"),
        (re.compile(r"inspect\.signature|__doc__ or|nvidia-smi"), "a probe of a build"),
    ]
    bad = []
    for path in modules().values():
        if path.name == "_tensor.py":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            for pattern, what in banned:
                if pattern.search(line):
                    bad.append(f"{path.relative_to(PKG)}:{i}: {what}: {line.strip()}")
    assert not bad, "\n".join(bad)
