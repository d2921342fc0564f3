"""Every metric the probe exports, declared in one place.

Names are built under the ``dsv4_idxk_probe`` namespace; counters get
``_total`` from the client library; units are suffixes. Labels come only from
a small fixed set (never room or page). Each metric also carries the
process-wide base labels (role, model, rank) so one dashboard serves every
pod. The registry is injected: tests pass a fresh one, activation passes the
default (which SGLang's multiprocess collector reads).
"""

from __future__ import annotations

from collections import Counter as Tally
from typing import Mapping

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

NAMESPACE = "dsv4_idxk_probe"
BASE_LABELS = ("role", "model", "rank")

STAGES = ("prefill_send", "decode_recv", "decode_step", "decode_finish")
VERDICTS = ("match", "mismatch", "not_comparable", "unverified", "skipped")
# Patch-target statuses (the values sglang/targets.py reports; a test keeps them equal):
# patched: wrapped and verified; pending: waiting for its module's import or for
# SGLang's hook registry; missing: not in the installed SGLang; signature_changed:
# present, parameters differ; hook_error: our hook could not be built;
# not_applied: wrapping raised or did not take.
PATCH_STATUSES = ("patched", "pending", "missing", "signature_changed", "hook_error", "not_applied")
# Where records can be dropped, and which exchange calls can fail (zeroed at start).
DROP_SINKS = ("roomlog", "digest_queue", "hicache_index_checks", "hicache_roundtrip")
EXCHANGE_ERROR_KINDS = ("fetch",)
HICACHE_BRANCHES = ("page", "token_dsv4_mla", "token_rejected", "empty", "size_mismatch", "unsupported")

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
    """The probe's instruments, registered once into `registry`."""

    def __init__(self, registry: CollectorRegistry | None = REGISTRY, *, role: str = "", model: str = "", rank: str = ""):
        base = {"role": role, "model": model, "rank": str(rank)}

        def counter(name, doc, labels=()):
            return _Bound(Counter(name, doc, (*BASE_LABELS, *labels), namespace=NAMESPACE, registry=registry), base)

        def histogram(name, doc, labels=(), buckets=_SECONDS_BUCKETS):
            return _Bound(
                Histogram(name, doc, (*BASE_LABELS, *labels), namespace=NAMESPACE, registry=registry, buckets=buckets),
                base,
            )

        def gauge(name, doc, labels=(), mode="max"):
            return _Bound(
                Gauge(name, doc, (*BASE_LABELS, *labels), namespace=NAMESPACE, registry=registry, multiprocess_mode=mode),
                base,
            )

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
        self.digest_bytes = counter("digest_bytes", "Index-K bytes digested", ("stage",))
        self.digest_gpu_seconds = histogram("digest_gpu_seconds", "GPU time of one digest launch", ("stage",))
        self.verify_latency_seconds = histogram(
            "verify_latency_seconds", "From enqueue of a decode-side digest to its verdict", ("stage",)
        )
        self.exchange_errors = counter("exchange_errors", "Failed side-channel requests for digest vectors", ("kind",))
        self.records_dropped = counter("records_dropped", "Records dropped because a bounded queue was full", ("sink",))
        self.probe_errors = counter("probe_errors", "Exceptions inside the probe, caught and logged", ("site",))
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

    def zero_pd_series(self) -> None:
        """Create every (stage, verdict) series so a zero is visible from the start."""
        for stage in STAGES:
            self.rooms_digested.labels(stage=stage)
            self.digest_bytes.labels(stage=stage)
            self.first_divergence.labels(stage=stage)
            if stage != "prefill_send":
                for verdict in VERDICTS:
                    self.rooms_verified.labels(stage=stage, verdict=verdict)

    def zero_health_series(self) -> None:
        """Create the drop and exchange-error series at start.

        Alerts use increase(), which cannot see a counter's first value: a
        series born at 1 would hide the first burst of drops.
        """
        for sink in DROP_SINKS:
            self.records_dropped.labels(sink=sink)
        for kind in EXCHANGE_ERROR_KINDS:
            self.exchange_errors.labels(kind=kind)
