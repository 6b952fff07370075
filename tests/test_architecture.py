"""The layers point one way: no import cycle between parts of the package, and the shared parts stay apart.

A *part* is a subpackage (``core``, ``engines``, ...) or a top-level module (``app``,
``errors``, ``records``, ...). Every import counts: module-level, function-level,
``from x import y`` (``y`` may be a module) and relative ones.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "rollout_proxy"


@dataclass(frozen=True)
class Edge:
    source: str  # importing module
    target: str  # imported module (a module of the package, or a third-party name)
    where: str  # file:line

    def __str__(self) -> str:
        return f"{self.where}: {self.source} imports {self.target}"


@dataclass
class ImportGraph:
    package: str
    modules: set[str]
    edges: list[Edge]

    def part(self, module: str) -> str:
        """The subpackage or top-level module that ``module`` belongs to."""
        parts = module.split(".")
        return parts[1] if len(parts) > 1 else parts[0]

    def internal(self) -> list[Edge]:
        return [edge for edge in self.edges if edge.target in self.modules]

    def external(self) -> list[Edge]:
        return [edge for edge in self.edges if edge.target not in self.modules]

    def part_edges(self) -> dict[tuple[str, str], list[Edge]]:
        """Imports between two different parts, with the imports that make each edge."""
        found: dict[tuple[str, str], list[Edge]] = defaultdict(list)
        for edge in self.internal():
            source, target = self.part(edge.source), self.part(edge.target)
            if source != target:
                found[(source, target)].append(edge)
        return dict(found)


def module_name(root: Path, file: Path) -> str:
    relative = file.relative_to(root.parent).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def walk(root: Path) -> ImportGraph:
    """Every import of every module under the package directory ``root``."""
    files = sorted(root.rglob("*.py"))
    modules = {module_name(root, file) for file in files}
    edges = []
    for file in files:
        module = module_name(root, file)
        package = module if file.name == "__init__.py" else module.rpartition(".")[0]
        tree = ast.parse(file.read_text(), filename=str(file))
        for node in ast.walk(tree):
            where = f"{file.relative_to(root.parent)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                edges += [Edge(module, _known_prefix(alias.name, modules), where) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base_parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*base_parts, *([node.module] if node.module else [])])
                else:
                    base = node.module or ""
                for alias in node.names:
                    candidate = f"{base}.{alias.name}"
                    target = candidate if candidate in modules else _known_prefix(base, modules)
                    edges.append(Edge(module, target, where))
    return ImportGraph(package=root.name, modules=modules, edges=edges)


def _known_prefix(name: str, modules: set[str]) -> str:
    """``name`` itself, or its longest prefix that is a module of the package (``import a.b.c``)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in modules:
            return prefix
    return name


def cycles(edges: dict[tuple[str, str], list[Edge]]) -> list[list[str]]:
    """Strongly connected components of more than one part (Tarjan)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for source, target in edges:
        graph[source].add(target)
        graph.setdefault(target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def describe_cycles(graph: ImportGraph) -> str:
    edges = graph.part_edges()
    lines = []
    for component in cycles(edges):
        lines.append("import cycle between " + " <-> ".join(component) + ":")
        for (source, target), evidence in sorted(edges.items()):
            if source in component and target in component:
                lines += [f"  {source} -> {target}"] + [f"    {edge}" for edge in evidence]
    return "\n".join(lines)


def third_party(name: str) -> bool:
    top = name.split(".")[0]
    return top not in sys.stdlib_module_names and top != "rollout_proxy"


@pytest.fixture(scope="module")
def graph() -> ImportGraph:
    return walk(SRC)


def violations(graph: ImportGraph, part: str, allowed: set[str]) -> list[Edge]:
    """Imports from ``part`` into parts of the package outside ``allowed``."""
    return [
        edge
        for edge in graph.internal()
        if graph.part(edge.source) == part and graph.part(edge.target) not in allowed | {part}
    ]


# -- the rules -------------------------------------------------------------------------------


def test_no_import_cycle_between_parts(graph):
    report = describe_cycles(graph)
    assert not report, "\n" + report


@pytest.mark.parametrize(("part", "allowed"), [("sdk", {"wire"}), ("wire", set())])
def test_shared_parts_import_nothing_from_the_server(graph, part, allowed):
    bad = violations(graph, part, allowed)
    assert not bad, f"{part} may import only {sorted(allowed | {part})} and third-party packages:\n" + "\n".join(
        map(str, bad)
    )


def test_the_trainer_does_not_import_the_server(graph):
    bad = [edge for edge in violations(graph, "trainer", set()) if graph.part(edge.target) in {"proxy", "core", "app"}]
    assert not bad, "trainer must not import proxy, core or app:\n" + "\n".join(map(str, bad))


#: the package's two HTTP client stacks, each on one side (docs/architecture.md "HTTP clients"): aiohttp on the
#: server's (the server, its engine client, the app that runs them), httpx2 on the plugins' (the SDK's transport,
#: sync and async; the openai and anthropic SDKs are built on it too). Runner and trainer reach the proxy through
#: the SDK's transport and the engines through the engine client, never with a stack of their own.
HTTP_STACKS = {"aiohttp": {"proxy", "engines", "app", "embedded", "cli"}, "httpx2": {"sdk"}}
OTHER_HTTP_CLIENTS = {"httpx", "requests", "urllib3", "urllib.request", "http.client", "pycurl"}


def test_each_http_stack_stays_on_its_side_and_there_is_no_third(graph):
    bad = []
    for edge in graph.external():
        top = edge.target.split(".")[0]
        if top in HTTP_STACKS and graph.part(edge.source) not in HTTP_STACKS[top]:
            bad.append(f"{edge} (only {sorted(HTTP_STACKS[top])} use {top})")
        if top in OTHER_HTTP_CLIENTS or edge.target in OTHER_HTTP_CLIENTS:
            bad.append(f"{edge} (a third HTTP client: use the SDK's transport or the engine client)")
    assert not bad, "\n".join(bad)


def redis_imports_outside_state(graph: ImportGraph) -> list[Edge]:
    return [
        edge for edge in graph.external() if edge.target.split(".")[0] == "redis" and graph.part(edge.source) != "state"
    ]


def test_only_state_touches_redis(graph):
    bad = [edge for edge in redis_imports_outside_state(graph)]
    assert not bad, "only state/ may import redis:\n" + "\n".join(map(str, bad))


def test_the_trainer_does_not_touch_redis(graph):
    bad = [edge for edge in redis_imports_outside_state(graph) if graph.part(edge.source) == "trainer"]
    assert not bad, "\n".join(map(str, bad))


# -- the walk itself -------------------------------------------------------------------------


def test_the_turn_path_sees_the_engines_through_the_router_protocol(graph):
    """``core`` drives turns through ``engines.router.EngineRouter``, not the concrete ``Fleet`` (the teacher
    pass, which reads a teacher fleet's members, is the one exception)."""
    concrete = [
        edge
        for edge in graph.internal()
        if edge.source.startswith("rollout_proxy.core.")
        and edge.target == "rollout_proxy.engines.fleet"
        and edge.source != "rollout_proxy.core.distill"
    ]
    assert not concrete, "\n".join(map(str, concrete))


def test_no_module_of_the_intake_and_the_handlers_imports_the_other_back(graph):
    """The intake imports what handlers share (``handlers.common``); nothing under ``handlers`` is imported
    by the intake's own modules in return of an import of theirs (no import circle, not even for types)."""
    edges = {(edge.source, edge.target) for edge in graph.internal()}
    circles = sorted((a, b) for a, b in edges if (b, a) in edges and a < b and a.startswith("rollout_proxy.proxy."))
    assert not circles, circles


def test_the_walk_sees_the_package(graph):
    edges = graph.part_edges()
    assert ("core", "state") in edges and ("core", "engines") in edges
    assert ("engines", "core") not in edges
    assert "rollout_proxy.core.turns" in graph.modules and "rollout_proxy" in graph.modules
    assert any(edge.target.split(".")[0] == "redis" for edge in graph.external())
    assert third_party("aiohttp") and not third_party("asyncio")


def write(root: Path, relative: str, source: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)


def test_the_walk_finds_every_kind_of_import_and_reports_cycles(tmp_path):
    root = tmp_path / "pkg"
    write(root, "__init__.py", "")
    write(root, "low/__init__.py", "from .inner import thing\n")
    write(root, "low/inner.py", "def thing():\n    from ..high import api  # a function-level, relative import\n")
    write(root, "high/__init__.py", "")
    write(root, "high/api.py", "import pkg.low.inner\nfrom pkg import top\n")
    write(root, "top.py", "from pkg.low import inner\nimport redis\n")
    graph = walk(root)
    edges = graph.part_edges()
    assert set(edges) == {("low", "high"), ("high", "low"), ("high", "top"), ("top", "low")}
    (evidence,) = edges[("low", "high")]
    assert evidence.source == "pkg.low.inner" and evidence.target == "pkg.high.api"
    assert evidence.where.endswith("low/inner.py:2")
    assert cycles(edges) == [["high", "low", "top"]]
    report = describe_cycles(graph)
    assert "import cycle between high <-> low <-> top" in report and "pkg.low.inner imports pkg.high.api" in report
    assert [edge.target for edge in graph.external()] == ["redis"]


def test_no_test_reads_a_path_outside_the_repository():
    """A clean clone with nothing beside it runs the tests: fixtures live under tests/fixtures."""
    repository = SRC.parents[1]
    outside = []
    for file in sorted((repository / "tests").rglob("*.py")):
        if file == Path(__file__).resolve():
            continue  # the patterns below
        tree = ast.parse(file.read_text(), filename=str(file))
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value
                outside_names = text in ("shared",) and "fixtures" in file.read_text()
                if (
                    text.startswith(("/work/", "/root/", "/home/"))
                    or "../shared" in text
                    or "/shared/fixtures" in text
                    or outside_names
                ):
                    outside.append(f"{file.relative_to(repository)}:{node.lineno}: {text[:80]!r}")
    assert outside == []
