"""Patch targets as data: load a target table, resolve each entry against the
installed SGLang, check its signature.

A table (``configs/targets/*.yaml``, format in its header comment) lists
``module``, ``qualname``, the leading ``params`` the hook relies on, the hook
``kind``, the wrapper factory (``hook``), ``required`` and ``role``. A bad
table raises `TargetFileError` naming the file, line and field. Resolution
never raises: a target whose module or attribute is missing, or whose
parameters changed, comes back with that status and a reason, and the caller
skips it while the others work.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Iterable

import yaml

KINDS = ("before", "after", "around")
ROLES = ("prefill", "decode", "any")
#: Every status a target can be reported with (metric label values).
STATUSES = ("patched", "pending", "missing", "signature_changed", "hook_error", "not_applied")
_FIELDS = {"name", "module", "qualname", "params", "kind", "hook", "required", "role"}
_LINE = "__line__"


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


class _LineLoader(yaml.SafeLoader):
    """SafeLoader that remembers the line of every mapping."""

    def construct_mapping(self, node, deep=False):
        mapping = super().construct_mapping(node, deep=deep)
        mapping[_LINE] = node.start_mark.line + 1
        return mapping


def shipped_target_path(name: str) -> Path:
    """Path of a shipped table by name (``sglang-0.5.23``)."""
    return Path(str(resources.files("dsv4_idxk_probe").joinpath("configs", "targets", f"{name}.yaml")))


def target_file_path(name_or_path: str) -> Path:
    if "/" in name_or_path or name_or_path.endswith(".yaml"):
        return Path(name_or_path)
    return shipped_target_path(name_or_path)


def _entry(source: str, index: int, raw: Any) -> Target:
    if not isinstance(raw, dict):
        raise TargetFileError(f"{source}: targets[{index}] must be a mapping, got {type(raw).__name__}")
    where = f"{source}:{raw.get(_LINE, '?')}"
    raw = {k: v for k, v in raw.items() if k != _LINE}
    label = f"targets[{index}]" + (f" ({raw['name']})" if isinstance(raw.get("name"), str) else "")
    unknown = sorted(set(raw) - _FIELDS)
    if unknown:
        raise TargetFileError(f"{where}: {label} has unknown field(s) {unknown}; known: {sorted(_FIELDS)}")
    for key in ("name", "module", "qualname", "kind", "hook", "role"):
        if not isinstance(raw.get(key), str) or not raw[key]:
            raise TargetFileError(f"{where}: {label}.{key} must be a non-empty string, got {raw.get(key)!r}")
    if raw["kind"] not in KINDS:
        raise TargetFileError(f"{where}: {label}.kind must be one of {list(KINDS)}, got {raw['kind']!r}")
    if raw["role"] not in ROLES:
        raise TargetFileError(f"{where}: {label}.role must be one of {list(ROLES)}, got {raw['role']!r}")
    if raw["hook"].count(":") != 1:
        raise TargetFileError(f"{where}: {label}.hook must be 'package.module:factory', got {raw['hook']!r}")
    params = raw.get("params", [])
    if not isinstance(params, list) or not all(isinstance(p, str) and p for p in params):
        raise TargetFileError(f"{where}: {label}.params must be a list of parameter names, got {params!r}")
    if not isinstance(raw.get("required"), bool):
        raise TargetFileError(f"{where}: {label}.required must be true or false, got {raw.get('required')!r}")
    return Target(
        raw["name"], raw["module"], raw["qualname"], tuple(params), raw["kind"], raw["hook"],
        raw["required"], raw["role"], where,
    )


def parse_target_table(text: str, source: str) -> list[Target]:
    try:
        document = yaml.load(text, Loader=_LineLoader)
    except yaml.YAMLError as exc:
        raise TargetFileError(f"{source}: not valid YAML: {exc}") from None
    if not isinstance(document, dict) or "targets" not in document:
        raise TargetFileError(f"{source}: the top level must be a mapping with a 'targets' list")
    entries = document["targets"] or []
    if not isinstance(entries, list):
        raise TargetFileError(f"{source}:{document.get(_LINE, '?')}: targets must be a list")
    targets = [_entry(source, i, raw) for i, raw in enumerate(entries)]
    seen: dict[str, str] = {}
    for t in targets:
        if t.name in seen:
            raise TargetFileError(f"{t.where}: target name {t.name!r} is used twice (first at {seen[t.name]})")
        seen[t.name] = t.where
    return targets


def load_target_file(name_or_path: str | Path) -> list[Target]:
    path = target_file_path(str(name_or_path))
    try:
        text = path.read_text()
    except OSError as exc:
        raise TargetFileError(f"{path}: cannot read target file: {exc.strerror or exc}") from None
    return parse_target_table(text, str(path))


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
