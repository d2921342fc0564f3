"""The ``hicache`` section of the probe config, validated once.

Keys (all optional; defaults in `HiCacheSettings`):

  enabled            bool   false: the host-pool wrappers call straight through
  guard              str    observe | block: what the token-path geometry guard does
  guard_stack_logs   int    stacks logged per pool by the guard (the count is always kept)
  index_checks       bool   page-group checks of the copy indices, on their device
  flush_interval_s   float  how often the flusher publishes counts and runs the index checks
  index_queue_max    int    page-path calls waiting for the index checks; more are dropped and counted
  io_backends        list   io backends whose zero series are created per pool
  roundtrip          bool   debugging mode: digest rows across backup and load (synchronises)
  roundtrip_max_entries int host-row digests kept in round-trip mode; the oldest are evicted

A bad value raises `HiCacheConfigError` naming the field (``hicache.guard`` ...).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

GUARD_ACTIONS = ("observe", "block")
KNOWN_IO_BACKENDS = ("kernel", "direct", "kernel_ascend")


class HiCacheConfigError(ValueError):
    """A ``hicache`` config value that cannot be used; the message names the field."""


@dataclass(frozen=True)
class HiCacheSettings:
    enabled: bool = True
    guard: str = "observe"
    guard_stack_logs: int = 5
    index_checks: bool = True
    flush_interval_s: float = 5.0
    index_queue_max: int = 4096
    io_backends: tuple[str, ...] = KNOWN_IO_BACKENDS
    roundtrip: bool = False
    roundtrip_max_entries: int = 1_000_000


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise HiCacheConfigError(f"hicache.{name} must be true or false, got {value!r}")
    return value


def _int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise HiCacheConfigError(f"hicache.{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _positive_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise HiCacheConfigError(f"hicache.{name} must be a number > 0, got {value!r}")
    return float(value)


def parse_settings(section: Mapping[str, Any] | None) -> HiCacheSettings:
    """Build settings from the ``hicache`` mapping (None or {} gives the defaults)."""
    if section is None:
        return HiCacheSettings()
    if not isinstance(section, Mapping):
        raise HiCacheConfigError(f"hicache must be a mapping, got {type(section).__name__}")
    known = {f.name for f in fields(HiCacheSettings)}
    unknown = sorted(set(section) - known)
    if unknown:
        raise HiCacheConfigError(f"hicache has unknown key(s) {unknown}; known: {sorted(known)}")
    values: dict[str, Any] = {}
    for key, value in section.items():
        if key in ("enabled", "index_checks", "roundtrip"):
            values[key] = _bool(key, value)
        elif key == "guard":
            if value not in GUARD_ACTIONS:
                raise HiCacheConfigError(f"hicache.guard must be one of {list(GUARD_ACTIONS)}, got {value!r}")
            values[key] = value
        elif key == "flush_interval_s":
            values[key] = _positive_float(key, value)
        elif key in ("guard_stack_logs", "roundtrip_max_entries"):
            values[key] = _int(key, value, 0)
        elif key == "index_queue_max":
            values[key] = _int(key, value, 1)
        elif key == "io_backends":
            if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value:
                raise HiCacheConfigError(f"hicache.io_backends must be a non-empty list, got {value!r}")
            for i, item in enumerate(value):
                if not isinstance(item, str) or not item:
                    raise HiCacheConfigError(f"hicache.io_backends[{i}] must be a non-empty string, got {item!r}")
            values[key] = tuple(dict.fromkeys(value))
    return HiCacheSettings(**values)


def settings_from_config(config: Any) -> HiCacheSettings:
    """Read ``config.hicache`` (attribute or mapping key); absent means defaults."""
    if config is None:
        return HiCacheSettings()
    section = config.get("hicache") if isinstance(config, Mapping) else getattr(config, "hicache", None)
    return parse_settings(section)
