"""Patch targets as data: load a target table, resolve each entry against the
installed SGLang, check its signature.

A table (``configs/targets/*.yaml``, format in its header comment) lists
``module``, ``qualname``, the leading ``params`` the hook relies on, the hook
``kind``, the wrapper factory (``hook``), ``required`` and ``role``, and
optionally the SGLang releases an entry applies to (``sglang: ">=0.5.21"``,
in the spirit of OpenTelemetry's instrumentation ranges) and what a missing
optional target ``cost``s the operator. One table covers every release it
lists under ``releases``; loading it for a release keeps the entries whose
range holds that release (`select_table`): ``sglang`` is the installed
release's table, ``sglang@0.5.21`` (or ``sglang-0.5.21``) a given release's.
A bad table raises `TargetFileError` naming the file, line and field. A table
is data an operator may edit, so it is read by `safeyaml` (no anchors or
aliases, bounded size, nodes and depth, no duplicate keys) and its ``hook``
may name only the probe's own wrapper factories
(``dsv4_idxk_probe.sglang.<module>:make_<name>_wrapper``, `hook_problem`):
``sys:exit`` or ``os:system`` is refused when the table is loaded.
Resolution never raises: a target whose module or attribute is missing, or
whose parameters changed, comes back with that status and a reason, and the
caller skips it while the others work.
"""

from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Iterable

from .. import safeyaml
from ..boundedfile import read_bounded_text
from ..config import is_table_path
from ..safeyaml import shorten
from ..vocabulary import PATCH_STATUSES

KINDS = ("before", "after", "around")
ROLES = ("prefill", "decode", "any")
#: Every status a target can be reported with (metric label values).
STATUSES = PATCH_STATUSES
_FIELDS = {"name", "module", "qualname", "params", "kind", "hook", "required", "role", "sglang", "cost"}
_LINE = "__line__"
MAX_TABLE_NODES = 50_000  # the shipped table, every release, is ~1,000 nodes

#: The package whose modules a table's ``hook`` may name.
HOOK_PACKAGE = "dsv4_idxk_probe.sglang"
#: Modules outside HOOK_PACKAGE whose factories a table may name too. Only Python code
#: sets it (the tests' stand-in hosts, a fork's own plugin before it loads its tables),
#: never a table, a config file or the environment.
EXTRA_HOOK_MODULES: frozenset[str] = frozenset()
_HOOK = re.compile(r"^(?P<module>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):(?P<factory>make_\w*wrapper)$", re.ASCII)


class TargetFileError(ValueError):
    """A target table that cannot be used; the message names file, line and field."""


@dataclass(frozen=True)
class Target:
    name: str
    module: str
    qualname: str
    params: tuple[str, ...]
    kind: str
    hook: str  # "package.module:factory"
    required: bool
    role: str
    where: str = ""  # file:line of the entry
    sglang: str = ""  # the releases it applies to (">=0.5.21, <0.5.23"); "" is all
    cost: str = ""  # what the operator loses when this (optional) target is missing

    @property
    def path(self) -> str:
        return f"{self.module}.{self.qualname}"


@dataclass
class Resolution:
    """What the installed SGLang has for one target."""

    target: Target
    status: str  # "resolved" | "missing" | "signature_changed"
    detail: str = ""
    parent: Any = None
    attribute: str | None = None
    original: Any = None
    signature: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "resolved"


# %% loading


def hook_problem(hook: str) -> str | None:
    """Why a table may not name `hook`, or None: it must be ``module:make_..._wrapper`` with
    the module inside `HOOK_PACKAGE` (or listed in `EXTRA_HOOK_MODULES`)."""
    match = _HOOK.match(hook)
    if match is None or not (match.group("module").startswith(HOOK_PACKAGE + ".")
                             or match.group("module") in EXTRA_HOOK_MODULES):
        return (f"{shorten(hook)} is not one of the probe's wrapper factories: a table may name only "
                f"'{HOOK_PACKAGE}.<module>:make_<name>_wrapper'")
    return None


class _LineLoader(safeyaml.Loader):
    """The safe loader (`safeyaml`), remembering the line of every mapping."""

    def construct_mapping(self, node, deep=False):
        mapping = super().construct_mapping(node, deep=deep)
        mapping[_LINE] = node.start_mark.line + 1
        return mapping


def _shipped_tables():
    """The package's folder of target tables."""
    return resources.files("dsv4_idxk_probe").joinpath("configs", "targets")


def shipped_target_path(name: str) -> Path:
    """Path of a shipped table by name (``sglang``, ``fork-prefill2-decode2``)."""
    return Path(str(_shipped_tables().joinpath(f"{name}.yaml")))


def shipped_table_names() -> list[str]:
    """The names `shipped_target_path` takes, for a refusal to list."""
    return sorted(p.name[: -len(".yaml")] for p in _shipped_tables().iterdir() if p.name.endswith(".yaml"))


def target_file_path(name_or_path: str) -> Path:
    if is_table_path(name_or_path):
        return Path(name_or_path)
    path = shipped_target_path(name_or_path)
    if not path.is_file():  # a typo named a file inside the package, which helped no one
        raise TargetFileError(f"targets: {shorten(name_or_path)} is neither a shipped table "
                              f"({', '.join(shipped_table_names())}) nor a path (a path has a / or ends in "
                              ".yaml or .yml)")
    return path


def _entry(source: str, index: int, raw: Any) -> Target:
    if not isinstance(raw, dict):
        raise TargetFileError(f"{source}: targets[{index}] must be a mapping, got {type(raw).__name__}")
    where = f"{source}:{raw.get(_LINE, '?')}"
    raw = {k: v for k, v in raw.items() if k != _LINE}
    name = raw.get("name")
    if isinstance(name, str):
        label = f"targets[{index}] ({name if len(name) <= 60 else name[:57] + '...'})"
    else:
        label = f"targets[{index}]"
    unknown = sorted(map(str, set(raw) - _FIELDS))
    if unknown:
        raise TargetFileError(f"{where}: {label} has unknown field(s) {shorten(unknown, 200)}; "
                              f"known: {sorted(_FIELDS)}")
    for key in ("name", "module", "qualname", "kind", "hook", "role"):
        if not isinstance(raw.get(key), str) or not raw[key]:
            raise TargetFileError(f"{where}: {label}.{key} must be a non-empty string, got {shorten(raw.get(key))}")
    if raw["kind"] not in KINDS:
        raise TargetFileError(f"{where}: {label}.kind must be one of {list(KINDS)}, got {shorten(raw['kind'])}")
    if raw["role"] not in ROLES:
        raise TargetFileError(f"{where}: {label}.role must be one of {list(ROLES)}, got {shorten(raw['role'])}")
    if raw["hook"].count(":") != 1:
        raise TargetFileError(f"{where}: {label}.hook must be 'package.module:factory', got {shorten(raw['hook'])}")
    refused = hook_problem(raw["hook"])
    if refused:
        raise TargetFileError(f"{where}: {label}.hook: {refused}")
    params = raw.get("params", [])
    if not isinstance(params, list) or not all(isinstance(p, str) and p for p in params):
        raise TargetFileError(f"{where}: {label}.params must be a list of parameter names, got {shorten(params)}")
    if not isinstance(raw.get("required"), bool):
        raise TargetFileError(f"{where}: {label}.required must be true or false, got {shorten(raw.get('required'))}")
    for key in ("sglang", "cost"):
        if key in raw and (not isinstance(raw[key], str) or not raw[key].strip()):
            raise TargetFileError(f"{where}: {label}.{key} must be a non-empty string, got {shorten(raw[key])}")
    releases = raw.get("sglang", "")
    if releases:
        try:
            parse_range(releases)
        except ValueError as exc:
            raise TargetFileError(f"{where}: {label}.sglang: {exc}") from None
    return Target(
        raw["name"], raw["module"], raw["qualname"], tuple(params), raw["kind"], raw["hook"],
        raw["required"], raw["role"], where, releases, raw.get("cost", "").strip(),
    )


# %% releases

_CLAUSE = re.compile(r"^(>=|<=|==|!=|>|<)\s*(\d+(?:\.\d+)*)$")
_OPS = {
    ">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b, "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b, ">": lambda a, b: a > b, "<": lambda a, b: a < b,
}


def release_tuple(version: str) -> tuple[int, ...] | None:
    """(0, 5, 23) for "0.5.23", "0.5.23.post1" or "0.5.23+fork"; None when it has no leading number."""
    match = re.match(r"^\s*v?(\d+(?:\.\d+)*)", str(version))
    if match is None or any(len(p) > 9 for p in match.group(1).split(".")):  # int() of 5000 digits raises
        return None
    parts = tuple(int(p) for p in match.group(1).split("."))
    return (parts + (0, 0, 0))[:3]


def parse_range(text: str) -> list[tuple[str, tuple[int, ...]]]:
    """">=0.5.18, <0.5.21" as [(">=", (0, 5, 18)), ("<", (0, 5, 21))]; ValueError naming the clause."""
    clauses = []
    for clause in text.split(","):
        match = _CLAUSE.match(clause.strip())
        if match is None:
            raise ValueError(f"{shorten(clause.strip())} is not a version clause like '>=0.5.21' (in {shorten(text)})")
        bound = release_tuple(match.group(2))
        if bound is None:
            raise ValueError(f"{shorten(clause.strip())} has a version part of more than 9 digits (in {shorten(text)})")
        clauses.append((match.group(1), bound))
    return clauses


def in_range(version: tuple[int, ...], text: str) -> bool:
    return all(_OPS[op](version, bound) for op, bound in parse_range(text)) if text else True


def installed_sglang() -> str | None:
    """The installed SGLang's version (its distribution metadata, else ``sglang.version``)."""
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:
        pass
    try:
        from sglang.version import __version__

        return str(__version__)
    except Exception:
        return None


@dataclass(frozen=True)
class TargetTable:
    """A parsed table: its entries for every release, and the releases it was tested with."""

    source: str
    targets: tuple[Target, ...]
    releases: tuple[str, ...]  # "0.5.18", ... (empty: a table without ranges)


@dataclass(frozen=True)
class TableSelection:
    """A table's entries for one release (what `check` reports and the patcher applies)."""

    source: str
    release: str | None  # the release the entries were chosen for; None: no ranges, all entries
    tested: bool  # the release is one the table lists under `releases`
    targets: list[Target]
    absent: list[Target]  # entries of other releases whose name this release has no entry for

    @property
    def label(self) -> str:
        name = Path(self.source).stem
        return f"{name}@{self.release}" if self.release else name


def parse_table(text: str, source: str) -> TargetTable:
    document = safeyaml.load(text, source, TargetFileError, loader=_LineLoader, max_nodes=MAX_TABLE_NODES)
    if not isinstance(document, dict) or "targets" not in document:
        raise TargetFileError(f"{source}: the top level must be a mapping with a 'targets' list")
    entries = document["targets"] or []
    if not isinstance(entries, list) or not entries:  # an empty table patches nothing, and `check` passed it
        raise TargetFileError(f"{source}:{document.get(_LINE, '?')}: targets must be a non-empty list")
    releases = document.get("releases", [])
    if not isinstance(releases, list) or not all(isinstance(r, str) and release_tuple(r) for r in releases):
        raise TargetFileError(f"{source}:{document.get(_LINE, '?')}: releases must be a list of versions "
                              f"in quotes (\"0.5.23\"), got {shorten(releases)}")
    targets = [_entry(source, i, raw) for i, raw in enumerate(entries)]
    seen: dict[str, Target] = {}
    for t in targets:
        first = seen.get(t.name)
        if first is not None and not (first.sglang and t.sglang):
            raise TargetFileError(f"{t.where}: target name {t.name!r} is used twice (first at {first.where}); "
                                  "entries sharing a name need disjoint `sglang` ranges")
        seen.setdefault(t.name, t)
    table = TargetTable(source, tuple(targets), tuple(releases))
    for release in table.releases:  # each listed release must see each name at most once
        _entries_for(table, release_tuple(release))
    return table


def _entries_for(table: TargetTable, version: tuple[int, ...] | None) -> list[Target]:
    chosen = [t for t in table.targets if version is None or in_range(version, t.sglang)]
    seen: dict[str, str] = {}
    for t in chosen:
        if t.name in seen:
            raise TargetFileError(f"{t.where}: target name {t.name!r} also applies at {seen[t.name]} "
                                  f"for SGLang {'.'.join(map(str, version or ()))}: overlapping `sglang` ranges")
        seen[t.name] = t.where
    return chosen


def parse_target_table(text: str, source: str, release: str | None = None) -> list[Target]:
    """The entries of a table text (for `release`, when given)."""
    table = parse_table(text, source)
    return _entries_for(table, release_tuple(release) if release else None)


def _split_name(name_or_path: str) -> tuple[str, str | None]:
    """("sglang", "0.5.21") for "sglang@0.5.21" or "sglang-0.5.21"; (name, None) otherwise
    ("/etc/probe@prod/fork.yaml": the @ is the path's, not a release's)."""
    if "@" in name_or_path:
        name, _, release = name_or_path.rpartition("@")
        if not is_table_path(release):
            return name, release
    match = re.match(r"^(sglang)-(\d+\.\d+\.\d+)$", name_or_path)
    if match:
        return match.group(1), match.group(2)
    return name_or_path, None


MAX_TABLE_BYTES = 1 << 20  # a table of every target of every release is a few KiB


def read_table(path: Path) -> TargetTable:
    """A table file: a regular file, size-capped before it is read (an operator may name any path)."""
    return parse_table(read_bounded_text(path, "target file", MAX_TABLE_BYTES, TargetFileError), str(path))


def select_table(name_or_path: str | Path, installed: str | None = "auto") -> TableSelection:
    """A table's entries for the release it names (``sglang@0.5.21``), else for the
    installed SGLang (``installed="auto"``), else for its newest listed release.

    An installed release the table does not list is still served (entries whose
    range holds it), flagged untested; a named release the table does not list
    is an error, since nobody has looked at that combination.
    """
    name, named = _split_name(str(name_or_path))
    path = target_file_path(name)
    table = read_table(path)
    if named is not None:
        if release_tuple(named) is None or (table.releases and named not in table.releases):
            raise TargetFileError(f"{path}: no table for SGLang {named!r}; this table lists "
                                  f"{', '.join(table.releases) or 'no releases'}")
        release = named
    elif not table.releases and not any(t.sglang for t in table.targets):
        return TableSelection(str(path), None, True, list(table.targets), [])
    else:
        release = installed_sglang() if installed == "auto" else installed
        if release is None or release_tuple(release) is None:
            release = max(table.releases, key=release_tuple) if table.releases else None
    version = release_tuple(release) if release else None
    chosen = _entries_for(table, version)
    names = {t.name for t in chosen}
    absent, seen = [], set()
    for t in table.targets:
        if t.name not in names and t.name not in seen:
            seen.add(t.name)
            absent.append(t)
    tested = release is not None and any(release_tuple(r) == version for r in table.releases)
    return TableSelection(str(path), release, tested, chosen, absent)


def load_target_file(name_or_path: str | Path) -> list[Target]:
    return select_table(name_or_path).targets


def load_targets(names_or_paths: Iterable[str]) -> list[Target]:
    """All targets of several tables; a name used in two tables is an error."""
    targets: list[Target] = []
    for item in names_or_paths:
        targets.extend(load_target_file(item))
    seen: dict[str, str] = {}
    for t in targets:
        if t.name in seen:
            raise TargetFileError(f"{t.where}: target name {t.name!r} also defined at {seen[t.name]}")
        seen[t.name] = t.where
    return targets


# %% resolving


def _leading_params(obj: Any) -> tuple[list[str], str]:
    sig = inspect.signature(obj)
    return list(sig.parameters), str(sig)


def resolve(target: Target) -> Resolution:
    """Import the target's module (if needed), find the attribute through the
    class dictionaries (wrapt.resolve_path) and compare its leading parameters."""
    import wrapt

    try:
        importlib.import_module(target.module)
    except Exception as exc:  # ImportError, or anything the module raises at import
        return Resolution(target, "missing", f"module {target.module} cannot be imported: {type(exc).__name__}: {exc}")
    try:
        parent, attribute, original = wrapt.resolve_path(target.module, target.qualname)
    except Exception as exc:
        return Resolution(target, "missing", f"{target.qualname} not found in {target.module}: {exc}")
    try:
        names, signature = _leading_params(original)
    except (TypeError, ValueError) as exc:
        return Resolution(target, "signature_changed", f"no signature: {exc}", parent, attribute, original)
    expected = list(target.params)
    if names[: len(expected)] != expected:
        return Resolution(
            target, "signature_changed",
            f"expected leading parameters {expected}, found {names[: len(expected)]} in {signature}",
            parent, attribute, original, signature,
        )
    return Resolution(target, "resolved", "", parent, attribute, original, signature)


def load_factory(target: Target):
    """The wrapper factory named by ``hook`` ("package.module:factory")."""
    module_name, _, attr = target.hook.partition(":")
    return getattr(importlib.import_module(module_name), attr)
