"""The ``hicache`` section of the probe config, validated once.

Keys (all optional; defaults and types in `HiCacheSettings`; ranges in `RANGES`, docs/configuration.md):

  enabled            bool   false: the host-pool wrappers call straight through
  guard              str    observe | block: what the token-path geometry guard does
  guard_stack_logs   int    stacks logged per pool by the guard (the count is always kept), 0-10,000
  index_checks       bool   page-group checks of the copy indices, on their device
  flush_interval_s   float  how often the flusher publishes counts and runs the index checks, 0.05-3600 s
  index_queue_max    int    page-path calls waiting for the index checks; more are dropped and counted, 1-1,000,000
  io_backends        list   io backends whose zero series are created per pool, 1-16 names of 1-64 characters
  roundtrip          bool   debugging mode: digest rows across backup and load (synchronises)
  roundtrip_max_entries int host-row digests kept in round-trip mode; the oldest are evicted, 0-100,000,000
  restore_verify     bool   digest index-K pages at backup, compare after each load (on by default; no sync)
  restore_max_pages  int    host pages whose backup digests are kept; the oldest are evicted and counted, 1-100,000,000
  restore_queue_max  int    restore digests waiting for the collector per pool; more are counted unverified, 1-1,000,000
  restore_defer_ms   float  how long a restore collector waits for the copying thread to go quiet before its work, 0-1000 ms
  restore_record     str    collector | copy: where a restore digest's event is recorded (copy: forks that copy on the forward's stream)

`HiCacheSettings` is a msgspec Struct (the schema: unknown keys refused, bounds in its
types); a bad value raises `HiCacheConfigError` naming the field (``hicache.guard`` ...,
`dsv4_idxk_probe.schema`); `.inf`, `.nan` and integers past a bound are refused without
being converted. The probe config validates this section with the same Struct.
"""

from typing import Annotated, Any, Literal, Mapping, get_args

import msgspec

from ..schema import convert, integer, milliseconds, seconds

Guard = Literal["observe", "block"]
#: Where a restore digest's event is recorded: "collector" (on the copy's stream when the
#: collector takes the digest, after its deferral: no device call more on the copying
#: thread; right where copies run on streams of their own, as in every SGLang release) or
#: "copy" (on the copying thread, right behind the launch: for a fork that copies on the
#: forward's stream, where an event recorded later lands behind the next forward).
RestoreRecord = Literal["collector", "copy"]
RESTORE_RECORDS = get_args(RestoreRecord)
KNOWN_IO_BACKENDS = ("kernel", "direct", "kernel_ascend")
#: Inclusive bounds of each numeric key. flush_interval_s: at least 0.05 s (20 flushes a
#: second; a flush takes the GIL and runs the index checks), at most an hour.
RANGES = {
    "guard_stack_logs": (0, 10_000),
    "flush_interval_s": (0.05, 3600.0),
    "index_queue_max": (1, 1_000_000),
    "roundtrip_max_entries": (0, 100_000_000),  # ~200 B each: up to ~20 GB of host memory
    # per page: 8 B x layers x segments + ~250 B (docs/hicache.md, "Restore verification")
    "restore_max_pages": (1, 100_000_000),  # 0 would keep none and still count backups verified
    "restore_queue_max": (1, 1_000_000),
    "restore_defer_ms": (0.0, 1000.0),
}
MAX_IO_BACKENDS = 16
MAX_IO_BACKEND_CHARS = 64
#: Each name is a metric series per pool: a few short names.
IoBackends = Annotated[
    tuple[Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_IO_BACKEND_CHARS)], ...],
    msgspec.Meta(min_length=1, max_length=MAX_IO_BACKENDS, extra={"items": "backends"}),
]


class HiCacheConfigError(ValueError):
    """A ``hicache`` config value that cannot be used; the message names the field."""


class HiCacheSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    enabled: bool = True
    guard: Guard = "observe"
    guard_stack_logs: integer(*RANGES["guard_stack_logs"]) = 5
    index_checks: bool = True
    flush_interval_s: seconds(RANGES["flush_interval_s"][1], low=RANGES["flush_interval_s"][0]) = 5.0
    index_queue_max: integer(*RANGES["index_queue_max"]) = 4096
    io_backends: IoBackends = KNOWN_IO_BACKENDS
    roundtrip: bool = False
    roundtrip_max_entries: integer(*RANGES["roundtrip_max_entries"]) = 1_000_000
    restore_verify: bool = True
    restore_max_pages: integer(*RANGES["restore_max_pages"]) = 262_144
    restore_queue_max: integer(*RANGES["restore_queue_max"]) = 1024
    restore_defer_ms: milliseconds(RANGES["restore_defer_ms"][1], low=RANGES["restore_defer_ms"][0]) = 3.0
    restore_record: RestoreRecord = "collector"

    def __post_init__(self):
        if len(set(self.io_backends)) != len(self.io_backends):  # one series set per name
            msgspec.structs.force_setattr(self, "io_backends", tuple(dict.fromkeys(self.io_backends)))


def parse_settings(section: Mapping[str, Any] | None) -> HiCacheSettings:
    """Build settings from the ``hicache`` mapping (None or {} gives the defaults)."""
    if section is None:
        return HiCacheSettings()
    return convert(section, HiCacheSettings, HiCacheConfigError, prefix=("hicache",))


def settings_from_config(config: Any) -> HiCacheSettings:
    """Read ``config.hicache`` (attribute or mapping key); absent means defaults."""
    if config is None:
        return HiCacheSettings()
    section = config.get("hicache") if isinstance(config, Mapping) else getattr(config, "hicache", None)
    return parse_settings(section)
