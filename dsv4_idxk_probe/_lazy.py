"""Package exports loaded on first use (PEP 562), so light tools skip torch."""

from __future__ import annotations

from importlib import import_module
from typing import Any, Callable, Mapping


def lazy_exports(package: str, exports: Mapping[str, str], namespace: dict) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports `exports[name]` (a relative module) on first access."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(exports[name], package), name)
        namespace[name] = value
        return value

    return __getattr__
