"""Layers import downwards only (docs/architecture.md): checked on every module's imports.

``node/`` (the composition root) may import anything and only the command line imports it;
``cluster/`` sits above the broker core and imports it, and so does ``services/``, beside it
(neither imports the other); the core (``broker/``) never imports
``cluster/`` or ``node/``: it defines the interfaces it needs instead (broker/interfaces.py).
Inside ``broker/``, the core never imports ``broker/transport/`` (the asyncio glue above it):
it sees a connection as its own ``ClientHandle`` (broker/client.py). The storage engines
(``log/``, ``state/``) import no broker, cluster or node type. And no module of ``broker/`` or
``node/`` is part of an import cycle.

Imports under ``if TYPE_CHECKING:`` count too: a type from a layer above is a dependency on it;
so do imports inside functions.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parents[1] / "src" / "meshmq"

# package -> the meshmq packages (and top-level modules) it must not import
FORBIDDEN = {
    "mqtt": {"broker", "cluster", "node", "log", "state", "auth", "pipeline", "config",
             "services"},
    "log": {"broker", "cluster", "node", "state", "auth", "pipeline", "services"},
    "state": {"broker", "cluster", "node", "mqtt", "auth", "pipeline", "services"},
    "auth": {"broker", "cluster", "node", "log", "state", "pipeline", "services"},
    "broker": {"cluster", "node", "pipeline", "services"},
    "cluster": {"node", "pipeline", "services"},
    # request/reply sits above the core beside cluster/: neither imports the other (node/ joins
    # them: cluster/servicelinks.py carries the services' frames without naming services/)
    "services": {"node", "pipeline", "cluster"},
    # the asyncio client runs in applications: it needs the protocol and nothing of the broker
    "client": {"broker", "cluster", "node", "log", "state", "auth", "pipeline", "config",
               "services"},
    "pipeline": {"node", "cluster", "services"},
    "config": {"broker", "cluster", "node", "state", "pipeline", "services"},
}
MAY_IMPORT_NODE = {"cli", "node"}
TRANSPORT = "meshmq.broker.transport"
CYCLE_FREE = ("meshmq.broker", "meshmq.node")  # no module of these is in an import cycle


def imported_modules(path: Path, module: str = "") -> set[str]:
    """The dotted names ``path`` imports, wherever the import is (``from a.b import c``
    gives ``a.b`` and ``a.b.c``, as ``c`` may be a module). ``module``: the name of ``path``
    itself, to resolve relative imports."""
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def imported(path: Path) -> set[str]:
    """The meshmq packages or top-level modules ``path`` imports (``meshmq.x...`` -> x)."""
    return {name.split(".")[1] for name in imported_modules(path)
            if name.startswith("meshmq.") and not name.endswith(".*")}


def layer_of(path: Path) -> str:
    relative = path.relative_to(SOURCE)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def module_of(path: Path, root: Path) -> str:
    """``root/broker/session.py`` -> ``meshmq.broker.session`` (``root``: a ``meshmq`` tree)."""
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same tree it imports (every import counts)."""
    modules = {module_of(path, root): path for path in root.rglob("*.py")}
    return {name: {target for target in imported_modules(path, name)
                   if target in modules and target != name}
            for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph``: its strongly connected components of more than one
    module, each sorted (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(found)


def a_path(graph: dict[str, set[str]], cycle: list[str]) -> Iterator[str]:
    """One way around ``cycle``, for the failure message: its modules in import order."""
    members, module, seen = set(cycle), cycle[0], []
    while module not in seen:
        seen.append(module)
        module = min(graph[module] & members)
    yield from seen[seen.index(module):]
    yield module


MODULES = sorted(SOURCE.rglob("*.py"))
CORE = [path for path in MODULES if layer_of(path) == "broker"
        and not module_of(path, SOURCE).startswith(TRANSPORT)]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(SOURCE)))
def test_imports_point_down(path: Path) -> None:
    layer = layer_of(path)
    imports = imported(path) - {layer}
    assert not imports & FORBIDDEN.get(layer, set()), (
        f"{path.relative_to(SOURCE)} ({layer}/) imports {sorted(imports & FORBIDDEN[layer])}")
    if "node" in imports:
        assert layer in MAY_IMPORT_NODE, f"{path.relative_to(SOURCE)} imports node/"


@pytest.mark.parametrize("path", CORE, ids=lambda p: str(p.relative_to(SOURCE)))
def test_the_core_never_imports_the_transport(path: Path) -> None:
    transport = sorted(name for name in imported_modules(path, module_of(path, SOURCE))
                       if name == TRANSPORT or name.startswith(TRANSPORT + "."))
    assert not transport, f"{path.relative_to(SOURCE)} (the core) imports {transport}"


def test_no_import_cycle_in_broker_or_node() -> None:
    graph = import_graph(SOURCE)
    found = [cycle for cycle in cycles(graph)
             if any(module.startswith(CYCLE_FREE) for module in cycle)]
    assert not found, "import cycles: " + "; ".join(
        " -> ".join(a_path(graph, cycle)) for cycle in found)


def test_the_checker_sees_a_forbidden_import(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                      "    from meshmq.cluster.mesh import Mesh\nimport meshmq.node.server\n")
    assert imported(sample) == {"cluster", "node"}


def test_the_cycle_check_sees_a_planted_cycle(tmp_path: Path) -> None:
    """a -> b (plain), b -> c (under TYPE_CHECKING), c -> a (inside a function): one cycle;
    d imports a but nothing imports d, and e imports itself only: neither is reported."""
    root = tmp_path / "meshmq"
    package = root / "broker"
    package.mkdir(parents=True)
    for init in (root / "__init__.py", package / "__init__.py"):
        init.write_text("")
    sources = {
        "a": "from meshmq.broker.b import B\n",
        "b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
             "    from meshmq.broker.c import C\nB = 1\n",
        "c": "def later():\n    from meshmq.broker import a\n    return a\nC = 1\n",
        "d": "import meshmq.broker.a\n",
        "e": "from . import e\n",
    }
    for name, text in sources.items():
        (package / f"{name}.py").write_text(text)
    graph = import_graph(root)
    assert graph["meshmq.broker.c"] == {"meshmq.broker", "meshmq.broker.a"}
    assert cycles(graph) == [["meshmq.broker.a", "meshmq.broker.b", "meshmq.broker.c"]]
    assert list(a_path(graph, cycles(graph)[0])) == [
        "meshmq.broker.a", "meshmq.broker.b", "meshmq.broker.c", "meshmq.broker.a"]
    (package / "c.py").write_text("C = 1\n")  # the cycle broken
    assert cycles(import_graph(root)) == []
