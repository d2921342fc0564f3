"""Every metric the probe exports, declared in one place.

Names are built under the ``dsv4_idxk_probe`` namespace; counters get
``_total`` from the client library; units are suffixes. Labels come only from
a small fixed set (never room or page). Each metric also carries the process
labels SGLang puts on its own scheduler metrics (``model_name``,
``engine_type``, ``tp_rank``, ...; same names, same values), so a probe series
joins SGLang's with ``on(model_name, tp_rank)``. The registry is injected:
tests pass a fresh one, activation passes the default (which SGLang's
multiprocess collector reads).
"""

from __future__ import annotations

import re
import threading
from collections import Counter as Tally
from typing import Mapping

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from ..version import __version__
from ..vocabulary import (
    COVERAGE_OUTCOMES, COVERAGE_PATHS, COVERAGE_REASONS, DECODE_STAGES, DIAGNOSIS_KINDS, PATCH_STATUSES, VERDICTS,
)
from .serving import live_gauges_only

NAMESPACE = "dsv4_idxk_probe"
# SGLang 0.5.23's scheduler metric labels, in its order
# (srt/observability/metrics_collector.py, SchedulerMetricsCollector.init_new);
# it adds dp_rank only when the process has a DP rank, and so do we. A test
# holds these equal to what the installed SGLang builds.
PROCESS_LABELS = ("model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank")
OPTIONAL_PROCESS_LABELS = ("dp_rank",)
# SGLang's engine_type values (DisaggregationMode.to_engine_type, plus "dynamic"
# under --enable-pd-role-switch).
ENGINE_TYPES = ("prefill", "decode", "unified", "dynamic")
UNKNOWN = "unknown"  # a label value SGLang has not published (never an empty value)
# Every gauge of the probe is a state of a running process (info, patch targets, host
# pools): in a multiprocess directory a "live" gauge is forgotten with its process
# (serving.live_gauges_only), where a plain "max" one would stay after a restart.
STATE_GAUGE_MODE = "livemax"

# Where records can be dropped, and which exchange calls can fail (zeroed at start).
DROP_SINKS = ("roomlog", "digest_queue", "hicache_index_checks", "hicache_roundtrip")
EXCHANGE_ERROR_KINDS = ("fetch",)
# The part of the probe a caught exception came from: the first word of its
# site ("decode.on_result" -> decode). The full site is in the log line.
ERROR_COMPONENTS = ("prefill", "decode", "digest", "hicache", "hook", "patch", "other")
_COMPONENT_OF_PREFIX = {"factory": "patch"}
# What decode can count for a PD room's bytes (pd/coverage.py; docs/coverage.md): zeroed at start
# on decode, so the coverage panel and alert read 0 rather than nothing. Prefill counts no PD bytes.
PD_COVERAGE = {
    "verified": ("none",),
    "not_comparable": ("pp_stage", "layout_differs", "truncated_by_transfer", "length_differs", "probe_error", "other"),
    "unverified": ("no_exchange", "layout_unknown", "metadata_on_device", "pp_stage", "probe_error"),
    "skipped": ("retracted", "aborted", "transfer_failed", "evicted", "host_dest", "queue_full", "probe_error", "other"),
}
# The probe's own state (dsv4_idxk_probe_info): state -> the reasons it can have.
STATES = {
    "on": ("running",),
    "off": ("uninstalled",),
    "broken": ("config_error", "target_table_error", "start_error"),
    # installed, but a side verifies nothing: its pool cannot be read (layout_unknown: HIP fp4,
    # aiter orders, NPU pages, a layout no entry describes), is not DeepSeek-V4, or failed to build
    "inactive": ("layout_unknown", "not_dsv4", "build_failed"),
}


def error_component(site: str) -> str:
    prefix = str(site).split(".", 1)[0]
    prefix = _COMPONENT_OF_PREFIX.get(prefix, prefix)
    return prefix if prefix in ERROR_COMPONENTS else "other"


def process_labels(identity: Mapping[str, object] | None = None, *, role: str | None = None) -> dict[str, str]:
    """This process's label values: SGLang's where it published them, never empty.

    `identity` is what `sglang.accessors.identity()` returns (SGLang's own label
    dict); `role` fills ``engine_type`` outside SGLang (the rig, tools, tests).
    Extra labels SGLang carries (``--extra-metric-labels``) are kept when they
    are valid names that do not collide with the probe's own labels.
    """
    identity = dict(identity or {})
    out = {name: _value(identity.get(name)) for name in PROCESS_LABELS}
    if role and out["engine_type"] == UNKNOWN:
        out["engine_type"] = str(role)
        for name in ("tp_rank", "pp_rank", "moe_ep_rank"):  # outside SGLang a process is one rank
            if out[name] == UNKNOWN:
                out[name] = "0"
    for name in OPTIONAL_PROCESS_LABELS:
        if identity.get(name) not in (None, ""):
            out[name] = _value(identity[name])
    for name, value in identity.items():
        if name not in out and name not in PROCESS_LABELS and name not in OPTIONAL_PROCESS_LABELS \
                and name not in _OWN_LABELS and _LABEL_NAME.fullmatch(str(name)):
            out[str(name)] = _value(value)
    return out


def _value(value: object) -> str:
    text = "" if value is None else str(value)
    return text if text else UNKNOWN


_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_OWN_LABELS = frozenset({
    "stage", "verdict", "segment", "layer", "page_bucket", "kind", "sink", "component", "target", "status",
    "pool", "direction", "io_backend", "layout", "branch", "check", "action", "leg", "invariant",
    "page_aligned_only", "token_path_eligible", "state", "reason", "mode", "version", "le", "path", "outcome",
    "gpu_uuid", "hostname", "cuda_device",
})

_SECONDS_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0)


def page_bucket(page: int) -> str:
    """Label for a logical page: the power of two at or below it ("0" for page 0).

    Bucket "b" holds pages [b, 2b), so a room of 4096 pages spans 13 buckets:
    coarse enough to be a label, fine enough to tell "the first pages" from
    "the tail" in Grafana. Exact pages are in the room log and `report`.
    """
    page = int(page)
    if page < 0:
        raise ValueError(f"logical page must be >= 0, got {page}")
    return "0" if page == 0 else str(1 << (page.bit_length() - 1))


def counter_add(child):
    """`child.inc` without prometheus_client's per-call checks, for a hot path: the value
    object's own `inc(amount)`, which `Counter.inc` calls after checking that the metric is
    observable (a labelled child always is) and the amount not negative (the caller's
    never is): three Python frames fewer per increment, on the collector thread for every
    record. `child.inc` where a client version keeps no such value object."""
    value = getattr(child, "_value", None)
    inc = getattr(value, "inc", None)
    return inc if callable(inc) else child.inc


class _Bound:
    """A metric whose base labels are already filled in.

    Children are cached by their labels, as prometheus_client advises for hot
    paths: `labels()` validates and locks on every call (a few microseconds,
    holding the GIL the serving thread needs), a dict lookup does not. Label
    values are bounded by design (stages, verdicts, page buckets), and the
    cache is cleared if a caller ever proves otherwise.
    """

    _MAX_CHILDREN = 4096

    def __init__(self, metric, base: Mapping[str, str]):
        self._metric = metric
        self._base = dict(base)
        self._children: dict = {}

    def labels(self, **labels):
        key = tuple(labels.items())
        child = self._children.get(key)
        if child is None:
            child = self._metric.labels(**self._base, **labels)
            if len(self._children) >= self._MAX_CHILDREN:
                self._children.clear()
            self._children[key] = child
        return child


class ProbeMetrics:
    """The probe's instruments, registered once into `registry`.

    `labels` are the process labels (see `process_labels`); outside SGLang,
    `role` alone names the engine type. Building it publishes
    ``dsv4_idxk_probe_info{state="on"}``: every probe process has that series,
    which is what the dashboard's variables and the "absent" alert read.
    """

    def __init__(self, registry: CollectorRegistry | None = REGISTRY, *, labels: Mapping[str, object] | None = None,
                 role: str | None = None, mode: str = "observe"):
        base = process_labels(labels, role=role)
        self.process_labels = dict(base)
        self.engine_type = base["engine_type"]
        names = tuple(base)

        def counter(name, doc, labels=()):
            return _Bound(Counter(name, doc, (*names, *labels), namespace=NAMESPACE, registry=registry), base)

        def histogram(name, doc, labels=(), buckets=_SECONDS_BUCKETS):
            return _Bound(
                Histogram(name, doc, (*names, *labels), namespace=NAMESPACE, registry=registry, buckets=buckets),
                base,
            )

        def gauge(name, doc, labels=(), mode=STATE_GAUGE_MODE):
            return _Bound(
                Gauge(name, doc, (*names, *labels), namespace=NAMESPACE, registry=registry, multiprocess_mode=mode),
                base,
            )

        self.info = ProbeInfo(registry, base)
        self.info.set("on", "running", mode)
        # PD verification
        self.rooms_digested = counter("rooms_digested", "Rooms whose index-K was digested", ("stage",))
        self.rooms_verified = counter("rooms_verified", "Room verdicts at each decode stage", ("stage", "verdict"))
        self.mismatch_cells = counter(
            "mismatch_cells", "Differing (layer, page) cells, bounded by the localisation", ("stage", "segment")
        )
        self.mismatch_layer_hits = counter(
            "mismatch_layer_hits",
            "Mismatching rooms in which this global layer id differed (layer heat)",
            ("stage", "layer"),
        )
        self.mismatch_page_bucket_hits = counter(
            "mismatch_page_bucket_hits",
            "Differing logical pages, by power-of-two bucket of the page index (page heat; see page_bucket)",
            ("stage", "page_bucket"),
        )
        self.first_divergence = counter(
            "first_divergence", "Mismatching rooms by the first stage that saw the difference", ("stage",)
        )
        self.diagnoses = counter(
            "diagnoses", "Bad cells by what their bytes became, at the room's first mismatching stage "
            "(docs/diagnosis.md)", ("stage", "kind"),
        )
        self.digest_bytes = counter("digest_bytes", "Index-K bytes digested", ("stage",))
        self.digest_gpu_seconds = histogram("digest_gpu_seconds", "GPU time of one digest launch", ("stage",))
        self.verify_latency_seconds = histogram(
            "verify_latency_seconds", "From enqueue of a decode-side digest to its verdict", ("stage",)
        )
        self.coverage_bytes = counter(
            "coverage_bytes", "Index-K bytes moved, by path and what became of their verification "
            "(reason says why when not verified; docs/coverage.md)", ("path", "outcome", "reason"),
        )
        self.mismatch_unlocalised = counter(
            "mismatch_unlocalised", "Mismatch verdicts decode could not localise: prefill's digest vectors could not "
            "be fetched (docs/coverage.md)", ("stage",),
        )
        self.exchange_errors = counter("exchange_errors", "Failed side-channel requests for digest vectors", ("kind",))
        self.records_dropped = counter("records_dropped", "Records dropped because a bounded queue was full", ("sink",))
        self.errors = counter(
            "errors", "Exceptions caught inside the probe (serving continued), by the part of the probe that raised",
            ("component",),
        )
        self.patch_target_status = gauge(
            "patch_target_status", "1 on each patch target's current status, 0 on the others (PATCH_STATUSES)", ("target", "status")
        )
        self.patch_target_required = gauge(
            "patch_target_required", "1 for each patch target the target table marks required", ("target",)
        )
        # HiCache host pools
        self.hicache_copies = counter(
            "hicache_copies", "Host-pool copy calls by branch taken", ("pool", "direction", "io_backend", "layout", "branch")
        )
        self.hicache_pages = counter("hicache_pages", "Pages moved by host-pool copies", ("pool", "direction"))
        self.hicache_tokens = counter("hicache_tokens", "Tokens moved by host-pool copies", ("pool", "direction"))
        self.hicache_index_violations = counter(
            "hicache_index_violations", "Index groups that are not whole, aligned, in-range pages", ("pool", "direction", "check")
        )
        self.hicache_guard = counter(
            "hicache_guard", "Token-granular copies on a pool whose rows are not the C4 latent row", ("pool", "action")
        )
        self.hicache_roundtrip = counter(
            "hicache_roundtrip", "Round-trip digest checks of host-pool rows", ("pool", "leg", "verdict")
        )
        self.hicache_pool_info = gauge(
            "hicache_pool_info", "1 per host pool, with its geometry", ("pool", "layout", "page_aligned_only", "token_path_eligible")
        )
        self.hicache_invariant_violations = counter(
            "hicache_invariant_violations", "Host-pool construction invariants that failed", ("pool", "invariant")
        )
        # Which GPU this rank runs on (metrics/gpu_identity.py), to set a corrupt room beside
        # that GPU's DCGM XID/ECC counters (DCGM's UUID label equals gpu_uuid).
        self.gpu_info = gauge(
            "gpu_info", "1 per process on a GPU: its CUDA device's UUID (as DCGM's UUID label), host name "
            "and device index in the process", ("gpu_uuid", "hostname", "cuda_device"),
        )

    def publish_gpu(self, gpu: Mapping[str, str] | None) -> None:
        """Set `dsv4_idxk_probe_gpu_info` once (`gpu_identity.gpu_identity()`); None (no CUDA
        device: CPU) publishes nothing."""
        if gpu:
            self.gpu_info.labels(gpu_uuid=str(gpu["gpu_uuid"]), hostname=str(gpu["hostname"]),
                                 cuda_device=str(gpu["cuda_device"])).set(1)

    def set_patch_target(self, target: str, status: str, required: bool) -> None:
        """Publish one target's status: 1 on its current status, 0 on the others."""
        if status not in PATCH_STATUSES:
            raise ValueError(f"unknown patch status {status!r}; known: {', '.join(PATCH_STATUSES)}")
        for candidate in PATCH_STATUSES:
            self.patch_target_status.labels(target=target, status=candidate).set(1 if candidate == status else 0)
        self.patch_target_required.labels(target=target).set(1 if required else 0)

    def observe_localisation(self, stage: str, layers, pages) -> None:
        """Count a localised mismatch into the layer and page-bucket heat counters."""
        for layer in layers:
            self.mismatch_layer_hits.labels(stage=stage, layer=str(int(layer))).inc()
        for bucket, n in Tally(page_bucket(p) for p in pages).items():
            self.mismatch_page_bucket_hits.labels(stage=stage, page_bucket=bucket).inc(n)

    def count_coverage(self, path: str, outcome: str, reason: str, nbytes: int) -> None:
        """Count `nbytes` of index-K moved on `path` with `outcome` (and why, when not verified).

        Unknown words become "other" rather than raising: the serving thread may call this.
        """
        path = path if path in COVERAGE_PATHS else "other"
        outcome = outcome if outcome in COVERAGE_OUTCOMES else "unverified"
        reason = reason if reason in COVERAGE_REASONS else "other"
        self.coverage_bytes.labels(path=path, outcome=outcome, reason=reason).inc(max(0, int(nbytes)))

    def count_error(self, site: str) -> None:
        """One caught exception at `site` ("decode.on_result"): counted by component."""
        self.errors.labels(component=error_component(site)).inc()

    def zero_pd_series(self) -> None:
        """Create, at zero, every series this process's engine type can produce.

        Alerts use increase(), which cannot see a counter's first value, and a
        panel with no series shows "No data" rather than 0. Only label sets
        that can occur: prefill digests at prefill_send and never judges;
        decode judges at the decode stages; a unified or unknown engine does
        no PD verification.
        """
        prefill, decode = self._sides()
        stages = (("prefill_send",) if prefill else ()) + (DECODE_STAGES if decode else ())
        for stage in stages:
            self.rooms_digested.labels(stage=stage)
            self.digest_bytes.labels(stage=stage)
        if decode:
            for stage in DECODE_STAGES:
                self.first_divergence.labels(stage=stage)
                for kind in DIAGNOSIS_KINDS:
                    self.diagnoses.labels(stage=stage, kind=kind)
                for verdict in VERDICTS:
                    self.rooms_verified.labels(stage=stage, verdict=verdict)
                self.mismatch_unlocalised.labels(stage=stage)
            for outcome, reasons in PD_COVERAGE.items():
                for reason in reasons:
                    self.coverage_bytes.labels(path="pd", outcome=outcome, reason=reason)
        self.zero_health_series()

    def zero_health_series(self) -> None:
        """Create the drop, exchange-error and error series at start (see zero_pd_series)."""
        prefill, decode = self._sides()
        for sink in DROP_SINKS:
            if sink == "digest_queue" and not (prefill or decode):
                continue
            self.records_dropped.labels(sink=sink)
        if decode:
            for kind in EXCHANGE_ERROR_KINDS:
                self.exchange_errors.labels(kind=kind)
        for component in ERROR_COMPONENTS:
            if (component == "prefill" and not prefill) or (component == "decode" and not decode):
                continue
            self.errors.labels(component=component)

    def _sides(self) -> tuple[bool, bool]:
        """(does prefill work, does decode work) for this engine type."""
        kind = self.engine_type
        return kind in ("prefill", "dynamic"), kind in ("decode", "dynamic")


# %% the probe's own state


_info_lock = threading.Lock()
_info_by_registry: dict[int, tuple] = {}


class ProbeInfo:
    """``dsv4_idxk_probe_info``: 1 on the probe's current (state, reason), 0 on the
    ones it had before; labels also say the mode and the package version.

    A probe whose config is invalid publishes only this series (state
    "broken"), so an alert can tell "off by error" from "not installed".
    One gauge per registry: a process publishes its state more than once.
    """

    def __init__(self, registry: CollectorRegistry | None, labels: Mapping[str, str]):
        live_gauges_only()  # before this process's first gauge: gone processes' state is forgotten
        key = id(registry)
        with _info_lock:
            entry = _info_by_registry.get(key)
            if entry is None or entry[0] is not registry:
                names = tuple(labels)  # the first publisher's process labels name the series
                gauge = Gauge(
                    "info", "The probe's state in this process: 1 on its current state and reason",
                    (*names, "state", "reason", "mode", "version"), namespace=NAMESPACE, registry=registry,
                    multiprocess_mode=STATE_GAUGE_MODE,
                )
                entry = (registry, gauge, {}, names)
                _info_by_registry[key] = entry  # the registry stays alive: ids are not reused
        _, self._gauge, self._current, self._names = entry
        self._labels = dict(labels)

    def set(self, state: str, reason: str, mode: str = "observe") -> None:
        if reason not in STATES.get(state, ()):
            raise ValueError(f"unknown probe state {state!r}/{reason!r}; known: {STATES}")
        values = {name: self._labels.get(name, UNKNOWN) for name in self._names}
        key = tuple(values.values())
        with _info_lock:
            previous = self._current.get(key)
            if previous is not None:
                self._gauge.labels(**values, **previous).set(0)
            now = {"state": state, "reason": reason, "mode": str(mode), "version": __version__}
            self._gauge.labels(**values, **now).set(1)
            self._current[key] = now
