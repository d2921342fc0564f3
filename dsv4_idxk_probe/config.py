"""The probe's configuration: one schema, read from YAML and the environment,
validated once.

`load_config()` is what activation calls: it reads ``DSV4_IDXK_PROBE`` (the
mode), ``DSV4_IDXK_PROBE_CONFIG`` (an optional YAML file) and
``DSV4_IDXK_PROBE_TARGETS``, and returns a frozen `ProbeConfig` or raises
`ConfigError` whose message names the file, the line and the field
(``probe.yaml:2: exchange.timeout_ms must be an integer >= 1, got 'fast'``).

The schema is the msgspec Structs below, one per section (`ConfigFile` is the
file's top level, the ``hicache`` section is `hicache.settings.HiCacheSettings`):
unknown keys are refused (``forbid_unknown_fields``), so a typo never silently
falls back to a default; every number has its bounds in ``msgspec.Meta``; choices
are ``Literal``. `dsv4_idxk_probe.schema` runs ``msgspec.convert`` on what the safe
YAML loader built and words its refusals. The keys are documented in
docs/configuration.md.
"""

import os
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping, Optional, Union, get_args

import msgspec
from msgspec import Meta, Struct, field
from msgspec.structs import force_setattr, replace

from . import environment_variables as ev
from .boundedfile import read_bounded_text
from .hicache.settings import HiCacheSettings
from .safeyaml import load as load_yaml, shorten
from .schema import NO_NUL, Invalid, convert, integer, milliseconds, seconds, text

Mode = Literal["observe", "enforce"]
MODES = get_args(Mode)
DEFAULT_TARGETS = ("sglang",)  # the installed release's entries of configs/targets/sglang.yaml
MAX_CONFIG_BYTES = 1 << 20  # a probe config is a few hundred bytes; a bigger file is a mistake
#: Path of the exchange's shared secret; overrides ``exchange.secret_file`` (docs/security.md).
EXCHANGE_SECRET_FILE_ENV = "DSV4_IDXK_PROBE_EXCHANGE_SECRET_FILE"

Port = integer(0, 65535, kind="port")
CLUSTER_MEANS = "a printable name of at most 128 characters"
TargetName = Annotated[str, Meta(min_length=1, max_length=4096, pattern=NO_NUL)]
Targets = Annotated[Union[TargetName, Annotated[tuple[TargetName, ...], Meta(min_length=1, max_length=64)]],
                    Meta(extra={"means": "a non-empty list of file names or paths"})]


class ConfigError(ValueError):
    """A config value that cannot be used; the message names the file, the line (when known) and the field."""


class ExchangeConfig(Struct, frozen=True, forbid_unknown_fields=True):
    """Prefill serves per-room digest vectors; decode asks for them."""

    enabled: bool = True
    bind: text() = "auto"  # "auto": the address SGLang's KV manager reports to decode
    port_base: Optional[Port] = 0  # 0 (or null): a port the OS picks; else port_base + the scheduler's GPU id
    # 0: off; else the exchange listens on SGLang's KV manager port (the rank_port decode's bootstrap
    # reports) + port_offset, so decode can rebuild any prefill rank's endpoint (docs/pd.md, "Endpoint")
    port_offset: integer(-65535, 65535) = 0
    timeout_ms: integer(1, 60_000) = 200
    fetch_always: bool = False
    table_size: integer(1, 1_000_000) = 4096
    max_request_bytes: integer(64, 1 << 20) = 4096
    backoff_s: seconds(3600) = 5.0  # the longest a peer that keeps failing is skipped
    backoff_initial_s: seconds(3600) = 0.25  # after its first failure; doubled with each further one in a row
    retry_s: seconds(60, low=0) = 1.0  # decode's collector asks again, after the backoff, for this long (0: never)
    secret_file: Optional[text()] = None  # shared by prefill and decode; none: the server stays on loopback
    max_connections: integer(1, 4096) = 64  # sessions per prefill server (+ 16 unauthenticated, 8 per address; docs/security.md)
    idle_s: seconds(86_400) = 60.0  # an authenticated peer silent this long is dropped (it reconnects when it asks)

    def __post_init__(self):
        if self.port_base is None:
            force_setattr(self, "port_base", 0)


class RoomLogConfig(Struct, frozen=True, forbid_unknown_fields=True):
    dir: text() = "probe-logs"
    max_bytes: integer(1024, 1 << 36) = 64 << 20
    max_files: integer(1, 10_000) = 8
    gzip: bool = True
    queue_size: integer(1, 1_000_000) = 10_000
    # written in every room record and joined on by `diff` (docs/roomlog.md); "": none
    cluster: Annotated[str, Meta(max_length=128, extra={"means": CLUSTER_MEANS})] = ""

    def __post_init__(self):
        if not self.cluster.isprintable():  # the diff joins on it and prints it
            raise Invalid("cluster", CLUSTER_MEANS)


class DigestConfig(Struct, frozen=True, forbid_unknown_fields=True):
    """How the background collector learns that a batch's digest kernel is done.
    The choices are digest.engine.WAITS, OUTPUTS, DEPENDENT_LAUNCHES and DEFER_AT (a test keeps them equal)."""

    collector_wait: Literal["block", "poll"] = "block"  # "block": sleep in the driver until done; "poll": query, sleeping between
    outputs: Literal["device", "pinned"] = "device"  # where the kernel stores: "device" (copied down) or "pinned" (no copies)
    dependent_launch: Literal["auto", "off"] = "auto"  # "auto": programmatic dependent launches where the GPU has them; "off"
    # the collector sleeps this long while the serving thread keeps submitting (docs/overhead.md); 0: never
    collector_defer_ms: milliseconds(1000) = 3.0
    # where: before the batch's first device call ("first_call") or once its kernel is done ("done")
    collector_defer_at: Literal["first_call", "done"] = "first_call"


class MetricsConfig(Struct, frozen=True, forbid_unknown_fields=True):
    port: Optional[Port] = None  # our own exporter, only outside SGLang (it serves /metrics itself)
    addr: text() = "127.0.0.1"  # where that exporter listens; a wildcard or routable address is logged at WARNING


class DiagnosisConfig(Struct, frozen=True, forbid_unknown_fields=True):
    """What a mismatch's bad cells became, and the page events behind them (docs/diagnosis.md)."""

    enabled: bool = True  # serving cost measured within 1% on both serving legs (docs/diagnosis.md)
    journal_events: integer(1, 10_000_000) = 16384  # page events kept per process (the oldest go first)
    journal_per_page: integer(1, 64) = 8  # events shown per bad cell
    index_cells: integer(1, 1_000_000_000) = 4_000_000  # content digests kept on decode (8 bytes each)
    max_cells_per_room: integer(1, 100_000) = 64  # bad cells diagnosed per room record
    snapshot_on_allocation: bool = True  # digest a room's pages when decode allocates them (one launch)


class ConfigFile(Struct, frozen=True, forbid_unknown_fields=True):
    """The file's top level: its keys, and nothing else (`ProbeConfig` adds where it came from)."""

    mode: Mode = "observe"
    layout: text() = "auto"
    layouts: Optional[text()] = None  # extra layouts file (resolved path)
    step_interval: integer(0, 1_000_000) = 64
    targets: Targets = DEFAULT_TARGETS
    exchange: ExchangeConfig = field(default_factory=ExchangeConfig)
    roomlog: RoomLogConfig = field(default_factory=RoomLogConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    digest: DigestConfig = field(default_factory=DigestConfig)
    diagnosis: DiagnosisConfig = field(default_factory=DiagnosisConfig)
    hicache: HiCacheSettings = field(default_factory=HiCacheSettings)


class ProbeConfig(ConfigFile, frozen=True):
    """The config a process runs with: the file's values, paths resolved, and their source."""

    targets: tuple[str, ...] = DEFAULT_TARGETS
    hicache: Mapping[str, Any] = field(default_factory=dict)  # as written; dsv4_idxk_probe.hicache reads it
    source: str = "<defaults>"

    @property
    def enforce(self) -> bool:
        return self.mode == "enforce"


SECTIONS = ("exchange", "roomlog", "metrics", "digest", "diagnosis", "hicache")
_SECTION_TYPES = {"exchange": ExchangeConfig, "roomlog": RoomLogConfig, "metrics": MetricsConfig, "digest": DigestConfig,
                  "diagnosis": DiagnosisConfig}
_TOP_KEYS = set(ConfigFile.__struct_fields__)


def is_table_path(entry: str) -> bool:
    """Whether a `targets` entry is a file's path rather than a shipped table's name
    (``sglang``, ``sglang@0.5.21``): it names a folder, or a YAML file (``.yaml``, ``.yml``)."""
    return "/" in entry or os.sep in entry or entry.endswith((".yaml", ".yml"))


def _resolve_path(base: Path | None, value: str, source: str, name: str) -> str:
    """`value` with its ``~`` expanded, relative to `base`. A ``~user`` of no known user (or
    ``~`` with no home) is the config's error, naming the field: pathlib raises RuntimeError."""
    try:
        path = Path(value).expanduser()
    except RuntimeError:
        raise ConfigError(f"{source}: {name}: {value!r} starts with a '~' whose home directory is unknown here; "
                          f"write the path in full") from None
    if not path.is_absolute() and base is not None:
        path = base / path
    return str(path)


def parse_config(document: Any, source: str = "<config>", base_dir: Path | None = None, *,
                 node: Any = None) -> ProbeConfig:
    """Build a `ProbeConfig` from a parsed YAML document (None: all defaults).

    Relative paths (``layouts``, ``roomlog.dir``, ``exchange.secret_file``, targets given
    as paths) are resolved against `base_dir`, the config file's folder. `node`, the
    document's YAML root node, puts the line of a refused value in the message.
    """
    if document is None:
        document = {}
    if isinstance(document, Mapping):  # an empty section (`exchange:` alone) means its defaults
        document = {key: value for key, value in document.items() if not (key in SECTIONS and value is None)}
    parsed = convert(document, ConfigFile, ConfigError, source=source, node=node)
    values = {name: getattr(parsed, name) for name in ConfigFile.__struct_fields__}
    values["hicache"] = dict(document.get("hicache") or {})
    targets = (parsed.targets,) if isinstance(parsed.targets, str) else parsed.targets
    values["targets"] = tuple(_resolve_path(base_dir, t, source, "targets") if is_table_path(t) else t
                              for t in targets)
    if parsed.layouts is not None:
        values["layouts"] = _resolve_path(base_dir, parsed.layouts, source, "layouts")
    if "roomlog" in document and base_dir is not None:
        values["roomlog"] = replace(parsed.roomlog,
                                    dir=_resolve_path(base_dir, parsed.roomlog.dir, source, "roomlog.dir"))
    if parsed.exchange.secret_file:
        secret_file = _resolve_path(base_dir, parsed.exchange.secret_file, source, "exchange.secret_file")
        values["exchange"] = replace(parsed.exchange, secret_file=secret_file)
    config = ProbeConfig(**values, source=source)
    _check_layouts(config)
    return config


def _check_layouts(config: ProbeConfig) -> None:
    """The layouts file parses, and `layout` names one (shipped or from that file): a typo
    passed `check` and left every side of every pod inactive (`layout_unknown`)."""
    from .digest.layout import LayoutError, load_layouts, shipped_layouts

    try:
        extra = load_layouts(config.layouts) if config.layouts is not None else {}
    except LayoutError as exc:
        raise ConfigError(f"{config.source}: layouts: {exc}") from None
    if config.layout != "auto":
        names = sorted({*shipped_layouts(), *extra})
        if config.layout not in names:
            raise ConfigError(f"{config.source}: layout must be auto or one of {', '.join(names)}, "
                              f"got {shorten(config.layout)}")


def read_small_text(path: str | os.PathLike, what: str, max_bytes: int = MAX_CONFIG_BYTES) -> str:
    """A regular file's text, UTF-8, size-capped before it is read (`boundedfile`);
    every problem is a `ConfigError` naming the file."""
    return read_bounded_text(path, what, max_bytes, ConfigError)


def load_file(path: str | os.PathLike) -> ProbeConfig:
    """Read and validate one YAML config file."""
    path = Path(path)
    text = read_small_text(path, "config file")
    # no aliases, bounded nodes and depth, no duplicate keys; the root node gives lines to messages
    document, root = load_yaml(text, str(path), ConfigError, with_root=True)
    return parse_config(document, str(path), path.parent, node=root)


def _check_secret(config: ProbeConfig, where: str | None = None) -> None:
    """A configured secret must be readable now: a typo must not leave the exchange open or off silently.
    `where`: what named the file, when not the config's ``exchange.secret_file``."""
    if not config.exchange.secret_file:
        return
    from .exchange.auth import SecretError, load_secret

    try:
        load_secret(config.exchange.secret_file)
    except SecretError as exc:
        raise ConfigError(f"{where or f'{config.source}: exchange.secret_file'}: {exc}") from None


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
        names = tuple(t.strip() for t in targets.split(",") if t.strip())
        if not names:  # ",,,": the probe would patch nothing while `check` said all was well
            raise ConfigError(f"environment: {ev.DSV4_IDXK_PROBE_TARGETS} names no target table, got {targets!r}")
        config = replace(config, targets=names)
    secret_file = env.get(EXCHANGE_SECRET_FILE_ENV, "").strip()
    if secret_file:
        config = replace(config, exchange=replace(config.exchange, secret_file=secret_file))
    _check_secret(config, f"environment: {EXCHANGE_SECRET_FILE_ENV}" if secret_file else None)
    if config.enforce and env.get(ev.DSV4_IDXK_PROBE_FAULTS, "").strip():
        raise ConfigError(
            f"environment: {ev.DSV4_IDXK_PROBE_FAULTS} (fault injection) cannot be combined with enforce mode"
        )
    return config


def as_dict(config: ProbeConfig) -> dict[str, Any]:
    """Plain form for logs and `check` (sections as mappings)."""
    out: dict[str, Any] = {}
    for name in config.__struct_fields__:
        value = getattr(config, name)
        if isinstance(value, Struct):
            value = msgspec.structs.asdict(value)
        elif isinstance(value, tuple):
            value = list(value)
        elif isinstance(value, Mapping):
            value = dict(value)
        out[name] = value
    return out
