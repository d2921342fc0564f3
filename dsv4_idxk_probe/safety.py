"""Fail-open boundary: the probe never raises into its host.

Every call from a hook into probe logic goes through `safe_invoke`, which
returns the fallback on any exception, logs the first failure of each call
site with its traceback (later ones only counted), and increments
``dsv4_idxk_probe_errors_total{component}`` when metrics are attached.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from typing import Any, Callable

log = logging.getLogger("dsv4_idxk_probe")

_lock = threading.Lock()
_errors: Counter = Counter()
_on_error: list[Callable[[str], None]] = []


def add_error_listener(listener: Callable[[str], None]) -> None:
    """Called with the site name on every caught failure (metrics attach here)."""
    _on_error.append(listener)


def remove_error_listener(listener: Callable[[str], None]) -> None:
    """Undo `add_error_listener` (a runtime that is closed stops counting)."""
    try:
        _on_error.remove(listener)
    except ValueError:
        pass


def error_counts() -> dict[str, int]:
    with _lock:
        return dict(_errors)


def record_error(site: str) -> None:
    """Count and log (once per site, with traceback) the exception being handled."""
    with _lock:
        _errors[site] += 1
        first = _errors[site] == 1
    if first:
        log.exception("dsv4-idxk-probe: failure in %s (serving continues; later failures here are only counted)", site)
    for listener in list(_on_error):
        try:
            listener(site)
        except Exception:
            pass


def safe_invoke(site: str, fn: Callable[..., Any], *args: Any, fallback: Any = None, **kwargs: Any) -> Any:
    """Run `fn`; on any exception record it against `site` and return `fallback`."""
    try:
        return fn(*args, **kwargs)
    except Exception:
        record_error(site)
        return fallback
