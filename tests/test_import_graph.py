"""The import structure: no cycles, no import "back up" into a parent package's command line,
and none from the value layer (the schema layer, the spec) up into what builds on it.

The graph is built from the source (every ``import`` and ``from ... import``, at module level
or inside a function, relative ones resolved, and ``importlib.import_module("literal")``) over
``src/grammask`` and ``bench``. An edge is *import-time* when the import runs as the module
loads (module or class body), *deferred* when it sits in a function.

    python tests/test_import_graph.py      # prints the cycles and upward imports, if any
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: (directory that holds the top-level package, package name)
PACKAGES = ((ROOT / "src", "grammask"), (ROOT, "bench"))

#: cycles through deferred imports allowed to remain (none: a deferred import is still a
#: dependency, and a cycle through one is still a cycle)
KNOWN_DEFERRED_CYCLES: set[tuple[str, ...]] = set()

#: The value layer: what a constraint is (the spec, its input limits, the schema layer and
#: the backend-name index it resolves names through). Everything else builds on it...
VALUE_LAYER = ("grammask.schema", "grammask.specs.grammar_spec", "grammask.specs.limits",
               "grammask.specs.structural_tag", "grammask.specs.backend_names",
               "grammask.specs.library", "grammask.errors")
#: ... and it imports none of these, not even in a function (``grammask.specs.grammar_spec`` once
#: imported the backends' registry, whose package imports the spec)
ABOVE_THE_VALUE_LAYER = ("grammask.backends", "grammask.compile", "grammask.kernels",
                         "grammask.decode", "grammask.integrations", "grammask.harness",
                         "grammask.cli", "grammask.specs.frontends", "grammask.specs.request")

#: The backend adapters sit below what drives them: they import none of these, not even in a
#: function (the decode core places batch fills on threads; a backend only says which lock a
#: row fills under: ``capabilities.FillLanes``)
BACKENDS = "grammask.backends"
ABOVE_THE_BACKENDS = ("grammask.decode", "grammask.compile", "grammask.integrations",
                      "grammask.harness", "grammask.cli")


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    deferred: bool  # inside a function: runs when called, not when the module loads
    line: int


def modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for base, package in PACKAGES:
        for path in sorted((base / package).rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


class _Imports(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool) -> None:
        self.package = module if is_package else module.rpartition(".")[0]
        self.depth = 0  # functions entered
        self.found: list[tuple[str, bool, int]] = []

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def _add(self, name: str, node: ast.AST) -> None:
        self.found.append((name, self.depth > 0, getattr(node, "lineno", 0)))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            anchor = self.package.split(".")
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join([*anchor, base] if base else anchor)
        for alias in node.names:
            # ``from pkg import sub`` imports pkg.sub when that is a module, else names of pkg
            self._add(f"{base}.{alias.name}", node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if (isinstance(func, ast.Attribute) and func.attr == "import_module" and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)):
            self._add(node.args[0].value, node)
        self.generic_visit(node)


def edges() -> list[Edge]:
    known = modules()
    out: list[Edge] = []
    for module, path in known.items():
        visitor = _Imports(module, path.name == "__init__.py")
        visitor.visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
        for name, deferred, line in visitor.found:
            target = _resolve(name, known)
            # a module's own packages are imported before it anyway: not an edge
            if target and target != module and not module.startswith(target + "."):
                out.append(Edge(module, target, deferred, line))
    return list(dict.fromkeys(out))  # one per (source, target, line)


def cycles(graph_edges: list[Edge]) -> list[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan), sorted."""
    graph: dict[str, set[str]] = {m: set() for m in modules()}
    for e in graph_edges:
        graph[e.source].add(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[tuple[str, ...]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
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
                out.append(tuple(sorted(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def _within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def upward(graph_edges: list[Edge]) -> list[Edge]:
    """Imports of an ancestor package's command line (``grammask.harness.x -> grammask.cli``):
    a subpackage must not depend on the program that drives it; and imports from the value
    layer into what builds on it (``VALUE_LAYER``)."""
    return [e for e in graph_edges if (
        e.target.rpartition(".")[2] == "cli"
        and e.source.startswith(e.target.rpartition(".")[0] + ".")
        and e.source.count(".") > e.target.count(".")) or (
        _within(e.source, VALUE_LAYER) and _within(e.target, ABOVE_THE_VALUE_LAYER))]


def report() -> str:
    graph_edges = edges()
    lines = [f"{len(modules())} modules, {len(graph_edges)} import edges "
             f"({sum(e.deferred for e in graph_edges)} deferred)"]
    at_load = cycles([e for e in graph_edges if not e.deferred])
    for component in cycles(graph_edges):
        kind = "import-time" if component in at_load else "through deferred imports"
        lines.append(f"cycle ({kind}): {' <-> '.join(component)}")
        for e in graph_edges:
            if e.source in component and e.target in component:
                lines.append(f"    {e.source} -> {e.target} (line {e.line}"
                             f"{', deferred' if e.deferred else ''})")
    lines += [f"import back up: {e.source} -> {e.target} (line {e.line})"
              for e in upward(graph_edges)]
    if len(lines) == 1:
        lines.append("no cycles, no upward imports")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- tests
def test_no_import_time_cycle() -> None:
    assert cycles([e for e in edges() if not e.deferred]) == [], report()


def test_no_new_cycle_through_deferred_imports() -> None:
    assert set(cycles(edges())) <= KNOWN_DEFERRED_CYCLES, report()


def test_command_lines_and_harness_are_in_no_cycle() -> None:
    for component in cycles(edges()):
        assert not any(m == "grammask.cli" or m.startswith(("grammask.harness", "bench"))
                       for m in component), report()


def test_no_import_back_up_into_a_parents_cli() -> None:
    assert upward(edges()) == [], report()


def test_the_backends_never_import_the_layers_above_them() -> None:
    """``grammask.backends`` is below the decode core (and the compile layer, the
    integrations, the harness, the command line): backend knowledge stays in the backends,
    the policies that use it (batch-fill placement: ``decode.fill_placement``) above."""
    graph_edges = edges()
    up = [e for e in graph_edges
          if _within(e.source, (BACKENDS,)) and _within(e.target, ABOVE_THE_BACKENDS)]
    assert up == [], up
    # the check sees the edges the other way (the decode core reads the capability)
    assert any(e.source == "grammask.decode.fill" and e.target.startswith(BACKENDS)
               for e in graph_edges)


def test_the_installed_package_never_imports_the_repository() -> None:
    """``bench`` and ``tests`` are a checkout's, not the package's: ``grammask bench`` finds
    ``bench`` at run time (by name), never through an import the package carries."""
    known = modules()
    for e in edges():
        if e.source.startswith("grammask"):
            assert not e.target.startswith("bench"), e
    assert "grammask.cli" in known and "bench.compile" in known  # the graph saw both


def test_the_checker_finds_a_cycle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checker itself: a cycle, an upward import and a deferred edge are seen."""
    pkg = tmp_path / "cyc"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "sub").mkdir()
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "cli.py").write_text("def f() -> None:\n    from ..a import x\n")
    (pkg / "cli.py").write_text("")
    (pkg / "b.py").write_text("import importlib\nimportlib.import_module('cyc.a')\n")
    (pkg / "sub" / "x.py").write_text("from ..cli import main\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGES", ((tmp_path, "cyc"),))
    found = edges()
    assert cycles(found) == [("cyc.a", "cyc.b")]
    assert [(e.source, e.target) for e in upward(found)] == [("cyc.sub.x", "cyc.cli")]
    assert any(e.deferred and e.source == "cyc.sub.cli" and e.target == "cyc.a" for e in found)


def test_only_the_backends_and_their_disk_format_know_the_concrete_adapters() -> None:
    """Batch fill is a capability of the backend protocol: the mask pipeline, the processor
    and the integrations name no concrete adapter (only the disk cache, which stores
    xgrammar's own format, imports ``backends.xgrammar``)."""
    concrete = {"grammask.backends.xgrammar", "grammask.backends.guidance"}
    allowed = {"grammask.backends", "grammask.backends.diskcache"}
    users = sorted({e.source for e in edges() if e.target in concrete
                    and e.source.startswith("grammask.")  # bench compares the raw fills
                    and not any(e.source == a or e.source.startswith(a + ".") for a in allowed)})
    assert users == [], users
    for path in (ROOT / "src" / "grammask").rglob("*.py"):
        if "backends" in path.parts or path.name == "diskcache.py":
            continue
        text = path.read_text(encoding="utf-8")
        assert "XGrammarMatcher" not in text and "GuidanceMatcher" not in text, path


if __name__ == "__main__":
    print(report())
    sys.exit(0)
