"""The ``hicache`` section of the probe config, validated once.

Keys (all optional; defaults in `HiCacheSettings`; ranges in `RANGES`, docs/configuration.md):

  enabled            bool   false: the host-pool wrappers call straight through
  guard              str    observe | block: what the token-path geometry guard does
  guard_stack_logs   int    stacks logged per pool by the guard (the count is always kept), 0-10,000
  index_checks       bool   page-group checks of the copy indices, on their device
  flush_interval_s   float  how often the flusher publishes counts and runs the index checks, 0.05-3600 s
  index_queue_max    int    page-path calls waiting for the index checks; more are dropped and counted, 1-1,000,000
  io_backends        list   io backends whose zero series are created per pool, 1-16 names of 1-64 characters
  roundtrip          bool   debugging mode: digest rows across backup and load (synchronises)
  roundtrip_max_entries int host-row digests kept in round-trip mode; the oldest are evicted, 0-100,000,000

A bad value raises `HiCacheConfigError` naming the field (``hicache.guard`` ...);
`.inf`, `.nan` and integers past a bound are refused without being converted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Mapping

from ..safeyaml import shorten

GUARD_ACTIONS = ("observe", "block")
KNOWN_IO_BACKENDS = ("kernel", "direct", "kernel_ascend")
#: Inclusive bounds of each numeric key. flush_interval_s: at least 0.05 s (20 flushes a
#: second; a flush takes the GIL and runs the index checks), at most an hour.
RANGES = {
    "guard_stack_logs": (0, 10_000),
    "flush_interval_s": (0.05, 3600.0),
    "index_queue_max": (1, 1_000_000),
    "roundtrip_max_entries": (0, 100_000_000),  # ~200 B each: up to ~20 GB of host memory
}
MAX_IO_BACKENDS = 16
MAX_IO_BACKEND_CHARS = 64


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
        raise HiCacheConfigError(f"hicache.{name} must be true or false, got {shorten(value)}")
    return value


def _int(name: str, value: Any) -> int:
    minimum, maximum = RANGES[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise HiCacheConfigError(f"hicache.{name} must be an integer >= {minimum}, got {shorten(value)}")
    if value > maximum:  # compared, never converted: a huge integer costs nothing
        raise HiCacheConfigError(f"hicache.{name} must be an integer <= {maximum:_}, got {shorten(value)}")
    return value


def _seconds(name: str, value: Any) -> float:
    minimum, maximum = RANGES[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise HiCacheConfigError(f"hicache.{name} must be a number > 0, got {shorten(value)}")
    if not minimum <= value <= maximum or (isinstance(value, float) and not math.isfinite(value)):
        raise HiCacheConfigError(f"hicache.{name} must be a number of seconds in [{minimum}, {maximum:g}], "
                                 f"got {shorten(value)}")
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
        raise HiCacheConfigError(f"hicache has unknown key(s) {shorten(unknown, 200)}; known: {sorted(known)}")
    values: dict[str, Any] = {}
    for key, value in section.items():
        if key in ("enabled", "index_checks", "roundtrip"):
            values[key] = _bool(key, value)
        elif key == "guard":
            if value not in GUARD_ACTIONS:
                raise HiCacheConfigError(f"hicache.guard must be one of {list(GUARD_ACTIONS)}, got {shorten(value)}")
            values[key] = value
        elif key == "flush_interval_s":
            values[key] = _seconds(key, value)
        elif key in ("guard_stack_logs", "roundtrip_max_entries", "index_queue_max"):
            values[key] = _int(key, value)
        elif key == "io_backends":
            if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value:
                raise HiCacheConfigError(f"hicache.io_backends must be a non-empty list, got {shorten(value)}")
            if len(value) > MAX_IO_BACKENDS:  # each name is a metric series per pool
                raise HiCacheConfigError(f"hicache.io_backends must list at most {MAX_IO_BACKENDS} backends, "
                                         f"got {len(value):,}")
            for i, item in enumerate(value):
                if not isinstance(item, str) or not item or len(item) > MAX_IO_BACKEND_CHARS:
                    raise HiCacheConfigError(f"hicache.io_backends[{i}] must be a string of 1-{MAX_IO_BACKEND_CHARS} "
                                             f"characters, got {shorten(item)}")
            values[key] = tuple(dict.fromkeys(value))
    return HiCacheSettings(**values)


def settings_from_config(config: Any) -> HiCacheSettings:
    """Read ``config.hicache`` (attribute or mapping key); absent means defaults."""
    if config is None:
        return HiCacheSettings()
    section = config.get("hicache") if isinstance(config, Mapping) else getattr(config, "hicache", None)
    return parse_settings(section)
