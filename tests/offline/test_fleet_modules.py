"""The fleet engine's code stays in small modules with one job each, and takes what it
shares with the reference join through public names only (docs/fleet.md, "Code map")."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OFFLINE = ROOT / "dsv4_idxk_probe" / "offline"
MAX_LINES = 400


def fleet_sources() -> list[Path]:
    single = OFFLINE / "fleet.py"
    return sorted((OFFLINE / "fleet").glob("*.py")) + ([single] if single.exists() else [])


def private_imports(path: Path) -> list[str]:
    """`from X import _name` where X is another module (a relative or package import)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            found += [f"{path.name}: from {'.' * node.level}{node.module or ''} import {a.name}"
                      for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_the_fleet_engine_imports_no_private_name_of_another_module():
    sources = fleet_sources()
    assert sources, "the fleet engine's sources are where the docs say"
    assert [imp for path in sources for imp in private_imports(path)] == []


def test_each_fleet_module_is_small():
    sizes = {path.name: len(path.read_text().splitlines()) for path in fleet_sources()}
    assert len(sizes) > 1
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}
