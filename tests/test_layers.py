"""Layers import downwards only (docs/architecture.md): checked on every module's imports.

``node/`` (the composition root) may import anything and only the command line imports it;
``cluster/`` sits above the broker core and imports it; the core (``broker/``) never imports
``cluster/`` or ``node/``: it defines the interfaces it needs instead (broker/interfaces.py).
Imports under ``if TYPE_CHECKING:`` count too: a type from a layer above is a dependency on it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parents[1] / "src" / "meshmq"

# package -> the meshmq packages (and top-level modules) it must not import
FORBIDDEN = {
    "mqtt": {"broker", "cluster", "node", "log", "auth", "pipeline", "config", "services"},
    "log": {"broker", "cluster", "node", "auth", "pipeline", "services"},
    "auth": {"broker", "cluster", "node", "log", "pipeline", "services"},
    "broker": {"cluster", "node", "pipeline", "services"},
    "cluster": {"node", "pipeline", "services"},
    "pipeline": {"node", "cluster", "services"},
    "config": {"broker", "cluster", "node", "pipeline", "services"},
}
MAY_IMPORT_NODE = {"cli", "node"}


def imported(path: Path) -> set[str]:
    """The meshmq packages or top-level modules ``path`` imports (``meshmq.x...`` -> x)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "meshmq" and len(parts) > 1:
                found.add(parts[1])
    return found


def layer_of(path: Path) -> str:
    relative = path.relative_to(SOURCE)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


MODULES = sorted(SOURCE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(SOURCE)))
def test_imports_point_down(path: Path) -> None:
    layer = layer_of(path)
    imports = imported(path) - {layer}
    assert not imports & FORBIDDEN.get(layer, set()), (
        f"{path.relative_to(SOURCE)} ({layer}/) imports {sorted(imports & FORBIDDEN[layer])}")
    if "node" in imports:
        assert layer in MAY_IMPORT_NODE, f"{path.relative_to(SOURCE)} imports node/"


def test_the_checker_sees_a_forbidden_import(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                      "    from meshmq.cluster.mesh import Mesh\nimport meshmq.node.server\n")
    assert imported(sample) == {"cluster", "node"}
