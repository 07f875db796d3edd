"""The package structure holds: no import cycle inside twinkle_fn, one door into each backend.

Imports are read with `ast` (every import statement, those under ``if TYPE_CHECKING:`` and inside
functions included), so a cycle that only a lazy import hides still counts.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _modules(package: str) -> dict[str, Path]:
    """Dotted name -> file of every non-test module of `package`."""
    out = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        if path.name.endswith("_test.py") or path.name.startswith("test_"):
            continue
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The modules of `known` that the module `name` at `path` imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            # `from pkg import sub` depends on the submodule, not on the package's own code
            out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names}
    return {m for m in out if m in known and m != name}


def import_graph(package: str) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (the root package, which only re-exports,
    left out)."""
    mods = _modules(package)
    known = set(mods) - {package}
    return {m: _imports(p, m, known) for m, p in mods.items() if m != package}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted([v, *component]))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_inside_twinkle_fn():
    graph = import_graph("twinkle_fn")
    assert "twinkle_fn.backends.megatron.backend" in graph  # the walk reaches the backends
    assert cycles(graph) == []


def test_the_core_reaches_backends_only_through_the_registry():
    """Outside `twinkle_fn/backends/`, no core module imports a backend's modules."""
    graph = import_graph("twinkle_fn")
    inside = re.compile(r"twinkle_fn\.backends\.(transformers|megatron|base|compile_layers)")
    leaks = {
        m: sorted(i for i in imported if inside.match(i))
        for m, imported in graph.items()
        if not m.startswith("twinkle_fn.backends") and m != "twinkle_fn.testing"
    }
    assert {m: i for m, i in leaks.items() if i} == {}


def test_the_facade_imports_no_backend_module():
    facade = import_graph_of_files(ROOT / "twinkle")
    assert {f: i for f, i in facade.items() if i} == {}


def import_graph_of_files(directory: Path) -> dict[str, list[str]]:
    """File -> the ``twinkle_fn.backends.*`` modules it imports (the registry itself allowed)."""
    out = {}
    for path in sorted(directory.rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
        out[str(path.relative_to(ROOT))] = sorted(
            n for n in names if n.startswith("twinkle_fn.backends.")
        )
    return out


def test_api_and_checkpoint_branch_on_no_backend_name():
    for module in ("api.py", "checkpoint.py", "lora.py", "offload.py"):
        text = (ROOT / "twinkle_fn" / module).read_text()
        assert not re.search(r"backend\s*==|==\s*\"(megatron|transformers|fsdp)\"", text), module
