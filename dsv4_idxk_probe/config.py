"""The probe's configuration: one schema, read from YAML and the environment,
validated once.

`load_config()` is what activation calls: it reads ``DSV4_IDXK_PROBE`` (the
mode), ``DSV4_IDXK_PROBE_CONFIG`` (an optional YAML file) and
``DSV4_IDXK_PROBE_TARGETS``, and returns a frozen `ProbeConfig` or raises
`ConfigError` whose message names the file and the field
(``probe.yaml: exchange.timeout_ms must be an integer >= 1, got 'fast'``).
The keys are documented in docs/configuration.md; an unknown key is an error,
so a typo never silently falls back to a default.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping

from . import environment_variables as ev
from .boundedfile import read_bounded_text
from .safeyaml import load as load_yaml
from .safeyaml import shorten

MODES = ("observe", "enforce")
DEFAULT_TARGETS = ("sglang",)  # the installed release's entries of configs/targets/sglang.yaml
MAX_CONFIG_BYTES = 1 << 20  # a probe config is a few hundred bytes; a bigger file is a mistake
#: Path of the exchange's shared secret; overrides ``exchange.secret_file`` (docs/security.md).
EXCHANGE_SECRET_FILE_ENV = "DSV4_IDXK_PROBE_EXCHANGE_SECRET_FILE"


class ConfigError(ValueError):
    """A config value that cannot be used; the message names the file and field."""


@dataclass(frozen=True)
class ExchangeConfig:
    """Prefill serves per-room digest vectors; decode asks for them."""

    enabled: bool = True
    bind: str = "auto"  # "auto": the address SGLang's KV manager reports to decode
    port_base: int = 0  # 0: a port the OS picks; else port_base + the scheduler's GPU id
    timeout_ms: int = 200
    fetch_always: bool = False
    table_size: int = 4096
    max_request_bytes: int = 4096
    backoff_s: float = 5.0  # the longest a peer that keeps failing is skipped
    backoff_initial_s: float = 0.25  # after its first failure; doubled with each further one in a row
    retry_s: float = 1.0  # decode's collector asks again, after the backoff, for this long (0: never)
    secret_file: str | None = None  # shared by prefill and decode; none: the server stays on loopback
    max_connections: int = 64  # sessions per prefill server (+ 16 unauthenticated, 8 per address; docs/security.md)
    idle_s: float = 60.0  # an authenticated peer silent this long is dropped (it reconnects when it asks)


@dataclass(frozen=True)
class RoomLogConfig:
    dir: str = "probe-logs"
    max_bytes: int = 64 << 20
    max_files: int = 8
    gzip: bool = True
    queue_size: int = 10_000
    cluster: str = ""  # written in every room record and joined on by `diff` (docs/roomlog.md); "": none


@dataclass(frozen=True)
class DigestConfig:
    """How the background collector learns that a batch's digest kernel is done."""

    collector_wait: str = "block"  # "block": sleep in the driver until done; "poll": query, sleeping between
    outputs: str = "device"  # where the kernel stores: "device" (copied down) or "pinned" (no copies; engine.OUTPUTS)
    dependent_launch: str = "auto"  # "auto": programmatic dependent launches where the GPU has them; "off"


@dataclass(frozen=True)
class MetricsConfig:
    port: int | None = None  # our own exporter, only outside SGLang (it serves /metrics itself)
    addr: str = "127.0.0.1"  # where that exporter listens; a wildcard or routable address is logged at WARNING


@dataclass(frozen=True)
class DiagnosisConfig:
    """What a mismatch's bad cells became, and the page events behind them (docs/diagnosis.md)."""

    enabled: bool = True  # serving cost measured within 1% on both serving legs (docs/diagnosis.md)
    journal_events: int = 16384  # page events kept per process (the oldest go first)
    journal_per_page: int = 8  # events shown per bad cell
    index_cells: int = 4_000_000  # content digests kept on decode (8 bytes each)
    max_cells_per_room: int = 64  # bad cells diagnosed per room record
    snapshot_on_allocation: bool = True  # digest a room's pages when decode allocates them (one launch)


@dataclass(frozen=True)
class ProbeConfig:
    mode: str = "observe"
    layout: str = "auto"
    layouts: str | None = None  # extra layouts file (resolved path)
    step_interval: int = 64
    targets: tuple[str, ...] = DEFAULT_TARGETS
    exchange: ExchangeConfig = field(default_factory=ExchangeConfig)
    roomlog: RoomLogConfig = field(default_factory=RoomLogConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    digest: DigestConfig = field(default_factory=DigestConfig)
    diagnosis: DiagnosisConfig = field(default_factory=DiagnosisConfig)
    hicache: Mapping[str, Any] = field(default_factory=dict)  # owned by dsv4_idxk_probe.hicache
    source: str = "<defaults>"

    @property
    def enforce(self) -> bool:
        return self.mode == "enforce"


# %% field checks


def _int(source, where, value, minimum, maximum):
    """An integer in [minimum, maximum]; compared, never converted, so a huge one costs nothing."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{source}: {where} must be an integer >= {minimum}, got {shorten(value)}")
    if value > maximum:
        shown = f"{value:_}" if value.bit_length() <= 256 else shorten(value)
        raise ConfigError(f"{source}: {where} must be an integer <= {maximum:_}, got {shown}")
    return value


def _bounded(minimum, maximum):
    return lambda source, where, value: _int(source, where, value, minimum, maximum)


def _port(source, where, value):
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value > 65535:
        raise ConfigError(f"{source}: {where} must be a port number (0-65535), got {shorten(value)}")
    return _int(source, where, value, 0, 65535)


def _bool(source, where, value):
    if not isinstance(value, bool):
        raise ConfigError(f"{source}: {where} must be true or false, got {shorten(value)}")
    return value


def _str(source, where, value):
    if not isinstance(value, str):
        raise ConfigError(f"{source}: {where} must be a string, got {shorten(value)}")
    if len(value) > 4096 or "\x00" in value:
        raise ConfigError(f"{source}: {where} must be a string of at most 4096 characters without NUL")
    return value


def _cluster(source, where, value):
    """A cluster label: a short printable name (the diff joins on it and prints it)."""
    if len(value) > 128 or not value.isprintable():
        raise ConfigError(f"{source}: {where} must be a printable name of at most 128 characters, got {shorten(value)}")
    return value


def _optional_str(source, where, value):
    return None if value is None else _str(source, where, value)


def _choice(*allowed):
    def check(source, where, value):
        if value not in allowed:
            raise ConfigError(f"{source}: {where} must be one of {list(allowed)}, got {shorten(value)}")
        return value

    return check


def _seconds(maximum, zero_ok=False):
    """A finite number of seconds in (0, maximum] ([0, maximum] with `zero_ok`); an integer is
    compared before it is converted, so ``10**400`` is refused, not an OverflowError."""
    def check(source, where, value):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value >= 0 if zero_ok else value > 0):
            raise ConfigError(f"{source}: {where} must be a number {'>=' if zero_ok else '>'} 0, got {shorten(value)}")
        if value > maximum or (isinstance(value, float) and not math.isfinite(value)):
            raise ConfigError(f"{source}: {where} must be a number of seconds <= {maximum}, got {shorten(value)}")
        return float(value)

    return check


_CHECKS = {
    "exchange": {
        "enabled": _bool,
        "bind": _str,
        "port_base": lambda s, w, v: _port(s, w, v) or 0,
        "timeout_ms": _bounded(1, 60_000),
        "fetch_always": _bool,
        "table_size": _bounded(1, 1_000_000),
        "max_request_bytes": _bounded(64, 1 << 20),
        "backoff_s": _seconds(3600),
        "backoff_initial_s": _seconds(3600),
        "retry_s": _seconds(60, zero_ok=True),
        "secret_file": _optional_str,
        "max_connections": _bounded(1, 4096),
        "idle_s": _seconds(86_400),
    },
    "roomlog": {
        "dir": _str,
        "max_bytes": _bounded(1024, 1 << 36),
        "max_files": _bounded(1, 10_000),
        "gzip": _bool,
        "queue_size": _bounded(1, 1_000_000),
        "cluster": lambda s, w, v: _cluster(s, w, _str(s, w, v)),
    },
    "metrics": {"port": _port, "addr": _str},
    # digest.engine.WAITS, OUTPUTS and DEPENDENT_LAUNCHES (a test keeps them equal)
    "digest": {"collector_wait": _choice("block", "poll"), "outputs": _choice("device", "pinned"),
               "dependent_launch": _choice("auto", "off")},
    "diagnosis": {
        "enabled": _bool,
        "journal_events": _bounded(1, 10_000_000),
        "journal_per_page": _bounded(1, 64),
        "index_cells": _bounded(1, 1_000_000_000),
        "max_cells_per_room": _bounded(1, 100_000),
        "snapshot_on_allocation": _bool,
    },
}
_SECTION_TYPES = {"exchange": ExchangeConfig, "roomlog": RoomLogConfig, "metrics": MetricsConfig, "digest": DigestConfig,
                  "diagnosis": DiagnosisConfig}
_TOP_KEYS = {"mode", "layout", "layouts", "step_interval", "targets", "hicache", *_SECTION_TYPES}


def _section(source: str, name: str, value: Any):
    cls = _SECTION_TYPES[name]
    if value is None:
        return cls()
    if not isinstance(value, Mapping):
        raise ConfigError(f"{source}: {name} must be a mapping, got {type(value).__name__}")
    checks = _CHECKS[name]
    _string_keys(source, name, value)
    unknown = sorted(set(value) - set(checks))
    if unknown:
        raise ConfigError(f"{source}: {name} has unknown key(s) {shorten(unknown, 200)}; known: {sorted(checks)}")
    return cls(**{key: checks[key](source, f"{name}.{key}", v) for key, v in value.items()})


def _string_keys(source: str, where: str, mapping: Mapping) -> None:
    odd = [k for k in mapping if not isinstance(k, str)]
    if odd:
        raise ConfigError(f"{source}: {where} keys must be strings, got {shorten(odd[0])}")


def _resolve_path(base: Path | None, value: str) -> str:
    path = Path(value).expanduser()
    if not path.is_absolute() and base is not None:
        path = base / path
    return str(path)


def _hicache(source: str, value: Any) -> dict:
    """Pass the section through, validated by its owner when it is installed."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{source}: hicache must be a mapping, got {type(value).__name__}")
    _string_keys(source, "hicache", value)
    try:
        from .hicache.settings import HiCacheConfigError, parse_settings
    except ImportError:  # the HiCache checks are not part of this build
        return dict(value)
    try:
        parse_settings(value)
    except HiCacheConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    return dict(value)


def parse_config(document: Any, source: str = "<config>", base_dir: Path | None = None) -> ProbeConfig:
    """Build a `ProbeConfig` from a parsed YAML document (None: all defaults).

    Relative paths (``layouts``, ``roomlog.dir``) are resolved against
    `base_dir`, the config file's folder.
    """
    if document is None:
        document = {}
    if not isinstance(document, Mapping):
        raise ConfigError(f"{source}: the top level must be a mapping of keys, got {type(document).__name__}")
    _string_keys(source, "the top level", document)
    unknown = sorted(set(document) - _TOP_KEYS)
    if unknown:
        raise ConfigError(f"{source}: unknown key(s) {shorten(unknown, 200)}; known: {sorted(_TOP_KEYS)}")
    values: dict[str, Any] = {"source": source}
    if "mode" in document:
        values["mode"] = _choice(*MODES)(source, "mode", document["mode"])
    if "layout" in document:
        values["layout"] = _str(source, "layout", document["layout"])
    if document.get("layouts") is not None:
        values["layouts"] = _resolve_path(base_dir, _str(source, "layouts", document["layouts"]))
    if "step_interval" in document:
        values["step_interval"] = _int(source, "step_interval", document["step_interval"], 0, 1_000_000)
    if "targets" in document:
        targets = document["targets"]
        if isinstance(targets, str):
            targets = [targets]
        if (not isinstance(targets, list) or not targets or len(targets) > 64
                or not all(isinstance(t, str) and t and len(t) <= 4096 and "\x00" not in t for t in targets)):
            raise ConfigError(f"{source}: targets must be a non-empty list of file names or paths, "
                              f"got {shorten(targets)}")
        values["targets"] = tuple(t if "/" not in t and not t.endswith(".yaml") else _resolve_path(base_dir, t) for t in targets)
    for name in _SECTION_TYPES:
        if name in document:
            values[name] = _section(source, name, document[name])
    if "roomlog" in values and base_dir is not None:
        values["roomlog"] = replace(values["roomlog"], dir=_resolve_path(base_dir, values["roomlog"].dir))
    if "exchange" in values and values["exchange"].secret_file:
        values["exchange"] = replace(
            values["exchange"], secret_file=_resolve_path(base_dir, values["exchange"].secret_file)
        )
    if "hicache" in document:
        values["hicache"] = _hicache(source, document["hicache"])
    config = ProbeConfig(**values)
    if config.layouts is not None:
        _check_layouts(config)
    return config


def _check_layouts(config: ProbeConfig) -> None:
    from .digest.layout import LayoutError, load_layouts

    try:
        load_layouts(config.layouts)
    except LayoutError as exc:
        raise ConfigError(f"{config.source}: layouts: {exc}") from None


def read_small_text(path: str | os.PathLike, what: str, max_bytes: int = MAX_CONFIG_BYTES) -> str:
    """A regular file's text, UTF-8, size-capped before it is read (`boundedfile`);
    every problem is a `ConfigError` naming the file."""
    return read_bounded_text(path, what, max_bytes, ConfigError)


def load_file(path: str | os.PathLike) -> ProbeConfig:
    """Read and validate one YAML config file."""
    path = Path(path)
    text = read_small_text(path, "config file")
    document = load_yaml(text, str(path), ConfigError)  # no aliases, bounded nodes and depth, no duplicate keys
    return parse_config(document, str(path), path.parent)


def _check_secret(config: ProbeConfig) -> None:
    """A configured secret must be readable now: a typo must not leave the exchange open or off silently."""
    if not config.exchange.secret_file:
        return
    from .exchange.auth import SecretError, load_secret

    try:
        load_secret(config.exchange.secret_file)
    except SecretError as exc:
        raise ConfigError(f"{config.source}: exchange.secret_file: {exc}") from None


def load_config(env: Mapping[str, str] | None = None) -> ProbeConfig:
    """The config this process runs with, from the environment (see module doc).

    Raises ConfigError; never returns a half-validated config.
    """
    env = os.environ if env is None else env
    try:
        requested = ev.requested_mode(env.get(ev.DSV4_IDXK_PROBE))
    except ValueError as exc:
        raise ConfigError(f"environment: {exc}") from None
    path = env.get(ev.DSV4_IDXK_PROBE_CONFIG, "").strip()
    config = load_file(path) if path else ProbeConfig(source="<defaults>")
    if requested in MODES:
        config = replace(config, mode=requested)
    targets = env.get(ev.DSV4_IDXK_PROBE_TARGETS, "").strip()
    if targets:
        config = replace(config, targets=tuple(t.strip() for t in targets.split(",") if t.strip()))
    secret_file = env.get(EXCHANGE_SECRET_FILE_ENV, "").strip()
    if secret_file:
        config = replace(config, exchange=replace(config.exchange, secret_file=secret_file))
    _check_secret(config)
    if config.enforce and env.get(ev.DSV4_IDXK_PROBE_FAULTS, "").strip():
        raise ConfigError(
            f"environment: {ev.DSV4_IDXK_PROBE_FAULTS} (fault injection) cannot be combined with enforce mode"
        )
    return config


def as_dict(config: ProbeConfig) -> dict[str, Any]:
    """Plain form for logs and `check` (sections as mappings)."""
    out: dict[str, Any] = {}
    for f in fields(config):
        value = getattr(config, f.name)
        if f.name in _SECTION_TYPES:
            value = {g.name: getattr(value, g.name) for g in fields(value)}
        elif isinstance(value, tuple):
            value = list(value)
        elif isinstance(value, Mapping):
            value = dict(value)
        out[f.name] = value
    return out
