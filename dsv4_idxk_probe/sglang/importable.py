"""Whether SGLang can be imported here at all, told apart from a target module a release lacks.

`check` imports the modules its target table names before resolving them. A module the
installed release does not have (``ModuleNotFoundError`` naming that module or a parent
inside it) is the table's business: that target is "missing". Anything else (no ``sglang``
at all, a dependency of SGLang absent, an error raised while SGLang's modules run) means
this is not a working serving image, and one sentence says so instead of every target
reading "missing" with the same traceback. SGLang's import-time warnings (CPU-only
quantisation notices and the like) are not shown: they are not the operator's question.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Iterable


def import_target_modules(modules: Iterable[str]) -> str | None:
    """Import `sglang` and then each module; None when SGLang is importable, else the reason."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reason = _import("sglang")
        if reason is not None:
            return reason
        for module in dict.fromkeys(modules):
            reason = _import(module)
            if reason is not None:
                return f"{reason} (while importing {module})"
    return None


def _import(module: str) -> str | None:
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name != "sglang" and (module == exc.name or module.startswith(exc.name + ".")):
            return None  # this release has no such module: the target reads "missing"
        return f"{type(exc).__name__}: {exc}"
    except BaseException as exc:  # SystemExit or anything else a module raises at import
        if isinstance(exc, KeyboardInterrupt):
            raise
        return f"{type(exc).__name__}: {exc}"
    return None
