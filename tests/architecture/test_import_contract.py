"""The package's import rules (docs/architecture.md), read from its source.

Every import statement of every module is parsed (module level and inside
functions alike) and resolved to the package's own module it names, so a rule
is checked without importing anything. Each rule is a function over that
graph; the planted-violation tests below show each one can fail.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = "dsv4_idxk_probe"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE

#: Layers, lowest first. A module may import its own top-level part, or a part
#: of a lower layer; never a higher one or a peer. The same list, drawn, is in
#: docs/architecture.md.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("version",),
    ("", "vocabulary", "environment_variables", "_lazy", "boundedfile", "safeyaml", "background", "safety"),
    ("schema",),  # msgspec Structs from safeyaml's documents (config sections)
    ("digest",),
    ("diagnosis", "exchange", "roomlog", "metrics"),
    ("pd",),
    ("hicache",),
    ("config", "offline"),
    ("sglang",),
    ("runtime",),
    ("activation",),
    ("bootstrap",),
    ("testbed",),
    ("cli",),
    ("__main__",),
)

#: Inside `testbed/`, its parts in the same sense: the fault machinery at the
#: bottom, the SGLang bed (whose pool builder the built-in rig borrows) above it.
TESTBED_LAYERS: tuple[tuple[str, ...], ...] = (("faults",), ("sglang",), ("builtin",))

#: The parts that may import SGLang itself.
SGLANG_PARTS = ("sglang", "testbed.sglang")

#: Packages of the `[demo]` extra (pyproject.toml): a serving image need not have them, so
#: only the test beds import them, and the CLI only inside a function (`demo` says what to install).
EXTRA_PACKAGES = ("nixl", "rich")


@dataclass(frozen=True)
class Edge:
    """One import: `source` imports `target` (both dotted, without the package prefix)."""

    source: str
    target: str
    line: int
    module_level: bool


def module_name(path: Path, root: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(root).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts = parts[:-1]
    return ".".join(parts), is_package


def parse_tree(root: Path) -> dict[str, tuple[bool, ast.Module]]:
    return {name: (is_package, ast.parse(path.read_text(), str(path)))
            for path in sorted(root.rglob("*.py"))
            for name, is_package in [module_name(path, root)]}


def _module_level_nodes(tree: ast.Module) -> set[int]:
    """ids of import nodes that run when the module is imported (not inside a def)."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inside.update(id(n) for n in ast.walk(node) if n is not node)
    return {id(n) for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in inside}


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    """ids of nodes under `if TYPE_CHECKING:`: read by type checkers, never run."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                out.update(id(n) for n in ast.walk(child))
    return out


def edges(modules: dict[str, tuple[bool, ast.Module]]) -> tuple[list[Edge], list[Edge]]:
    """(imports of the package's own modules, imports of anything else), each resolved."""
    own, foreign = [], []
    for name, (is_package, tree) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        top = _module_level_nodes(tree)
        typing_only = _type_checking_nodes(tree)
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".") if package else []
                    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                    stem = ".".join(base + ([node.module] if node.module else []))
                    stem = f"{PACKAGE}.{stem}" if stem else PACKAGE
                else:
                    stem = node.module or ""
                # `from pkg import sub` names a module when pkg/sub is one
                own_stem = stem == PACKAGE or stem.startswith(PACKAGE + ".")
                targets = [f"{stem}.{a.name}" if own_stem and f"{stem}.{a.name}"[len(PACKAGE) + 1:] in modules else stem
                           for a in node.names]
            else:
                continue
            for target in dict.fromkeys(targets):
                if target == PACKAGE or target.startswith(PACKAGE + "."):
                    short = target[len(PACKAGE) + 1:]
                    while short and short not in modules:
                        short = short.rpartition(".")[0]
                    own.append(Edge(name, short, node.lineno, id(node) in top))
                else:
                    foreign.append(Edge(name, target, node.lineno, id(node) in top))
    return own, foreign


def _part(name: str) -> str:
    return name.split(".")[0] if name else ""


def _rank(part: str, layers) -> int | None:
    for i, layer in enumerate(layers):
        if part in layer:
            return i
    return None


def layer_violations(own: list[Edge]) -> list[str]:
    out = []
    for e in own:
        src, dst = _part(e.source), _part(e.target)
        if src == dst or e.target == "":
            continue
        rs, rd = _rank(src, LAYERS), _rank(dst, LAYERS)
        if rs is None or rd is None:
            out.append(f"{e.source}:{e.line} imports {e.target}: {src if rs is None else dst!r} is in no layer")
        elif rd >= rs:
            out.append(f"{e.source}:{e.line} imports {e.target}, a {'peer' if rd == rs else 'higher layer'}")
    for e in own:
        if _part(e.source) == "testbed" == _part(e.target):
            src, dst = e.source.split(".")[1:2], e.target.split(".")[1:2]
            if src and dst and src != dst:
                rs, rd = _rank(src[0], TESTBED_LAYERS), _rank(dst[0], TESTBED_LAYERS)
                if rs is None or rd is None or rd >= rs:
                    out.append(f"{e.source}:{e.line} imports {e.target} (testbed parts: {TESTBED_LAYERS})")
    return out


def product_violations(own: list[Edge]) -> list[str]:
    """Product code never imports a test bed or the CLI; the CLI imports a test bed only lazily."""
    out = []
    for e in own:
        src, dst = _part(e.source), _part(e.target)
        if src in ("testbed", "cli", "__main__") and not (src == "cli" and dst == "testbed" and e.module_level):
            continue
        if dst in ("testbed", "cli"):
            out.append(f"{e.source}:{e.line} imports {e.target}" + (" at module level" if src == "cli" else ""))
    return out


def sglang_violations(foreign: list[Edge]) -> list[str]:
    out = []
    for e in foreign:
        if e.target.split(".")[0] != "sglang":
            continue
        if not any(e.source == p or e.source.startswith(p + ".") for p in SGLANG_PARTS):
            out.append(f"{e.source}:{e.line} imports SGLang ({e.target})")
    return out


def extra_violations(foreign: list[Edge]) -> list[str]:
    """Imports of a `[demo]`-extra package outside the test beds (or at the CLI's module level)."""
    out = []
    for e in foreign:
        if e.target.split(".")[0] not in EXTRA_PACKAGES:
            continue
        src = _part(e.source)
        if src == "testbed" or (src == "cli" and not e.module_level):
            continue
        out.append(f"{e.source}:{e.line} imports {e.target}, a package of the [demo] extra")
    return out


def torch_violations(own: list[Edge], foreign: list[Edge], part: str = "offline") -> list[str]:
    """Modules of `part` that import torch, directly or through what they import at module level."""
    graph: dict[str, set[str]] = {}
    for e in own:
        if e.module_level:
            graph.setdefault(e.source, set()).add(e.target)
            # importing a.b.c runs a/__init__ and a/b/__init__ first
            parents = e.target.split(".")
            for i in range(1, len(parents)):
                graph[e.source].add(".".join(parents[:i]))
    heavy = {e.source: e for e in foreign if e.module_level and e.target.split(".")[0] in ("torch", "triton")}
    out = []
    for start in sorted({e.source for e in own + foreign if _part(e.source) == part}):
        seen, stack, via = {start}, [start], {start: None}
        while stack:
            cur = stack.pop()
            if cur in heavy:
                chain = [cur]
                while via[chain[-1]] is not None:
                    chain.append(via[chain[-1]])
                out.append(f"{start} imports torch through {' <- '.join(chain)}")
                break
            for nxt in graph.get(cur, ()):
                if nxt not in seen:
                    seen.add(nxt)
                    via[nxt] = cur
                    stack.append(nxt)
    return out


def cycles(own: list[Edge]) -> list[str]:
    """Circles of modules importing each other (package-to-own-submodule edges excluded)."""
    graph: dict[str, set[str]] = {}
    for e in own:
        if e.target and e.source != e.target and not e.target.startswith(e.source + "."):
            graph.setdefault(e.source, set()).add(e.target)
    out, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                out.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, path)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return out


@pytest.fixture(scope="module")
def graph():
    return edges(parse_tree(ROOT))


def test_layers_point_down(graph):
    assert layer_violations(graph[0]) == []


def test_product_code_imports_neither_a_test_bed_nor_the_cli(graph):
    assert product_violations(graph[0]) == []


def test_only_the_adapters_and_the_sglang_bed_import_sglang(graph):
    assert sglang_violations(graph[1]) == []


def test_demo_extra_packages_are_imported_only_by_the_test_beds(graph):
    assert extra_violations(graph[1]) == []


def test_offline_never_imports_torch(graph):
    assert torch_violations(*graph) == []


def test_no_module_imports_another_in_a_circle(graph):
    assert cycles(graph[0]) == []


def test_every_part_of_the_package_is_in_a_layer(graph):
    parts = {_part(name) for name in parse_tree(ROOT)} - {""}
    assert sorted(p for p in parts if _rank(p, LAYERS) is None) == []


def test_offline_modules_import_without_torch_in_a_fresh_interpreter():
    names = sorted(f"{PACKAGE}.{n}" for n in parse_tree(ROOT) if _part(n) == "offline")
    code = f"import sys\nfor n in {names!r}: __import__(n)\nprint(sorted(m for m in ('torch', 'triton') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# %% each rule fails on a planted violation


def _planted(tmp_path: Path, files: dict[str, str]):
    root = tmp_path / PACKAGE
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for d in {p.parent for p in root.rglob("*.py")} | {root}:
        (d / "__init__.py").touch()
    return edges(parse_tree(root))


def test_a_product_module_importing_the_test_bed_is_caught(tmp_path):
    own, _ = _planted(tmp_path, {"pd/decode.py": "def f():\n    from ..testbed.faults import spec\n",
                                 "testbed/faults/spec.py": ""})
    assert product_violations(own) == ["pd.decode:2 imports testbed.faults.spec"]
    assert layer_violations(own) == ["pd.decode:2 imports testbed.faults.spec, a higher layer"]


def test_a_library_importing_the_cli_is_caught(tmp_path):
    own, _ = _planted(tmp_path, {"testbed/faults/verify.py": "from ...cli.diff import exit_status\n",
                                 "cli/diff.py": ""})
    assert layer_violations(own) == ["testbed.faults.verify:1 imports cli.diff, a higher layer"]


def test_the_cli_may_import_a_test_bed_lazily_but_not_at_module_level(tmp_path):
    own, _ = _planted(tmp_path, {"cli/demo.py": "from ..testbed.builtin import rig\n\ndef f():\n    from ..testbed import sglang\n",
                                 "testbed/builtin/rig.py": ""})
    assert product_violations(own) == ["cli.demo:1 imports testbed.builtin.rig at module level"]


def test_a_peer_import_is_caught(tmp_path):
    own, _ = _planted(tmp_path, {"exchange/client.py": "from ..roomlog import writer\n", "roomlog/writer.py": ""})
    assert layer_violations(own) == ["exchange.client:1 imports roomlog.writer, a peer"]


def test_sglang_outside_the_adapters_is_caught(tmp_path):
    _, foreign = _planted(tmp_path, {"pd/decode.py": "import torch\nfrom sglang.srt import utils\n",
                                     "sglang/hooks.py": "import sglang.srt.managers\n",
                                     "testbed/sglang/launch.py": "from sglang.srt.entrypoints import http_server\n"})
    assert sglang_violations(foreign) == ["pd.decode:2 imports SGLang (sglang.srt)"]


def test_a_demo_extra_package_in_product_code_is_caught(tmp_path):
    _, foreign = _planted(tmp_path, {"runtime.py": "import rich.console\n",
                                     "cli/check.py": "from nixl._api import nixl_agent\n\ndef f():\n    import rich\n",
                                     "testbed/builtin/transport.py": "from nixl._api import nixl_agent\n"})
    assert sorted(extra_violations(foreign)) == ["cli.check:1 imports nixl._api, a package of the [demo] extra",
                                                 "runtime:1 imports rich.console, a package of the [demo] extra"]


def test_torch_reached_through_another_module_is_caught(tmp_path):
    own, foreign = _planted(tmp_path, {"offline/join.py": "from ..pd import records\n",
                                       "pd/records.py": "from ..digest.result import x\n",
                                       "digest/result.py": "import torch\n"})
    assert torch_violations(own, foreign) == ["offline.join imports torch through digest.result <- pd.records <- offline.join"]
    own2, foreign2 = _planted(tmp_path / "lazy", {"offline/join.py": "def f():\n    import torch\n"})
    assert torch_violations(own2, foreign2) == []


def test_an_import_for_type_checkers_only_makes_no_circle(tmp_path):
    own, _ = _planted(tmp_path, {"digest/launch.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .collector import B\n",
                                 "digest/collector.py": "from .launch import L\n"})
    assert cycles(own) == []


def test_a_circle_is_caught(tmp_path):
    own, _ = _planted(tmp_path, {"testbed/sglang/plugin.py": "from . import inserver\n",
                                 "testbed/sglang/inserver.py": "from .plugin import ENV_OUT\n"})
    assert cycles(own) == ["testbed.sglang.inserver -> testbed.sglang.plugin -> testbed.sglang.inserver"]


def test_a_testbed_part_importing_upwards_is_caught(tmp_path):
    own, _ = _planted(tmp_path, {"testbed/sglang/demo.py": "from ..builtin.demo import render\n",
                                 "testbed/builtin/demo.py": ""})
    assert layer_violations(own) == [
        "testbed.sglang.demo:1 imports testbed.builtin.demo (testbed parts: (('faults',), ('sglang',), ('builtin',)))"]
